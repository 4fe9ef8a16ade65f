"""The ``fastweights`` command.

Subcommands live in their own modules and register themselves here, so each
part of the library owns its command line::

    fastweights examples      print the seeds' worked examples beside the text's numbers
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

# name -> module with `add_parser(subparsers)`; each parser sets `func(args) -> int`.
COMMANDS = {
    "examples": "fastweights.commands.examples",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastweights", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
