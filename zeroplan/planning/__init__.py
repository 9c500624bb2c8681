"""``zeroplan.plan``: fit, fewest GPUs, largest model, recommended stage and offload, time per step."""
