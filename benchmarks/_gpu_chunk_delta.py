"""The body of :mod:`benchmarks.gpu_chunk_delta`, imported by its ``main`` once the environment is set
(Triton reads ``TRITON_INTERPRET`` when its kernels are defined, and ``FASTWEIGHTS_TRITON_AUTOTUNE``
picks the kernels' configs)."""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.config import atomic_write_text
from fastweights.ops.triton import HAS_TRITON

if not HAS_TRITON:
    sys.exit("gpu_chunk_delta.py needs triton: pip install 'fastweights[triton]'")
import triton

try:  # fla, when its wheels are carried (BENCHMARKS.md)
    import fla
    from fla.ops.delta_rule import chunk_delta_rule as fla_chunk_delta_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    FLA_VERSION = getattr(fla, "__version__", "unknown")
except Exception as exc:  # any import failure means "not carried"
    fla_chunk_delta_rule = fla_chunk_gated_delta_rule = None
    FLA_VERSION = f"absent ({type(exc).__name__})"

CHUNK = 64


# ------------------------------------------------------------------------ timing


def bench_ms(fn, device) -> float:
    """Median milliseconds of ``fn()``: do_bench on CUDA, a plain timer elsewhere (dry run)."""
    if device.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def ceilings(device, dry: bool):
    """Copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s) of this device."""
    n_bytes = (1 << 20) if dry else (1 << 30)
    x = torch.empty(n_bytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), device)
    copy = 2 * n_bytes / ms / 1e6
    n = 256 if dry else 8192
    mm_dtype = torch.float32 if dry else torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=mm_dtype)
    b = torch.randn(n, n, device=device, dtype=mm_dtype)
    ms = bench_ms(lambda: a @ b, device)
    return dict(copy_gbps=copy, matmul_tflops=2 * n**3 / ms / 1e9, matmul_dtype=str(mm_dtype), matmul_n=n)


# ------------------------------------------------------------------------ workloads


def make_inputs(B, T, H, K, V, dtype, device, gated, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    x = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V),
             beta=torch.sigmoid(rand(B, T, H)))
    if gated:
        x["g"] = F.logsigmoid(rand(B, T, H) + 3.0)
    return {n: t.to(dtype).requires_grad_(True) for n, t in x.items()}


def chunk_call(path, gated):
    """A callable ``f(x) -> o`` for one implementation, or None when it is not available."""
    if path in ("fastweights-triton", "fastweights-torch"):
        backend = path.split("-")[1]
        if gated:
            return lambda x: ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], backend=backend)[0]
        return lambda x: ops.chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], backend=backend)[0]
    if path == "fla":
        if fla_chunk_delta_rule is None:
            return None
        if gated:
            return lambda x: fla_chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])[0]
        return lambda x: fla_chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"])[0]
    if path == "sdpa":
        def sdpa(x):  # [B, T, H, D] -> [B, H, T, D] and back: attention over the same q, k, v
            q, k, v = (t.transpose(1, 2) for t in (x["q"], x["k"], x["v"]))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return sdpa
    raise ValueError(path)


def chunk_flops(B, T, H, K, V):
    n_chunks = B * H * triton.cdiv(T, CHUNK)
    return n_chunks * (2 * CHUNK**2 * (3 * K + 2 * V) + 6 * CHUNK * K * V)


def chunk_bytes(B, T, H, K, V, itemsize, backward):
    per_token = (2 * K + 2 * V) * itemsize + 2 * itemsize  # q, k, v, o (+ beta, g)
    if backward:
        per_token += (2 * K + 2 * V + 2 * K + V) * itemsize  # re-read q, k, v, do; write dq, dk, dv
    return B * T * H * per_token


def sdpa_flops(B, T, H, K, V):
    return 2 * B * H * T * T * (K + V) // 2  # causal: half of Q Kᵀ and P V


