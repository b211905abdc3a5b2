"""Configuration: YAML files, dotted command-line overrides and typed TrainerArgs."""
