"""Bytes one rank sends per layer under context parallelism, against all-gathering K and V.

Runs on ``--world`` local gloo processes (CPU). For each shape, every rank calls
``chunk_gated_delta_rule`` and ``chunk_linear_attn`` (normalize, with decay) on its
slice of ``[1, world·L, H, K]`` inputs with ``cp_group``, forward and backward, inside
:func:`fastweights.ops.context_parallel.count_communication`, and all-gathers its keys
and values with :func:`~fastweights.ops.context_parallel.gather_sequence` (forward and
backward), the approach softmax layers use. Reported per rank and layer (fp32):

- ``summaries_B``: the forward all-gather payload of the op (the state summary);
- ``summary_grads_B``: the backward payload;
- ``fingerprint_B``: the argument check's all-gather;
- ``kv_B`` / ``kv_grads_B``: all-gathering K and V instead (forward, and the backward's
  reduce-scatter input, which is R times the slice);
- ``formula_B``: :func:`~fastweights.ops.context_parallel.summary_bytes`, checked equal.

The summaries do not depend on L; the K/V gather grows with it. Usage::

    python -m benchmarks.run cp_communication [--world 2 --json docs/results/cp_communication.json]
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.multiprocessing as mp

from fastweights.config import atomic_write_text, flag

SHAPES = [  # (H, K, V, L)
    (4, 64, 64, 1024),
    (4, 64, 64, 4096),
    (8, 128, 128, 2048),
    (16, 64, 64, 2048),
]


def measure(rank, world, shapes):
    import torch.distributed as dist
    import torch.nn.functional as F

    from fastweights.ops import chunk_gated_delta_rule, chunk_linear_attn
    from fastweights.ops.context_parallel import count_communication, gather_sequence, summary_bytes

    group = dist.group.WORLD
    rows = []
    for heads, kd, vd, length in shapes:
        gen = torch.Generator().manual_seed(rank)
        q, k = (torch.randn(1, length, heads, kd, generator=gen, requires_grad=True) for _ in range(2))
        v = torch.randn(1, length, heads, vd, generator=gen, requires_grad=True)
        g = F.logsigmoid(torch.randn(1, length, heads, generator=gen)).requires_grad_()
        beta = torch.rand(1, length, heads, generator=gen).requires_grad_()
        for rule in ("gated_delta_rule", "linear_attn"):
            with count_communication() as log:
                if rule == "gated_delta_rule":
                    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, qk_norm="l2", chunk_size=64, cp_group=group)
                    formula = summary_bytes(rule, 1, heads, kd, vd)
                else:
                    o, _ = chunk_linear_attn(q, k, v, g=g, normalize=True, feature_map="elu", chunk_size=64, cp_group=group)
                    formula = summary_bytes(rule, 1, heads, kd, vd + 1, gated=True)
                o.sum().backward()
            with count_communication() as kv_log:
                gather_sequence(torch.cat([k, v], dim=-1), group).sum().backward()
            rows.append(dict(
                rule=rule, world=world, B=1, L=length, H=heads, K=kd, V=vd, dtype="float32",
                summaries_B=log.bytes_of("summaries"), summary_grads_B=log.bytes_of("summary_grads"),
                fingerprint_B=log.bytes_of("fingerprint"), formula_B=formula,
                kv_B=kv_log.bytes_of("kv"), kv_grads_B=kv_log.bytes_of("kv_grads"),
            ))
    return rows


def _rank(rank: int, world: int, store: str, out: str) -> None:
    """One process of the run: join the gloo group, measure, rank 0 writes the rows."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        rows = measure(rank, world, SHAPES)
        if rank == 0:
            atomic_write_text(out, json.dumps(rows))
    finally:
        dist.destroy_process_group()


@dataclass
class Config:
    world: int = field(default=2, metadata=flag(type=int, help="local gloo processes (default 2)"))
    json: Optional[str] = field(default=None, metadata=flag(help="also write the rows here"))


def main(args: Config) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, args=(args.world, os.path.join(tmp, "store"), out), nprocs=args.world)
        rows = json.loads(Path(out).read_text())
    header = f"{'rule':<17} {'R':>2} {'L':>5} {'H':>3} {'K':>4} {'V':>4} {'summary B':>10} {'grads B':>9} {'K,V gather B':>13} {'ratio':>7}"
    print(header)
    for r in rows:
        assert r["summaries_B"] == r["formula_B"], r
        print(f"{r['rule']:<17} {r['world']:>2} {r['L']:>5} {r['H']:>3} {r['K']:>4} {r['V']:>4} {r['summaries_B']:>10} "
              f"{r['summary_grads_B']:>9} {r['kv_B']:>13} {r['kv_B'] / r['summaries_B']:>7.1f}")
    if args.json:
        atomic_write_text(args.json, json.dumps({"torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    return 0
