"""The ``fastweights`` command.

Subcommands live in their own modules and register themselves here, so each
part of the library owns its command line::

    fastweights bench         time the delta rule's chunk path against its baselines (JSON)
    fastweights examples      print the seeds' worked examples beside the text's numbers
    fastweights train         train an LM on a text file or the built-in recall task
    fastweights generate      continue a prompt with a trained checkpoint
    fastweights demo          the main job: DeltaNet vs linear attention on recall with overwrites
    fastweights study NAME    reproduce a seed's experiment (capacity, costs, retrieval, mqar)
    fastweights lab           the seeds' demos as a local web page (sliders; numbers from the ops)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from .allocator import tune_cpu_allocator

# name -> module with `add_parser(subparsers)`; each parser sets `func(args) -> int`.
COMMANDS = {
    "bench": "fastweights.commands.bench",
    "examples": "fastweights.commands.examples",
    "study": "fastweights.commands.study",
    "train": "fastweights.commands.train",
    "generate": "fastweights.commands.generate",
    "demo": "fastweights.commands.demo",
    "lab": "fastweights.commands.lab",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastweights", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    tune_cpu_allocator()  # keep freed memory in the process: see fastweights/allocator.py
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # bad input (a config, a file, a prompt): the message, not a traceback
        parser.exit(2, f"fastweights {args.command}: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
