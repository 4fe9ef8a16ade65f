"""Experiments on the memories, each a library function with a command line.

=============  ===============================================  ===============================
study          what it runs                                     entry point
=============  ===============================================  ===============================
``capacity``   recall under a fixed capacity (the reference     :func:`capacity.run_capacity`
               protocol of docs/worked_examples.md §5, more
               arms, a width sweep)
``costs``      the per-solver audit (state, update and query    :func:`costs.run_costs`
               cost) and the memory-per-session calculator
``retrieval``  Schlag et al. (2021) retrieval settings 1 and 2  :func:`retrieval.run_retrieval`
``mqar``       multi-query associative recall (Arora et al.     :func:`mqar.run_mqar`
               2023) on :class:`fastweights.models.LM`
``state-       parity, sums mod m and permutation-group word    :func:`state_tracking.
tracking``     problems: which memory tracks state, at longer   run_state_tracking`
               lengths than it was trained on (Grazzi et al.
               2025; Siems et al. 2025)
=============  ===============================================  ===============================

Every study is deterministic given its root seed, has a quick default and a
``full`` setting, prints a table (``report(result)``), and with an output folder
writes ``<study>.json``, ``<study>.csv`` and PNG plots. The capacity, costs and
retrieval studies call :mod:`fastweights.ops` directly (docs/design.md: a study never
re-implements a layer; a raw memory is an op); MQAR and state tracking train full models.

Run one from the shell with ``fastweights study <name> [--full] [--out DIR]``.
"""

from __future__ import annotations

import importlib

STUDIES = {
    "capacity": "fastweights.studies.capacity",
    "costs": "fastweights.studies.costs",
    "retrieval": "fastweights.studies.retrieval",
    "mqar": "fastweights.studies.mqar",
    "state-tracking": "fastweights.studies.state_tracking",
}


def get_study(name: str):
    """The module of study ``name``; a ``ValueError`` naming ``study`` for an unknown one."""
    if name not in STUDIES:
        raise ValueError(f"unknown `study` {name!r}; expected one of {', '.join(STUDIES)}")
    return importlib.import_module(STUDIES[name])


__all__ = ["STUDIES", "get_study"]
