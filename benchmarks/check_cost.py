"""What the ops' input checks cost per call, eager and under torch.compile.

Times one op forward with every check on (the default: NaN/Inf in q, k, v, β, g; β in
[0, 1]; g <= 0) against the same call with ``finite_checks(False)`` and
``value_checks(False)``, side by side in one run (interleaved repeats, median), eager and
compiled with Inductor (each compiled variant traced under its own switch setting).

    python -m benchmarks.run check_cost --op chunk_gated_delta_rule --B 2 --T 1024 --H 4 --K 64 --threads 1
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field

import torch

import fastweights.ops as ops
from fastweights.config import flag


def make(op, B, T, H, K, dtype, device):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, generator=g).to(device, dtype) for _ in range(3))
    k = torch.nn.functional.normalize(k.float(), dim=-1).to(dtype)
    beta = torch.rand(B, T, H, generator=g).to(device, dtype)
    gate = (-torch.rand(B, T, H, generator=g) * 0.1).to(device, dtype)
    fn = getattr(ops, op)
    if "gated" in op:
        return lambda: fn(q, k, v, gate, beta)[0]
    if "delta" in op:
        return lambda: fn(q, k, v, beta)[0]
    return lambda: fn(q, k, v)[0]


def time_calls(fns, repeats, inner):
    """Median seconds per call of each fn, interleaved so drifting load hits all alike."""
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - t0) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run check_cost``."""

    op: str = field(default="chunk_gated_delta_rule", metadata=flag(help="default chunk_gated_delta_rule"))
    B: int = field(default=2, metadata=flag(type=int, help="default 2"))
    T: int = field(default=1024, metadata=flag(type=int, help="default 1024"))
    H: int = field(default=4, metadata=flag(type=int, help="default 4"))
    K: int = field(default=64, metadata=flag(type=int, help="default 64"))
    dtype: str = field(default="float32", metadata=flag(help="default float32"))
    device: str = field(default="cpu", metadata=flag(help="default cpu"))
    threads: int = field(default=1, metadata=flag(type=int, help="default 1"))
    repeats: int = field(default=15, metadata=flag(type=int, help="default 15"))
    inner: int = field(default=3, metadata=flag(type=int, help="default 3"))


def main(args: Config) -> int:
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    call = make(args.op, args.B, args.T, args.H, args.K, dtype, args.device)

    def off(fn):
        def run():
            with ops.finite_checks(False), ops.value_checks(False):
                return fn()
        return run

    compiled_on = torch.compile(call, fullgraph=True)
    compiled_off_inner = torch.compile(lambda: call(), fullgraph=True)
    compiled_off = off(compiled_off_inner)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def synced(fn):
        def run():
            fn()
            sync()
        return run

    fns = {"eager checks on": call, "eager checks off": off(call),
           "compiled checks on": compiled_on, "compiled checks off": compiled_off}
    for fn in fns.values():  # compile and warm up
        fn()
        fn()
    t = time_calls({n: synced(f) for n, f in fns.items()}, args.repeats, args.inner)
    result = {
        "op": args.op, "shape": f"B={args.B} T={args.T} H={args.H} K=V={args.K}", "dtype": args.dtype,
        "device": args.device, "threads": args.threads, "ms_per_call": {n: round(1e3 * s, 3) for n, s in t.items()},
        "eager_check_cost": f"{100 * (t['eager checks on'] / t['eager checks off'] - 1):+.1f}%",
        "compiled_check_cost": f"{100 * (t['compiled checks on'] / t['compiled checks off'] - 1):+.1f}%",
        "eager_check_ms": round(1e3 * (t["eager checks on"] - t["eager checks off"]), 3),
        "compiled_check_ms": round(1e3 * (t["compiled checks on"] - t["compiled checks off"]), 3),
    }
    print(json.dumps(result, indent=1))
    return 0