def time_chunk(path, gated, B, T, H, D, dtype, device, cap):
    fn = chunk_call(path, gated)
    rule = "gated_delta" if gated else "delta"
    base = dict(path=path, rule=rule, B=B, T=T, H=H, K=D, V=D, dtype=str(dtype).replace("torch.", ""))
    if fn is None:
        return [dict(base, mode=m, ms=None, note="not available") for m in ("fwd", "fwd+bwd")]
    if path == "sdpa" and gated:
        return []
    x = make_inputs(B, T, H, D, D, dtype, device, gated)
    flops = (sdpa_flops if path == "sdpa" else chunk_flops)(B, T, H, D, D)
    bwd_factor = 2.5 if path == "sdpa" else 2.0
    rows = []
    for mode in ("fwd", "fwd+bwd"):
        row = dict(base, mode=mode)
        try:
            if mode == "fwd":
                with torch.no_grad():
                    ms = bench_ms(lambda: fn(x), device)
            else:
                o = fn(x)
                do = torch.randn_like(o)
                leaves = list(x.values())
                del o

                def step():  # SDPA has no beta/g: allow_unused
                    torch.autograd.grad(fn(x), leaves, do, allow_unused=True)

                ms = bench_ms(step, device)
        except Exception as exc:  # e.g. fla's gated backward on Hopper (a known fla bug)
            rows.append(dict(row, ms=None, note=f"failed: {type(exc).__name__}: {str(exc)[:120]}"))
            continue
        f = flops * (1 if mode == "fwd" else 1 + bwd_factor)
        n_bytes = chunk_bytes(B, T, H, D, D, x["q"].element_size(), mode != "fwd")
        tflops, gbps = f / ms / 1e9, n_bytes / ms / 1e6
        rows.append(dict(row, ms=ms, tflops=tflops, gbps=gbps,
                         pct_matmul=100 * tflops / cap["matmul_tflops"], pct_copy=100 * gbps / cap["copy_gbps"]))
    return rows


def time_decode(B, H, D, dtype, device):
    gen = torch.Generator(device="cpu").manual_seed(1)
    q, k = (torch.randn(B, H, D, generator=gen).to(device, dtype) for _ in range(2))
    k = F.normalize(k.float(), dim=-1).to(dtype)
    v = torch.randn(B, H, D, generator=gen).to(device, dtype)
    beta = torch.rand(B, H, generator=gen).to(device, dtype)
    g = (-torch.rand(B, H, generator=gen) * 0.1).to(device, dtype)
    state = torch.randn(B, H, D, D, generator=gen).to(device) * 0.01
    n_bytes = 2 * state.numel() * 4
    rows = []
    for rule, gate in (("delta", None), ("gated_delta", g)):
        step = ops.delta_rule_step if gate is None else functools.partial(ops.gated_delta_rule_step, g=gate)
        for path, fn in (("fastweights-triton", lambda s, gt: step(q, k, v, beta, state=s, backend="triton", inplace=True)),
                         ("fastweights-torch", lambda s, gt: step(q, k, v, beta, state=s, backend="torch", inplace=True))):
            s = state.clone()
            ms = bench_ms(lambda: fn(s, gate), device)
            rows.append(dict(path=path, rule=rule, mode="decode step", B=B, T=1, H=H, K=D, V=D,
                             dtype=str(dtype).replace("torch.", ""), ms=ms, us=ms * 1e3, gbps=n_bytes / ms / 1e6))
    return rows


# ------------------------------------------------------------------------ correctness on the device


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def check(device, dtypes, shape):
    """Triton vs the float64 recurrence; the low-precision rule of docs/design.md."""
    B, T, H, D = shape
    rows = []
    for gated in (False, True):
        ref_op = ops.recurrent_gated_delta_rule if gated else ops.recurrent_delta_rule
        chunk_op = ops.chunk_gated_delta_rule if gated else ops.chunk_delta_rule
        x64 = make_inputs(B, T, H, D, D, torch.float64, device, gated, seed=2)
        gen = torch.Generator(device="cpu").manual_seed(3)
        h0 = (torch.randn(B, H, D, D, generator=gen, dtype=torch.float64) * 0.1).to(device)
        do = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64).to(device)
        dh = torch.randn(B, H, D, D, generator=gen, dtype=torch.float64).to(device)

        def run(op, dtype, **kw):
            x = {n: t.detach().to(dtype).requires_grad_(True) for n, t in x64.items()}
            h = h0.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_(True)
            args = (x["q"], x["k"], x["v"]) + ((x["g"],) if gated else ()) + (x["beta"],)
            o, hT = op(*args, initial_state=h, output_final_state=True, **kw)
            grads = torch.autograd.grad((o.double() * do).sum() + (hT.double() * dh).sum(), list(x.values()) + [h])
            return [o, hT, *grads]

        names = ["o", "h_T"] + ["d" + n for n in x64] + ["dh0"]
        gold = run(ref_op, torch.float64)
        for dtype in dtypes:
            fast = run(chunk_op, dtype, backend="triton")
            plain = run(ref_op, dtype) if dtype != torch.float32 else None
            for i, name in enumerate(names):
                err = rel_err(fast[i], gold[i])
                if plain is None:
                    limit = 1e-4 if device.type == "cuda" else 1e-5
                    ok, ref_err = err <= limit, None
                else:
                    ref_err = rel_err(plain[i], gold[i])
                    limit = (2.0 if i < 2 else 3.0) * ref_err
                    ok = err <= limit
                rows.append(dict(rule="gated_delta" if gated else "delta", dtype=str(dtype).replace("torch.", ""),
                                 tensor=name, err=err, recurrent_err=ref_err, limit=limit, ok=ok))
    return rows


