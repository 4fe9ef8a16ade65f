"""The CPU speed table: our chunk ops against the machine's fp32 matmul rate and against
other implementations, every row timed in one interleaved run.

``python -m benchmarks.run cpu_table [--threads 2] [--clock wall|cpu] [--json PATH]``
times, round by round (best of ``--repeats``):

- the limits: ``torch.mm`` at 512² and 1024² (fp32 and bf16);
- ``chunk_delta_rule`` forward (no grad) at B 1, T 2048, H 4, K = V = 64 and at H 8,
  K = V = 128: fp32; bf16 inputs; fp32 inputs under ``torch.autocast("cpu", bf16)``; bf16
  inputs under :func:`fastweights.ops.bf16_products`; and the gated rule the same way;
- ``chunk_kda`` forward (no grad) at B 1, T 2048, H 8, K = V = 128: fp32, bf16 inputs, bf16
  inputs under :func:`fastweights.ops.bf16_products`;
- ``chunk_linear_attn`` forward (no grad, a scalar decay) at the same shape: fp32 and bf16 inputs;
- ``chunk_gated_delta_rule`` at Qwen3-Next's head shape (H 32, K = V = 128, T 2048; fp32, and
  bf16 products against it) and, fp32, against
  transformers' ``torch_chunk_gated_delta_rule`` (when transformers is installed);
- ``chunk_delta_rule`` forward with grad against flash-linear-attention's
  ``delta_rule_chunkwise`` (its plain-PyTorch reference, C = 32; when fla is installed).

Each op row reports ms, GFLOP/s (the forward's FLOP count, docs/design.md section 9) and its
fraction of the best fp32 ``torch.mm`` rate of the run; comparison rows report the ratio.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
import torch.nn.functional as F

from fastweights.config import atomic_write_text, flag

from .roofline import CLOCKS, interleaved, linear_attn_flops, op_flops


def _inputs(B, T, H, K, V, gen):
    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, v = rand(B, T, H, K), rand(B, T, H, V)
    k = F.normalize(rand(B, T, H, K), dim=-1)
    beta, g = torch.sigmoid(rand(B, T, H)), F.logsigmoid(rand(B, T, H) + 3.0)
    return q, k, v, beta, g


def cases(T: int = 2048) -> Dict[str, tuple]:
    """``name -> (fn, flops or None)``."""
    from fastweights import ops

    gen = torch.Generator().manual_seed(0)
    out: Dict[str, tuple] = {}
    for n in (512, 1024):
        for dt, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
            out[f"limit: torch.mm {n}² {tag}"] = ((lambda a=a, b=b: torch.mm(a, b)), 2.0 * n ** 3)
    for H, D in ((4, 64), (8, 128)):
        q, k, v, beta, g = _inputs(1, T, H, D, D, gen)
        low = [t.bfloat16() for t in (q, k, v)]
        flops = op_flops(1, H, T, D, D, 64)
        for gated in (False, True):
            name = "chunk_gated_delta_rule" if gated else "chunk_delta_rule"

            def run(q, k, v, gated=gated, beta=beta, g=g):
                with torch.no_grad():
                    if gated:
                        return ops.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)
                    return ops.chunk_delta_rule(q, k, v, beta, chunk_size=64)

            def autocast(run=run, q=q, k=k, v=v):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return run(q, k, v)

            def products(run=run, low=low):
                with ops.bf16_products():
                    return run(*low)

            tag = f"{name} fwd H={H} K=V={D}"
            out[f"{tag} fp32"] = ((lambda run=run, q=q, k=k, v=v: run(q, k, v)), flops)
            out[f"{tag} bf16 inputs"] = ((lambda run=run, low=low: run(*low)), flops)
            out[f"{tag} autocast bf16"] = (autocast, flops)
            out[f"{tag} bf16 products"] = (products, flops)
    # KDA (per-channel decay) at H 8, K = V = 128: fp32, bf16 inputs, bf16 products
    q, k, v, beta, _ = _inputs(1, T, 8, 128, 128, gen)
    gk = F.logsigmoid(torch.randn(1, T, 8, 128, generator=gen) + 3.0)
    low = [t.bfloat16() for t in (q, k, v)]

    def kda(q, k, v, gk=gk, beta=beta):
        with torch.no_grad():
            return ops.chunk_kda(q, k, v, gk, beta, chunk_size=64)

    def kda_products(low=low):
        with ops.bf16_products():
            return kda(*low)

    flops = op_flops(1, 8, T, 128, 128, 64)
    out["chunk_kda fwd H=8 K=V=128 fp32"] = ((lambda q=q, k=k, v=v: kda(q, k, v)), flops)
    out["chunk_kda fwd H=8 K=V=128 bf16 inputs"] = ((lambda low=low: kda(*low)), flops)
    out["chunk_kda fwd H=8 K=V=128 bf16 products"] = (kda_products, flops)
    # linear attention with a scalar decay at the same shape: fp32, bf16 inputs
    g = F.logsigmoid(torch.randn(1, T, 8, generator=gen) + 3.0)

    def linear(q, k, v, g=g):
        with torch.no_grad():
            return ops.chunk_linear_attn(q, k, v, g=g, chunk_size=64)

    flops = linear_attn_flops(1, 8, T, 128, 128, 64)
    out["chunk_linear_attn fwd H=8 K=V=128 fp32"] = ((lambda q=q, k=k, v=v: linear(q, k, v)), flops)
    out["chunk_linear_attn fwd H=8 K=V=128 bf16 inputs"] = ((lambda low=low: linear(*low)), flops)
    # Qwen3-Next's heads: 32 value heads of 128 (the keys repeated to them, as the model does)
    q, k, v, beta, g = _inputs(1, T, 32, 128, 128, gen)
    flops = op_flops(1, 32, T, 128, 128, 64)

    def ours_h32(q=q, k=k, v=v, beta=beta, g=g):
        with torch.no_grad():
            ops.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)

    low_h32 = tuple(t.bfloat16() for t in (q, k, v))

    def ours_h32_products(low=low_h32):
        with ops.bf16_products():
            ours_h32(*low)

    out["chunk_gated_delta_rule fwd H=32 K=V=128 fp32"] = (ours_h32, flops)
    out["chunk_gated_delta_rule fwd H=32 K=V=128 bf16 products"] = (ours_h32_products, flops)
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as qwen
    except ImportError:
        qwen = None
    if qwen is not None:
        theirs = qwen.torch_chunk_gated_delta_rule
        theirs = getattr(theirs, "__wrapped__", theirs)

        def transformers_h32(q=q, k=k, v=v, beta=beta, g=g):
            with torch.no_grad():
                theirs(q, k, v, g=g, beta=beta, chunk_size=64, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False)

        out["transformers torch_chunk_gated_delta_rule H=32 K=V=128 fp32"] = (transformers_h32, flops)
    # with grad, against fla's plain-PyTorch chunkwise reference (head-first, C = 32)
    q, k, v, beta, _ = _inputs(1, T, 4, 64, 64, gen)
    do = torch.randn(1, T, 4, 64, generator=gen)
    both = op_flops(1, 4, T, 64, 64, 32, backward=True)

    def ours_grad():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v, beta)]
        o, _ = ops.chunk_delta_rule(*leaves, chunk_size=32)
        (o * do).sum().backward()

    out["chunk_delta_rule fwd+bwd H=4 K=V=64 C=32 fp32"] = (ours_grad, both)
    try:
        from fla.ops.delta_rule.naive import delta_rule_chunkwise
    except Exception:  # fla missing, or its import needs what this machine lacks
        delta_rule_chunkwise = None
    if delta_rule_chunkwise is not None:
        heads_first = [t.transpose(1, 2).contiguous() for t in (q, k, v, beta)]
        do_hf = do.transpose(1, 2).contiguous()

        def fla_grad():
            leaves = [t.detach().requires_grad_(True) for t in heads_first]
            o = delta_rule_chunkwise(*leaves, chunk_size=32)
            o = o[0] if isinstance(o, tuple) else o
            (o * do_hf).sum().backward()

        out["fla delta_rule_chunkwise fwd+bwd H=4 K=V=64 C=32 fp32"] = (fla_grad, both)
    return out


COMPARISONS = (
    ("chunk_gated_delta_rule fwd H=32 K=V=128 fp32", "transformers torch_chunk_gated_delta_rule H=32 K=V=128 fp32"),
    ("chunk_delta_rule fwd+bwd H=4 K=V=64 C=32 fp32", "fla delta_rule_chunkwise fwd+bwd H=4 K=V=64 C=32 fp32"),
)


def run(T: int = 2048, repeats: int = 5, threads: int = 2, clock: str = "wall") -> Dict:
    torch.set_num_threads(threads)
    everything = cases(T)
    times = interleaved({n: c[0] for n, c in everything.items()}, repeats, "cpu", clock)
    best = {n: min(ts) for n, ts in times.items()}
    rates = {n: everything[n][1] / best[n] / 1e9 for n in best}
    fp32_rate = max(r for n, r in rates.items() if n.startswith("limit") and "fp32" in n)
    rows = []
    for n in everything:
        row = {"name": n, "ms": 1e3 * best[n], "gflops": rates[n]}
        if not n.startswith("limit"):
            row["fraction_of_fp32_mm"] = rates[n] / fp32_rate
        rows.append(row)
    ratios = {f"{a} vs {b}": best[b] / best[a] for a, b in COMPARISONS if a in best and b in best}
    for D, H in ((64, 4), (128, 8)):
        for name in ("chunk_delta_rule", "chunk_gated_delta_rule"):
            base = best[f"{name} fwd H={H} K=V={D} fp32"]
            for mode in ("bf16 inputs", "autocast bf16", "bf16 products"):
                ratios[f"{name} fwd H={H} K=V={D}: {mode} speed-up over fp32"] = base / best[f"{name} fwd H={H} K=V={D} {mode}"]
    ratios["chunk_gated_delta_rule fwd H=32 K=V=128: bf16 products speed-up over fp32"] = (
        best["chunk_gated_delta_rule fwd H=32 K=V=128 fp32"] / best["chunk_gated_delta_rule fwd H=32 K=V=128 bf16 products"])
    base = best["chunk_kda fwd H=8 K=V=128 fp32"]
    for mode in ("bf16 inputs", "bf16 products"):
        ratios[f"chunk_kda fwd H=8 K=V=128: {mode} speed-up over fp32"] = base / best[f"chunk_kda fwd H=8 K=V=128 {mode}"]
    ratios["chunk_linear_attn fwd H=8 K=V=128: bf16 inputs speed-up over fp32"] = (
        best["chunk_linear_attn fwd H=8 K=V=128 fp32"] / best["chunk_linear_attn fwd H=8 K=V=128 bf16 inputs"])
    from fastweights.ops import cpu as cpu_kernels

    return {"T": T, "threads": threads, "clock": clock, "repeats": repeats, "cpu_path": cpu_kernels.status(),
            "cpu_kernels": cpu_kernels.kernel_report(), "fp32_mm_rate": fp32_rate, "rows": rows, "ratios": ratios, "load_average": os.getloadavg()}


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run cpu_table``."""

    T: int = field(default=2048, metadata=flag(type=int, help="default 2048"))
    repeats: int = field(default=5, metadata=flag(type=int, help="default 5"))
    threads: int = field(default=2, metadata=flag(type=int, help="default 2"))
    clock: str = field(default="wall", metadata=flag(choices=sorted(CLOCKS), help="default wall"))
    json: Optional[str] = field(default=None, metadata=flag(help="where to write the results (default: print only)"))


def main(a: Config) -> int:
    result = run(a.T, a.repeats, a.threads, a.clock)
    print(f"{result['threads']} threads, {result['clock']} clock, best of {result['repeats']}; {result['cpu_path']}")
    for kernel, path in result["cpu_kernels"].items():
        print(f"  {kernel}: {path}")
    for r in result["rows"]:
        frac = f"  {r['fraction_of_fp32_mm']:.2f} of fp32 mm" if "fraction_of_fp32_mm" in r else ""
        print(f"  {r['name']:66s} {r['ms']:9.2f} ms {r['gflops']:8.1f} GFLOP/s{frac}")
    for n, x in result["ratios"].items():
        print(f"  {n}: {x:.2f}x")
    if a.json:
        atomic_write_text(a.json, json.dumps(result, indent=1))
    return 0

