"""The ``fastweights`` command.

Subcommands live in their own modules and register themselves here, so each
part of the library owns its command line::

    fastweights bench         time the delta rule's chunk path against its baselines (JSON)
    fastweights examples      print the worked examples beside the numbers docs/worked_examples.md gives
    fastweights train         train an LM on a text file or the built-in recall task
    fastweights generate      continue a prompt with a trained checkpoint
    fastweights eval          score a checkpoint on a text file: loss, bits per byte, perplexity
    fastweights export        write a run's model (single-process or FSDP-sharded) as one safetensors file
    fastweights demo          the main job: DeltaNet vs linear attention on recall with overwrites
    fastweights study NAME    run an experiment (capacity, costs, retrieval, mqar)
    fastweights lab           interactive demos as a local web page (sliders; numbers from the ops)
    fastweights hf            convert a checkpoint to a transformers folder and back (needs transformers)
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import math
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


# Integer flags that may be negative (seeds); every other int flag of every command is a
# size, a count or a port, where a negative value is always a mistake.
SIGNED_INTS = frozenset({"seed", "root_seed"})


def _finite_float(parse):
    def finite(text: str) -> float:
        value = parse(text)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        return value
    finite.__name__ = "finite number"  # argparse says "invalid finite number value: 'x'" for unparsable text
    return finite


def _non_negative_int(parse):
    def non_negative(text: str) -> int:
        value = parse(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
        return value
    non_negative.__name__ = "int"
    return non_negative


def guard_numbers(parser: argparse.ArgumentParser) -> None:
    """Every ``type=float`` flag of ``parser`` and its subcommands refuses NaN and ±inf, and every
    ``type=int`` flag but the seeds refuses negatives: argparse's one line and exit code 2."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                guard_numbers(sub)
        elif action.type is float:
            action.type = _finite_float(float)
        elif action.type is int and action.dest not in SIGNED_INTS:
            action.type = _non_negative_int(int)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastweights", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(sub)
    guard_numbers(parser)
    return parser


# What torch and Python say when settings ask for more memory than there is, or for a
# tensor size that cannot exist: bad values, answered in one line.
_TOO_BIG = ("can't allocate memory", "out of memory", "Storage size calculation overflowed",
            "negative dimension", "invalid size", "numel: integer multiplication overflow")


def too_big(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure caused by the sizes asked for."""
    if isinstance(e, (MemoryError, OverflowError)):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _TOO_BIG)


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
    except (MemoryError, OverflowError, RuntimeError) as e:
        if not too_big(e):
            raise  # a bug: its traceback
        what = " ".join(str(e).split())[:200] or type(e).__name__
        parser.exit(1, f"fastweights {args.command}: error: the settings ask for more memory than this machine "
                       f"has, or for an impossible size ({what}); use smaller values\n")
    except KeyboardInterrupt:  # Ctrl-C outside a loop that handles it: one line, the shell's code
        parser.exit(130, f"fastweights {args.command}: interrupted\n")


if __name__ == "__main__":
    sys.exit(main())
