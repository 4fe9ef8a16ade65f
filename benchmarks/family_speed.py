"""GDN-2, (Gated) DeltaProduct and the DPLR delta rule: each chunk form against its recurrent
form on the CPU (speed), the PyTorch chunk forms (no compiled kernel of their own).

Usage::

    python -m benchmarks.run family_speed              # T = 2048, B = 1, H = 4, K = V = 64, fp32, 1 thread
    python -m benchmarks.run family_speed --T 1024 --threads 2

Time of the forward (under ``torch.no_grad``, as inference runs it), and of forward + backward of
``(o·do).sum() + (h_T·dh).sum()``, median (``--stat min``: best) of ``--repeats`` runs after one warm-up, the recurrent
and chunk forms interleaved run by run in one process (the ratio is what to read: the machines
here are shared). ``--clock cpu`` times the calling thread's CPU time instead of wall time (with
one thread, what other processes on a shared machine do not add to). DeltaProduct runs n_h = 2
(T·n_h = 4096 Householder steps). Writes ``docs/results/family_speed.json``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Tuple

import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.config import atomic_write_text, flag

from ._shapes import OpShape

N_H = 2


def family_inputs(family: str, B, T, H, K, V, seed=0):
    """Random inputs of one family (keyword arguments of its forms, fla's layout)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    if family == "gdn2":
        return dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V),
                    g=F.logsigmoid(rand(B, T, H, K) + 3), b=2 * torch.rand(B, T, H, K, generator=gen),
                    w=torch.rand(B, T, H, V, generator=gen))
    if family == "deltaproduct":
        return dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T * N_H, H, K), dim=-1), v=rand(B, T * N_H, H, V),
                    g=F.logsigmoid(rand(B, T, H) + 3), beta=2 * torch.rand(B, T * N_H, H, generator=gen),
                    num_householder=N_H, allow_neg_eigval=True)
    kappa = F.normalize(rand(B, T, H, K), dim=-1)
    return dict(q=rand(B, T, H, K), k=rand(B, T, H, K) * 0.5, v=rand(B, T, H, V), a=-kappa,
                b=kappa * torch.rand(B, T, H, K, generator=gen), gk=-0.6 * torch.rand(B, T, H, K, generator=gen))


FAMILIES = {
    "gdn2": (ops.recurrent_gdn2, ops.chunk_gdn2),
    "deltaproduct": (ops.recurrent_gated_delta_product, ops.chunk_gated_delta_product),
    "dplr": (ops.recurrent_dplr_delta_rule, ops.chunk_dplr_delta_rule),
}


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def once(fn, x, options, backward, clock=time.perf_counter) -> float:
    leaves = {n: (t.detach().clone().requires_grad_(backward) if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
    start = clock()
    with torch.set_grad_enabled(backward):
        o, h = fn(**leaves, output_final_state=True, **options)
        if backward:
            ((o * torch.ones_like(o)).sum() + (h * 0.5).sum()).backward()
    return clock() - start


STATS = {"median": statistics.median, "min": min}


def timed_pair(forms, x, backward, repeats, clock=time.perf_counter, stat=statistics.median) -> Tuple[float, ...]:
    """``stat`` (median, or the best) of the times of each ``(fn, options)`` in ``forms``, run interleaved
    after one warm-up each."""
    for fn, options in forms:
        once(fn, x, options, backward, clock)  # warm-up
    times = [[] for _ in forms]
    for _ in range(repeats):
        for spent, (fn, options) in zip(times, forms):
            spent.append(once(fn, x, options, backward, clock))
    return tuple(stat(spent) for spent in times)


@dataclass
class Config(OpShape):
    """The flags of ``python -m benchmarks.run family_speed``: the shared op shape (``_shapes.OpShape``)
    and these."""

    chunk_size: int = field(default=32, metadata=flag(type=int, help="default 32"))
    clock: str = field(default="wall", metadata=flag(choices=list(CLOCKS), help="wall time or the thread's CPU time "
                                                                                 "(default wall)"))
    stat: str = field(default="median", metadata=flag(choices=list(STATS), help="the median of the repeats or the "
                                                                               "best (min; default median)"))
    forward_only: bool = field(default=False, metadata=flag(action="store_true", help="time the forward only (the "
                                                                                       "recurrent backward takes ~15 s)"))
    families: Tuple[str, ...] = field(default=tuple(FAMILIES), metadata=flag(
        parse=tuple, nargs="+", choices=list(FAMILIES), help="which families (default all)"))
    json: str = field(default="docs/results/family_speed.json", metadata=flag(help="default docs/results/family_speed.json"))


def main(args: Config) -> int:
    torch.set_num_threads(args.threads)
    shape = dict(B=args.B, T=args.T, H=args.H, K=args.K, V=args.V, dtype="float32", threads=torch.get_num_threads(),
                 chunk_size=args.chunk_size, num_householder=N_H, clock=args.clock, repeats=args.repeats, stat=args.stat)
    clock = CLOCKS[args.clock]
    print(f"chunk vs recurrent, {shape}")
    print(f"{'family':13} {'rec fwd s':>10} {'chunk fwd s':>12} {'x':>6} {'rec f+b s':>10} {'chunk f+b s':>12} {'x':>6}")
    rows = []
    for family in args.families:
        recurrent, chunk = FAMILIES[family]
        x = family_inputs(family, args.B, args.T, args.H, args.K, args.V)
        row = dict(family=family)
        forms = ((recurrent, {}), (chunk, dict(chunk_size=args.chunk_size)))
        row["recurrent_forward_s"], row["chunk_forward_s"] = timed_pair(forms, x, False, args.repeats, clock, STATS[args.stat])
        row["forward_speedup"] = row["recurrent_forward_s"] / row["chunk_forward_s"]
        if not args.forward_only:
            row["recurrent_forward_backward_s"], row["chunk_forward_backward_s"] = timed_pair(
                forms, x, True, args.repeats, clock, STATS[args.stat])
            row["forward_backward_speedup"] = row["recurrent_forward_backward_s"] / row["chunk_forward_backward_s"]
        rows.append(row)
        both = (f"{row['recurrent_forward_backward_s']:10.3f} {row['chunk_forward_backward_s']:12.3f} "
                f"{row['forward_backward_speedup']:6.1f}" if not args.forward_only else f"{'-':>10} {'-':>12} {'-':>6}")
        print(f"{family:13} {row['recurrent_forward_s']:10.3f} {row['chunk_forward_s']:12.3f} {row['forward_speedup']:6.2f} "
              f"{both}", flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(dict(shape=shape, speed=rows), indent=1))
        print(f"wrote {args.json}")
    return 0

