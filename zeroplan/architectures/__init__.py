"""Model architectures: parameter shapes of model families (``spec``), users' shapes files (``shapes_file``)."""
