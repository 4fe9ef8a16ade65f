"""``fastweights bench``: training speed of the delta rule's chunk path (``fastweights/bench.py``)."""

from __future__ import annotations


def add_parser(sub) -> None:
    from ..bench import add_arguments, run

    p = sub.add_parser(
        "bench",
        help="time recurrent vs textbook chunk vs fast chunk delta rule (forward, forward+backward, memory); write JSON",
    )
    add_arguments(p)
    p.set_defaults(func=run)
