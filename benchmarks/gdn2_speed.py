"""Gated DeltaNet-2 on the CPU: the compiled chunk forward (KDA's kernel with GDN-2's erase keys,
``fastweights/ops/cpu/chunk_kda.cpp``) against ``recurrent_gdn2``, the PyTorch chunk form
(``backend="torch"``) and the fp32 matmul rate, all in one process.

Usage::

    python -m benchmarks.run gdn2_speed                     # B 1, T 2048, (H 4, K = V = 64) and (H 8, K = V = 128)
    python -m benchmarks.run gdn2_speed --backward          # also forward + backward, compiled vs PyTorch path
    python -m benchmarks.run gdn2_speed --chunk-sizes 32 64 --repeats 9

Every case runs once per round, rounds interleaved (a shared machine disturbs every case alike),
after one warm-up round; each figure is the best (minimum) of ``--repeats`` rounds by the calling
thread's CPU time (``time.thread_time``; run with ``--threads 1``, the default, so that is all the
work a call did). Forwards run under ``torch.no_grad`` (as inference does; the chunk form then
keeps no chunk states). The matmul rate is ``torch.mm`` on two fp32 1024 × 1024 matrices; a chunk
form's FLOPs are counted as ``benchmarks/roofline.py`` counts KDA's (:func:`~.roofline.op_flops`:
the products of the chunk algorithm, not the decay factors). ``--chunk-sizes`` takes chunk lengths
and ``default`` (the op's own choice for the key size, ``chunk_size=None``). Writes
``docs/results/gdn2_speed.json``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

import torch

from fastweights import ops
from fastweights.config import atomic_write_text, flag

from ._shapes import Threads
from .family_speed import family_inputs
from .roofline import op_flops

SQUARE = 1024


def _shapes(text: str) -> Tuple[Tuple[int, int], ...]:
    """``"4x64,8x128"`` -> ``((4, 64), (8, 128))``: heads × head size (K = V)."""
    return tuple(tuple(int(p) for p in part.split("x")) for part in text.split(","))


@dataclass
class Config(Threads):
    """The flags of ``python -m benchmarks.run gdn2_speed``."""

    B: int = field(default=1, metadata=flag(type=int, help="default 1"))
    T: int = field(default=2048, metadata=flag(type=int, help="default 2048"))
    shapes: str = field(default="4x64,8x128", metadata=flag(help="heads x head size (K = V), comma-separated "
                                                                  "(default 4x64,8x128)"))
    chunk_sizes: Tuple[str, ...] = field(default=("64", "default"), metadata=flag(
        parse=tuple, nargs="+", help="chunk lengths, or 'default' for the op's own (default: 64 default)"))
    repeats: int = field(default=5, metadata=flag(type=int, help="rounds; the best is reported (default 5)"))
    backward: bool = field(default=False, metadata=flag(action="store_true", help="also forward + backward of the "
                                                                                  "chunk form, compiled vs PyTorch path"))
    json: str = field(default="docs/results/gdn2_speed.json", metadata=flag(help="default docs/results/gdn2_speed.json"))


def _call(fn, x, options, backward: bool) -> Callable[[], object]:
    def run():
        if not backward:
            with torch.no_grad():
                return fn(**x, output_final_state=True, **options)
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        o, h = fn(**leaves, output_final_state=True, **options)
        ((o * 0.5).sum() + (h * 0.5).sum()).backward()
        return o

    return run


def best_of(cases: Dict[str, Callable[[], object]], repeats: int) -> Dict[str, float]:
    """The minimum thread CPU time of every case over ``repeats`` interleaved rounds (one warm-up round)."""
    for fn in cases.values():
        fn()
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            start = time.thread_time()
            fn()
            times[name].append(time.thread_time() - start)
    return {name: min(spent) for name, spent in times.items()}


def main(args: Config) -> int:
    torch.set_num_threads(args.threads)
    a, b = torch.randn(SQUARE, SQUARE), torch.randn(SQUARE, SQUARE)
    cases: Dict[str, Callable[[], object]] = {"mm": lambda: torch.mm(a, b)}
    plan = []  # (heads, size, chunk label, C, flops)
    for heads, size in _shapes(args.shapes):
        x = family_inputs("gdn2", args.B, args.T, heads, size, size)
        tag = f"H{heads} K{size}"
        cases[f"{tag} recurrent fwd"] = _call(ops.recurrent_gdn2, x, {}, False)
        default = ops.default_chunk_size(size, torch.device("cpu"))
        for C in dict.fromkeys(default if label == "default" else int(label) for label in args.chunk_sizes):
            chunk = dict(chunk_size=C)
            name = f"{tag} C{C}{' (default)' if C == default else ''}"
            cases[f"{name} compiled fwd"] = _call(ops.chunk_gdn2, x, dict(chunk, backend="cpu"), False)
            cases[f"{name} pytorch fwd"] = _call(ops.chunk_gdn2, x, dict(chunk, backend="torch"), False)
            if args.backward:
                cases[f"{name} compiled fwd+bwd"] = _call(ops.chunk_gdn2, x, dict(chunk, backend="cpu"), True)
                cases[f"{name} pytorch fwd+bwd"] = _call(ops.chunk_gdn2, x, dict(chunk, backend="torch"), True)
            plan.append((tag, name, C, op_flops(args.B, heads, args.T, size, size, C)))
    best = best_of(cases, args.repeats)
    mm_rate = 2 * SQUARE**3 / best["mm"]
    shape = dict(B=args.B, T=args.T, dtype="float32", threads=torch.get_num_threads(), repeats=args.repeats,
                 clock="thread_time, best of the rounds")
    print(f"GDN-2 on the CPU, {shape}; torch.mm {SQUARE}² fp32: {mm_rate / 1e9:.1f} GFLOP/s")
    print(f"{'case':22} {'recurrent':>10} {'compiled':>10} {'pytorch':>10} {'rec/comp':>9} {'rec/pt':>7} "
          f"{'pt/comp':>8} {'mm frac':>8}")
    rows = []
    for tag, name, C, flops in plan:
        rec, comp, pt = best[f"{tag} recurrent fwd"], best[f"{name} compiled fwd"], best[f"{name} pytorch fwd"]
        row = dict(case=name, chunk_size=C, recurrent_forward_s=rec, compiled_forward_s=comp, pytorch_forward_s=pt,
                   compiled_speedup=rec / comp, pytorch_speedup=rec / pt, compiled_over_pytorch=pt / comp,
                   forward_gflops=flops / comp / 1e9, matmul_fraction=flops / comp / mm_rate)
        line = (f"{name:22} {rec * 1e3:8.1f}ms {comp * 1e3:8.1f}ms {pt * 1e3:8.1f}ms {rec / comp:9.2f} "
                f"{rec / pt:7.2f} {pt / comp:8.2f} {row['matmul_fraction']:8.2f}")
        if args.backward:
            cb, pb = best[f"{name} compiled fwd+bwd"], best[f"{name} pytorch fwd+bwd"]
            row.update(compiled_forward_backward_s=cb, pytorch_forward_backward_s=pb, backward_compiled_over_pytorch=pb / cb)
            line += f"   fwd+bwd compiled {cb * 1e3:.1f}ms, pytorch {pb * 1e3:.1f}ms ({pb / cb:.2f}x)"
        rows.append(row)
        print(line, flush=True)
    if args.json:
        atomic_write_text(args.json, json.dumps(dict(shape=shape, matmul_gflops=mm_rate / 1e9, speed=rows), indent=1))
        print(f"wrote {args.json}")
    return 0
