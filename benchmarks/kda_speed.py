"""Kimi Delta Attention: the chunk form against the recurrent form (speed), and every form's
error against the float64 recurrence (fp32 and bf16 inputs, forward and gradients).

Usage::

    python -m benchmarks.run kda_speed                       # T = 2048, B = 1, H = 4, K = V = 64, fp32, 1 thread
    python -m benchmarks.run kda_speed --T 4096 --threads 2  # other shapes
    python -m benchmarks.run kda_speed --device cuda         # the same PyTorch code on a GPU

Speed: wall time of forward, and of forward + backward of ``(o·do).sum()``, median of
``--repeats`` runs after one warm-up, for ``recurrent_kda`` and ``chunk_kda`` (C = 32, 64)
side by side in one process; the ratio to the recurrent form is what to read (the machines
here are shared). Errors: relative Frobenius error against ``recurrent_kda`` run in float64
on the same (rounded) inputs, for o, h_T and the worst of the input gradients. Writes
``docs/results/kda_speed.json``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.config import atomic_write_text, flag

from ._shapes import OpShape

FORMS = {
    "recurrent": (ops.recurrent_kda, {}),
    "parallel": (ops.parallel_kda, {}),
    "chunk C=32": (ops.chunk_kda, dict(chunk_size=32)),
    "chunk C=64": (ops.chunk_kda, dict(chunk_size=64)),
}


def inputs(B, T, H, K, V, device, seed=0, strong=False):
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
             v=torch.randn(B, T, H, V, generator=gen),
             g=(-6.9 * torch.rand(B, T, H, K, generator=gen)) if strong else F.logsigmoid(torch.randn(B, T, H, K, generator=gen) + 3),
             beta=torch.rand(B, T, H, generator=gen))
    return {n: t.to(device) for n, t in x.items()}


def run(fn, options, x, backward):
    leaves = {n: t.detach().clone().requires_grad_(backward) for n, t in x.items()}
    o, h = fn(**leaves, use_qk_l2norm_in_kernel=True, output_final_state=True, **options)
    grads = {}
    if backward:
        gen = torch.Generator().manual_seed(1)
        do = torch.randn(o.shape, generator=gen).to(o)
        dh = torch.randn(h.shape, generator=gen).to(h)
        ((o * do).sum() + (h * dh).sum()).backward()
        grads = {n: t.grad for n, t in leaves.items()}
    return o, h, grads


def timed(fn, options, x, backward, repeats, device):
    def once():
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run(fn, options, x, backward)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    once()  # warm-up (first-touch allocations)
    return statistics.median(once() for _ in range(repeats))


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm()).item()


def errors(device, T=256, strong=False):
    """Every form's error against the float64 recurrence on the same rounded inputs."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = {n: t.to(dtype) for n, t in inputs(2, T, 2, 32, 32, device, seed=3, strong=strong).items()}
        truth = run(ops.recurrent_kda, {}, {n: t.double() for n, t in x.items()}, True)
        for name, (fn, options) in FORMS.items():
            o, h, grads = run(fn, options, x, True)
            rows.append(dict(dtype=str(dtype).replace("torch.", ""), form=name, T=T, strong_decay=strong,
                             o=rel(o, truth[0]), h_T=rel(h, truth[1]),
                             grad_worst=max(rel(grads[n], truth[2][n]) for n in grads),
                             dgk=rel(grads["g"], truth[2]["g"])))
    return rows


@dataclass
class Config(OpShape):
    """The flags of ``python -m benchmarks.run kda_speed``: the shared op shape (``_shapes.OpShape``)
    and these."""

    device: str = field(default="cpu", metadata=flag(help="default cpu"))
    json: str = field(default="docs/results/kda_speed.json", metadata=flag(help="default docs/results/kda_speed.json"))


def main(args: Config) -> int:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    shape = dict(B=args.B, T=args.T, H=args.H, K=args.K, V=args.V, dtype="float32", device=str(device),
                 threads=torch.get_num_threads())
    x = inputs(args.B, args.T, args.H, args.K, args.V, device)
    speed = []
    for name in ("recurrent", "chunk C=32", "chunk C=64"):
        fn, options = FORMS[name]
        fwd = timed(fn, options, x, False, args.repeats, device)
        both = timed(fn, options, x, True, args.repeats, device)
        speed.append(dict(form=name, forward_s=fwd, forward_backward_s=both))
    base = speed[0]
    print(f"KDA speed, {shape}")
    print(f"{'form':12} {'fwd s':>8} {'x rec':>7} {'fwd+bwd s':>10} {'x rec':>7}")
    for r in speed:
        r["forward_speedup"] = base["forward_s"] / r["forward_s"]
        r["forward_backward_speedup"] = base["forward_backward_s"] / r["forward_backward_s"]
        print(f"{r['form']:12} {r['forward_s']:8.3f} {r['forward_speedup']:7.1f} {r['forward_backward_s']:10.3f} "
              f"{r['forward_backward_speedup']:7.1f}")
    errs = errors(device) + errors(device, strong=True)
    print("\nerrors vs the float64 recurrence (B=2, T=256, H=2, K=V=32; strong: α down to 1e-3)")
    print(f"{'dtype':9} {'decay':7} {'form':12} {'o':>9} {'h_T':>9} {'dgk':>9} {'worst grad':>11}")
    for r in errs:
        print(f"{r['dtype']:9} {'strong' if r['strong_decay'] else 'mild':7} {r['form']:12} {r['o']:9.2e} "
              f"{r['h_T']:9.2e} {r['dgk']:9.2e} {r['grad_worst']:11.2e}")
    if args.json:
        atomic_write_text(args.json, json.dumps(dict(shape=shape, speed=speed, errors=errs), indent=1))
        print(f"\nwrote {args.json}")
    return 0

