"""One module per training engine: reading its configuration, what it allocates and sends, emitting it.

``ENGINES`` maps the ``--engine`` name to the engine module's ``estimate(workload, nd, settings)``
(contract in ``zeroplan/engines/base.py``) and ``SETTINGS`` to its ``Settings`` model. Importing an
engine module imports no torch.
"""

from __future__ import annotations

from zeroplan.engines import deepspeed

ENGINES: dict = {
    "deepspeed": deepspeed.estimate,
}
SETTINGS: dict = {
    "deepspeed": deepspeed.Settings,
}
