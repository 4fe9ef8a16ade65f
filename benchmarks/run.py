"""The one runner: ``python -m benchmarks.run NAME [NAME ...] [--flag value ...]``.

Each NAME is a key of :data:`benchmarks.REGISTRY`; the flags that follow the names are those of
the benchmark's ``Config`` (``python -m benchmarks.run NAME --help`` lists them) and are given to
every named benchmark. ``--list`` prints the registry. The exit code is the first non-zero one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, List, Optional

from fastweights.config import add_declared_arguments, config_from_declared

from . import REGISTRY


def load(name: str):
    """The module of the benchmark ``name`` (a ``ValueError`` naming the known ones otherwise)."""
    if name not in REGISTRY:
        raise ValueError(f"benchmarks: unknown benchmark {name!r}; known: {', '.join(REGISTRY)}")
    return importlib.import_module(f"benchmarks.{name}")


def parser_of(name: str) -> argparse.ArgumentParser:
    """The command line of one benchmark, made from its ``Config``."""
    module = load(name)
    doc = (module.__doc__ or REGISTRY[name]).strip().split("\n\n")[0]
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.run {name}", description=doc)
    add_declared_arguments(parser, module.Config)
    return parser


def config_of(name: str, argv: Optional[List[str]] = None) -> Any:
    """The ``Config`` of the benchmark ``name`` with the flags in ``argv`` (its defaults otherwise)."""
    args = parser_of(name).parse_args([] if argv is None else argv)
    return config_from_declared(args, load(name).Config)


def run(name: str, config: Any = None) -> int:
    """Run one benchmark with ``config`` (its default ``Config()`` when ``None``); its exit code."""
    module = load(name)
    rc = module.main(module.Config() if config is None else config)
    return int(rc or 0)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        width = max(map(len, REGISTRY))
        print(__doc__.strip().split("\n\n")[0] + "\n")
        for name, what in REGISTRY.items():
            print(f"  {name:{width}}  {what}")
        return 0
    names = []
    while argv and not argv[0].startswith("-"):
        names.append(argv.pop(0))
    for name in names:
        load(name)  # every name checked before anything runs
    for name in names:
        rc = run(name, config_of(name, argv))
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
