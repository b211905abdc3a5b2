"""The `kiln` command line."""
