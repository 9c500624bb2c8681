"""Model architectures: parameter shapes of model families (``spec``), users' shapes files (``shapes_file``)."""

from zeroplan.architectures import hf_families  # noqa: F401, E402 - adds the newer families to hf_config.FAMILIES
