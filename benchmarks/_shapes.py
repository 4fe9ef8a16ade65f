"""The flags several benchmarks share, declared once: their ``Config`` dataclasses extend these.

``Threads`` is torch's thread count; ``OpShape`` adds an op call's shape ``q, k [B, T, H, K]``,
``v [B, T, H, V]`` and the number of timed repeats. Defaults are those the op benchmarks
(``family_speed``, ``kda_speed``) have always had; a benchmark that needs other defaults declares
its own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastweights.config import flag

__all__ = ["Threads", "OpShape"]


@dataclass
class Threads:
    """``--threads``: ``torch.set_num_threads`` for the run (reported with the results)."""

    threads: int = field(default=1, metadata=flag(type=int, help="default 1"))


@dataclass
class OpShape(Threads):
    """``--B --T --H --K --V --repeats`` (and ``--threads``): one op call's shape and its timed repeats."""

    B: int = field(default=1, metadata=flag(type=int, help="default 1"))
    T: int = field(default=2048, metadata=flag(type=int, help="default 2048"))
    H: int = field(default=4, metadata=flag(type=int, help="default 4"))
    K: int = field(default=64, metadata=flag(type=int, help="default 64"))
    V: int = field(default=64, metadata=flag(type=int, help="default 64"))
    repeats: int = field(default=3, metadata=flag(type=int, help="default 3"))
