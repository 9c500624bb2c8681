"""Real training engines run under the validator's probes (``validate.probes``), one module per engine."""
