"""``fastweights examples``: the worked examples, recomputed by the ops."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("examples", help="print every worked example beside the number docs/worked_examples.md gives")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..studies.worked_examples import print_examples

    print("fastweights: the worked examples, computed by fastweights.ops (float64)")
    print("(docs/worked_examples.md §2-3 write W = Σ v kᵀ; there we print the op's state transposed)")
    return 0 if print_examples() else 1
