"""``fastweights examples``: the seeds' worked examples, recomputed by the ops."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("examples", help="print every worked example of the seeds beside the number its text gives")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..studies.worked_examples import print_examples

    print("fastweights: the seeds' worked examples, computed by fastweights.ops (float64)")
    print("(the seeds write S = Σ v kᵀ; where a text prints S we print the op's state transposed)")
    return 0 if print_examples() else 1
