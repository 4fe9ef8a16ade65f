"""One module per ``fastweights`` subcommand (see ``fastweights/cli.py``)."""
