"""Model architectures: parameter shapes of model families (``spec``) and users' shapes files (``shapes_file``)."""
