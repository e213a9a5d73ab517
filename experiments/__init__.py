"""Studies and the command line: `python -m experiments <command> [options]`."""
