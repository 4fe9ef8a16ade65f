"""The ``fastweights`` command.

Subcommands live in their own modules and register themselves here, so each
part of the library owns its command line::

    fastweights bench         time the delta rule's chunk path against its baselines (JSON)
    fastweights examples      print the seeds' worked examples beside the text's numbers
    fastweights train         train an LM on a text file or the built-in recall task
    fastweights generate      continue a prompt with a trained checkpoint
    fastweights eval          score a checkpoint on a text file: loss, bits per byte, perplexity
    fastweights export        write a run's model (single-process or FSDP-sharded) as one safetensors file
    fastweights demo          the main job: DeltaNet vs linear attention on recall with overwrites
    fastweights study NAME    reproduce a seed's experiment (capacity, costs, retrieval, mqar)
    fastweights lab           the seeds' demos as a local web page (sliders; numbers from the ops)
    fastweights hf            convert a checkpoint to a transformers folder and back (needs transformers)
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys
from typing import List, Optional

from .training.allocator import tune_cpu_allocator

# name -> module with `add_parser(subparsers)`; each parser sets `func(args) -> int`.
COMMANDS = {
    "bench": "fastweights.commands.bench",
    "examples": "fastweights.commands.examples",
    "study": "fastweights.commands.study",
    "train": "fastweights.commands.train",
    "generate": "fastweights.commands.generate",
    "eval": "fastweights.commands.eval",
    "export": "fastweights.commands.export",
    "demo": "fastweights.commands.demo",
    "lab": "fastweights.commands.lab",
    "hf": "fastweights.commands.hf",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastweights", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    return parser


def subcommand_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def unknown_flag_message(parser: argparse.ArgumentParser, command: Optional[str], extras: List[str]) -> str:
    """``unrecognized arguments: --d-modle`` plus the nearest flag of the command, if one is close."""
    known = list(parser._option_string_actions)
    if command:
        known += list(subcommand_parser(parser, command)._option_string_actions)
    hints = []
    for arg in extras:
        flag = arg.split("=", 1)[0]
        if flag.startswith("-"):
            close = difflib.get_close_matches(flag, known, n=1, cutoff=0.75)
            if close:
                hints.append(f"{flag} (did you mean {close[0]}?)")
    message = f"unrecognized arguments: {' '.join(extras)}"
    return message + ("; " + ", ".join(hints) if hints else "")


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # argparse only says "unrecognized"; name the flag that was probably meant
        command = getattr(args, "command", None)
        (subcommand_parser(parser, command) if command else parser).error(unknown_flag_message(parser, command, extras))
    tune_cpu_allocator()  # keep freed memory in the process: see fastweights/training/allocator.py
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # bad input (a config, a file, a prompt): the message, not a traceback
        parser.exit(2, f"fastweights {args.command}: error: {e}\n")
    except KeyboardInterrupt:  # Ctrl-C outside a loop that handles it: one line, the shell's code
        parser.exit(130, f"fastweights {args.command}: interrupted\n")


if __name__ == "__main__":
    sys.exit(main())