# ------------------------------------------------------------------------ report


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def table(rows, cap):
    lines = ["| rule | path | mode | B | T | ms | TFLOP/s | % matmul | GB/s | % copy | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['rule']} | {r['path']} | {r['mode']} | {r['B']} | {r['T']} | {fmt(r.get('ms'), '.3f')} | "
            f"{fmt(r.get('tflops'), '.1f')} | {fmt(r.get('pct_matmul'), '.1f')} | {fmt(r.get('gbps'), '.0f')} | "
            f"{fmt(r.get('pct_copy'), '.1f')} | {r.get('note', '')} |"
        )
    return "\n".join(lines)


def check_table(rows):
    lines = ["| rule | dtype | tensor | triton err | recurrent err | limit | ok |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rule']} | {r['dtype']} | {r['tensor']} | {r['err']:.2e} | "
                     f"{fmt(r['recurrent_err'], '.2e')} | {r['limit']:.2e} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)


def run(args) -> int:
    """The run of :mod:`benchmarks.gpu_chunk_delta` (its ``main`` sets the environment first)."""
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        sys.exit("gpu_chunk_delta.py: no CUDA device; use --dry-run to exercise the script on the CPU")
    device = torch.device("cpu" if dry else "cuda")
    started = time.time()
    meta = dict(
        date=_dt.datetime.now().isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or 'cpu'}), dry run",
        torch=torch.__version__, triton=triton.__version__, fla=FLA_VERSION,
        cuda=torch.version.cuda, python=platform.python_version(), dry_run=dry,
        interpreter=os.environ.get("TRITON_INTERPRET", "0"), autotune=bool(args.autotune),
    )
    cap = ceilings(device, dry)
    meta.update(cap)
    print(f"{meta['date']}  {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  fla {meta['fla']}")
    print(f"ceilings: copy {cap['copy_gbps']:.0f} GB/s, matmul {cap['matmul_tflops']:.0f} TFLOP/s ({cap['matmul_dtype']})")

    checks = []
    if not args.no_check:
        if dry:
            checks = check(device, [torch.float32, torch.float16], (1, 70, 1, 32))
        else:
            checks = check(device, [torch.bfloat16, torch.float16, torch.float32], (2, 256, 4, 128))
        print("\ncorrectness against the float64 recurrence (docs/design.md: 2x / 3x the recurrent form's error)")
        print(check_table(checks))

    dtype = torch.float32 if dry else torch.bfloat16
    if dry:
        shapes = [(2, 64, 2, 32)]
    else:
        shapes = [(args.tokens // t, t, args.heads, args.head_dim) for t in map(int, args.seqlens.split(","))]
    paths = ["fastweights-triton", "fla", "sdpa"] + ([] if args.no_torch else ["fastweights-torch"])
    rows = []
    for gated in [r == "gated" for r in args.rules.split(",")]:
        for B, T, H, D in shapes:
            for path in paths:
                if time.time() - started > args.budget_s:
                    rows.append(dict(path=path, rule="gated_delta" if gated else "delta", mode="fwd, fwd+bwd", B=B,
                                     T=T, H=H, K=D, V=D, ms=None, note=f"skipped: past --budget-s {args.budget_s:g}"))
                    continue
                rows += time_chunk(path, gated, B, T, H, D, dtype, device, cap)
                torch.cuda.empty_cache() if device.type == "cuda" else None
    decode_shape = (2, 2, 32) if dry else (64, args.heads, args.head_dim)
    rows += time_decode(*decode_shape, dtype, device)
    print("\n" + table(rows, cap))
    meta["seconds"] = round(time.time() - started, 1)
    print(f"\nwall time {meta['seconds']} s")

    result = dict(meta=meta, checks=checks, rows=rows)
    if args.json:
        atomic_write_text(args.json, json.dumps(result, indent=1, default=str))
    if args.append_md:
        section = [
            f"\n## {meta['date']} — {meta['device']}\n",
            f"torch {meta['torch']}, triton {meta['triton']}, CUDA {meta['cuda']}, fla {meta['fla']}; "
            f"ceilings: copy {cap['copy_gbps']:.0f} GB/s, {cap['matmul_dtype']} matmul "
            f"{cap['matmul_tflops']:.0f} TFLOP/s; wall time {meta['seconds']} s.\n",
            table(rows, cap) + "\n",
        ]
        if checks:
            section += ["\nCorrectness (Triton vs float64 recurrence):\n", check_table(checks) + "\n"]
        with open(args.append_md, "a") as f:
            f.write("\n".join(section))
    failed = [c for c in checks if not c["ok"]]
    if failed:
        print(f"\n{len(failed)} correctness check(s) failed")
        return 1
    return 0

