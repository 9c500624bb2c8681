"""One module per training engine: reading its configuration and emitting it for a planned option."""

from zeroplan.engines import fsdp2

ENGINES = {"fsdp2": fsdp2.estimate}
"""``--engine`` name -> the engine module's ``estimate(workload, nd, settings)`` (``engines.base``)."""
