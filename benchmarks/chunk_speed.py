"""Training speed of the delta rule's chunk path, against its baselines, in one run.

``fastweights bench`` and ``python -m benchmarks.run chunk_speed`` run :func:`main`. For each
sequence length T it times, side by side and interleaved (so a noisy shared
machine disturbs every contender alike):

- ``recurrent``: :func:`~fastweights.ops.recurrent_delta_rule`, autograd for the backward;
- ``textbook``: :func:`~fastweights.ops.delta_rule.textbook.textbook_chunk_delta_rule`,
  row-by-row forward substitution, a per-chunk loop of four matmuls, autograd;
- ``fast``: :func:`~fastweights.ops.chunk_delta_rule` (PyTorch backend), batched
  intra-chunk products, one matmul per chunk in the loop, hand-written backward.

Each is timed forward only (under ``no_grad``) and forward+backward (loss
``(o·do).sum()``). All three go through the same public front end (input checks
included), on ``[B, T, H, K]`` fp32 inputs with unit keys and β = sigmoid(·).

Reported per row: milliseconds (median and minimum over the repeats),
tokens/s, achieved GFLOP/s, that rate as a fraction of a ``torch.matmul`` rate
measured in the same run, and for forward+backward the peak memory.

FLOP count (the same for all three, so the rates compare the implementations,
not their arithmetic): the chunk algorithm's matmuls, as in
``benchmarks/gpu_chunk_delta.py`` -- per chunk of C tokens and head,
2C²(3K + 2V) for K Kᵀ, W, U, Q Kᵀ and P U', plus 6CKV for W h, Q h and K̄ᵀ U';
the backward is counted as 2× the forward.

Peak memory (CPU): each (implementation, T) runs once more in a fresh child
process; after the inputs are made, the kernel's resident-set high-water mark
is reset (``/proc/self/clear_refs``) and the growth of ``VmHWM`` over the
resident size before the call is reported. It includes allocator slack and
everything torch allocates. Also reported: the bytes autograd saves for the
backward (``saved_tensors_hooks``; distinct storages). On CUDA:
``torch.cuda.max_memory_allocated`` growth.

``--long`` streams 1,000,000 tokens through the fast forward in pieces that
carry the state (``initial_state`` -> ``final_state``), in a child process, and
reports time, tokens/s and the resident high-water mark growth.

The same run ends with the roofline (:mod:`.roofline`; ``--no-roofline`` skips it,
``--roofline-only`` runs nothing else): the machine's matmul rate at the kernels' tile
shapes (fp32, and bf16 where the CPU has it) and its copy bandwidth, measured
interleaved with the plain and gated chunk ops (fp32 forward, forward+backward, the
bf16-products forward) and a decode step, each as a fraction of its limit
(JSON key ``roofline``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from fastweights import tune_cpu_allocator
from fastweights.config import add_declared_arguments, atomic_write_text, flag

IMPLEMENTATIONS = ("recurrent", "textbook", "fast")
TARGETS = {  # what the fast chunk path must reach, at T = 2048 (memory at T = 8192)
    "fwd_vs_textbook": 3.0,
    "fwd_bwd_vs_textbook": 5.0,
    "fwd_bwd_vs_recurrent": 50.0,
    "memory_textbook_over_fast": 4.0,
}


def implementation(name: str) -> Callable:
    from fastweights import ops
    from fastweights.ops.delta_rule.api import textbook_chunk_delta_rule

    if name == "recurrent":  # the recurrence has no chunk length: the runner's C is dropped
        return lambda *a, chunk_size=None, **kw: ops.recurrent_delta_rule(*a, **kw)
    if name == "textbook":
        return textbook_chunk_delta_rule
    if name == "fast":
        return lambda *a, **kw: ops.chunk_delta_rule(*a, **kw)
    raise ValueError(f"unknown implementation {name!r}; expected one of {IMPLEMENTATIONS}")


def make_inputs(T: int, B: int, H: int, K: int, V: int, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    do = torch.randn(B, T, H, V, generator=gen)
    return [t.to(device) for t in (q, k, v, beta)], do.to(device)


def chunk_flops(T: int, B: int, H: int, K: int, V: int, C: int) -> float:
    """Forward FLOPs of the chunk algorithm (see the module docstring)."""
    chunks = -(-T // C)
    return B * H * chunks * (2 * C * C * (3 * K + 2 * V) + 6 * C * K * V)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_once(fn: Callable, inputs, do, backward: bool, chunk_size: int) -> None:
    if backward:
        leaves = [t.detach().requires_grad_(True) for t in inputs]
        o, _ = fn(*leaves, chunk_size=chunk_size)
        (o * do).sum().backward()
    else:
        with torch.no_grad():
            fn(*inputs, chunk_size=chunk_size)


def matmul_rates(device: str, batched_shape) -> Dict[str, float]:
    """GFLOP/s of torch.matmul: a 1024³ product, and the chunk form's batched 64×64 products."""
    out = {}
    for name, (a_shape, b_shape) in {
        "square_1024": ((1024, 1024), (1024, 1024)),
        "batched_chunk": (batched_shape, batched_shape),
    }.items():
        a, b = torch.randn(*a_shape, device=device), torch.randn(*b_shape, device=device)
        flops = 2 * a.numel() * b_shape[-1]
        times = []
        for _ in range(20):
            _sync(device)
            t0 = time.perf_counter()
            torch.matmul(a, b)
            _sync(device)
            times.append(time.perf_counter() - t0)
        out[name] = flops / min(times[2:]) / 1e9
    return out


def memory_child(name: str, T: int, B: int, H: int, K: int, V: int, C: int, threads: int, device: str) -> Dict:
    """Peak memory of one forward+backward, measured in a fresh process (see the module docstring)."""
    return _run_child(f"_memory_main({name!r}, {T}, {B}, {H}, {K}, {V}, {C}, {threads}, {device!r})", timeout=3600)


def _run_child(call: str, timeout: int) -> Dict:
    """Run ``benchmarks.chunk_speed.<call>`` in a fresh Python process; return the JSON it prints
    last, or ``{"error": ...}`` with the child's last stderr line."""
    cmd = [sys.executable, "-c", f"import benchmarks.chunk_speed as b; b.{call}"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"exit {res.returncode}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _memory_main(name, T, B, H, K, V, C, threads, device) -> None:
    torch.set_num_threads(threads)
    fn = implementation(name)
    small, small_do = make_inputs(min(T, 2 * C), B, H, K, V, device)
    run_once(fn, small, small_do, True, C)  # load kernels and lazy state before measuring
    inputs, do = make_inputs(T, B, H, K, V, device)
    result = {}
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run_once(fn, inputs, do, True, C)
        torch.cuda.synchronize()
        result["peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
        result["measure"] = "torch.cuda.max_memory_allocated growth"
    else:
        rss_before = _status_kib("VmRSS")
        reset = _reset_peak_rss()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run_once(fn, inputs, do, True, C)
        peak = _status_kib("VmHWM")
        if rss_before is None or peak is None:
            import resource

            result["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            result["measure"] = "ru_maxrss of the child (whole process)"
        else:
            result["peak_mib"] = (peak - rss_before) / 1024
            result["measure"] = "VmHWM growth over VmRSS before the call" + ("" if reset else " (HWM not reset: upper bound)")
    result["saved_for_backward_mib"] = sum(storages.values()) / 2**20
    print(json.dumps(result))


def long_child(tokens: int, piece: int, H: int, K: int, V: int, C: int, threads: int, device: str) -> Dict:
    return _run_child(f"_long_main({tokens}, {piece}, {H}, {K}, {V}, {C}, {threads}, {device!r})", timeout=7200)


def _long_main(tokens, piece, H, K, V, C, threads, device) -> None:
    from fastweights import ops

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)

    def piece_inputs(n):
        q = torch.randn(1, n, H, K, generator=gen)
        k = F.normalize(torch.randn(1, n, H, K, generator=gen), dim=-1)
        v = torch.randn(1, n, H, V, generator=gen)
        beta = torch.sigmoid(torch.randn(1, n, H, generator=gen))
        return [t.to(device) for t in (q, k, v, beta)]

    with torch.no_grad():
        ops.chunk_delta_rule(*piece_inputs(piece), chunk_size=C)  # warm-up
        rss_before = _status_kib("VmRSS")
        _reset_peak_rss()
        h, done, rss_trace = None, 0, []
        t0 = time.perf_counter()
        while done < tokens:
            n = min(piece, tokens - done)
            _, h = ops.chunk_delta_rule(
                *piece_inputs(n), initial_state=h, output_final_state=True, chunk_size=C
            )
            done += n
            rss_trace.append(_status_kib("VmRSS"))
        _sync(device)
        seconds = time.perf_counter() - t0
    peak = _status_kib("VmHWM")
    energy = float(h.double().square().sum((-1, -2)).mean()) / (K * V)
    out = {
        "tokens": tokens, "piece": piece, "H": H, "K": K, "V": V, "seconds": seconds,
        "tokens_per_s": tokens / seconds, "state_energy_per_entry": energy, "state_finite": bool(torch.isfinite(h).all()),
    }
    if rss_before is not None and peak is not None:
        out["peak_growth_mib"] = (peak - rss_before) / 1024
        out["rss_growth_first_to_last_piece_mib"] = (rss_trace[-1] - rss_trace[0]) / 1024
    print(json.dumps(out))


def time_all(Ts, B, H, K, V, C, device, repeats, recurrent_max_t) -> List[Dict]:
    rows = []
    for T in Ts:
        inputs, do = make_inputs(T, B, H, K, V, device)
        flops = chunk_flops(T, B, H, K, V, C)
        contenders = [n for n in IMPLEMENTATIONS]
        times = {(n, mode): [] for n in contenders for mode in ("fwd", "fwd+bwd")}
        skipped = set()
        for n in contenders:  # warm-up (and skip what would take too long)
            run_once(implementation(n), inputs, do, False, C)
            if n == "recurrent" and T > recurrent_max_t:
                skipped.add((n, "fwd+bwd"))
            else:
                run_once(implementation(n), inputs, do, True, C)
        for r in range(repeats):
            for n in contenders:
                for mode in ("fwd", "fwd+bwd"):
                    if (n, mode) in skipped:
                        continue
                    slow = n == "recurrent" and T >= 2048
                    if slow and r >= max(1, repeats // 4):
                        continue  # the recurrence is 100x slower: fewer repeats
                    _sync(device)
                    t0 = time.perf_counter()
                    run_once(implementation(n), inputs, do, mode == "fwd+bwd", C)
                    _sync(device)
                    times[(n, mode)].append(time.perf_counter() - t0)
        for (n, mode), ts in times.items():
            row = {"T": T, "impl": n, "mode": mode}
            if not ts:
                row["skipped"] = f"recurrent forward+backward only up to T={recurrent_max_t} (--recurrent-max-t)"
                rows.append(row)
                continue
            f = flops * (3 if mode == "fwd+bwd" else 1)
            row.update(
                repeats=len(ts), ms_median=1e3 * statistics.median(ts), ms_min=1e3 * min(ts),
                tokens_per_s=B * T / min(ts), gflops=f / min(ts) / 1e9, flop_count=f,
            )
            rows.append(row)
        print(f"  timed T={T}", file=sys.stderr)
    return rows


def ratios(rows: List[Dict], Ts) -> Dict:
    def get(T, n, mode, key="ms_min"):
        for r in rows:
            if r["T"] == T and r["impl"] == n and r["mode"] == mode and key in r:
                return r[key]
        return None

    out = {}
    for T in Ts:
        d = {}
        for key, (num, den, mode, column) in {
            "fwd_vs_textbook": ("textbook", "fast", "fwd", "ms_min"),
            "fwd_bwd_vs_textbook": ("textbook", "fast", "fwd+bwd", "ms_min"),
            "fwd_vs_recurrent": ("recurrent", "fast", "fwd", "ms_min"),
            "fwd_bwd_vs_recurrent": ("recurrent", "fast", "fwd+bwd", "ms_min"),
            "fwd_vs_textbook_median": ("textbook", "fast", "fwd", "ms_median"),
            "fwd_bwd_vs_textbook_median": ("textbook", "fast", "fwd+bwd", "ms_median"),
            "memory_textbook_over_fast": ("textbook", "fast", "fwd+bwd", "peak_mib"),
            "memory_recurrent_over_fast": ("recurrent", "fast", "fwd+bwd", "peak_mib"),
            "saved_textbook_over_fast": ("textbook", "fast", "fwd+bwd", "saved_for_backward_mib"),
        }.items():
            a, b = get(T, num, mode, column), get(T, den, mode, column)
            d[key] = None if a is None or b is None or b <= 0 else a / b
        out[T] = d
    return out


def print_table(rows, matmul, ratio, meta) -> None:
    print(f"\nDelta rule, B={meta['B']} H={meta['H']} K={meta['K']} V={meta['V']} C={meta['chunk_size']} "
          f"fp32 on {meta['device_name']}, {meta['threads']} threads, torch {meta['torch']}")
    print(f"torch.matmul: {matmul['square_1024']:.1f} GFLOP/s (1024³), {matmul['batched_chunk']:.1f} GFLOP/s "
          f"(batched 64×64 chunk products); fractions below are of the 1024³ rate")
    print("FLOPs: the chunk algorithm's matmuls, 2C²(3K+2V) + 6CKV per chunk and head; backward = 2× forward")
    if meta.get("cpu_path"):
        print(f"CPU kernels: {meta['cpu_path']}")
        for kernel, path in meta.get("cpu_kernels", {}).items():
            print(f"  {kernel}: {path}")
    print()
    head = f"{'T':>6} {'impl':>10} {'mode':>8} {'ms med':>9} {'ms min':>9} {'tok/s':>10} {'GFLOP/s':>8} {'of mm':>6} {'peak MiB':>9} {'saved MiB':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "skipped" in r:
            print(f"{r['T']:>6} {r['impl']:>10} {r['mode']:>8}   (skipped: {r['skipped']})")
            continue
        peak = f"{r['peak_mib']:.1f}" if "peak_mib" in r else ""
        saved = f"{r['saved_for_backward_mib']:.1f}" if "saved_for_backward_mib" in r else ""
        print(f"{r['T']:>6} {r['impl']:>10} {r['mode']:>8} {r['ms_median']:>9.2f} {r['ms_min']:>9.2f} "
              f"{r['tokens_per_s']:>10.0f} {r['gflops']:>8.2f} {r['gflops'] / matmul['square_1024']:>6.3f} {peak:>9} {saved:>9}")
    print("\nRatios (minimum times over interleaved repeats; 'median' uses medians):")
    for T, d in ratio.items():
        parts = [f"{k} {v:.1f}x" for k, v in d.items() if v is not None]
        print(f"  T={T}: " + ", ".join(parts))


def check_targets(ratio: Dict) -> List[Dict]:
    checks = []
    for key, want in TARGETS.items():
        T = 8192 if key.startswith("memory") else 2048
        got = ratio.get(T, {}).get(key)
        checks.append({"target": key, "T": T, "want_at_least": want, "got": got,
                       "met": None if got is None else got >= want})
    return checks


@dataclass
class Config:
    """The flags of ``fastweights bench`` (and ``python -m benchmarks.run chunk_speed``)."""

    T: Tuple[int, ...] = field(default=(512, 2048, 8192), metadata=flag(type=int, nargs="+", parse=tuple, help="sequence lengths"))
    batch: int = field(default=1, metadata=flag(type=int, help="B (default 1)"))
    heads: int = field(default=4, metadata=flag(type=int, help="H (default 4)"))
    head_dim: int = field(default=64, metadata=flag(type=int, help="K = V"))
    chunk_size: int = field(default=64, metadata=flag(type=int, help="C (default 64)"))
    threads: int = field(default=2, metadata=flag(type=int, help="torch.set_num_threads (reported)"))
    device: str = field(default="cpu", metadata=flag(help="cpu or cuda"))
    repeats: Optional[int] = field(default=None, metadata=flag(type=int, help="interleaved repeats per contender (default 8; --lm: 3)"))
    recurrent_max_t: int = field(default=2048, metadata=flag(type=int, help="longest T for the recurrence's forward+backward"))
    no_memory: bool = field(default=False, metadata=flag(action="store_true", help="skip the child-process memory measurements"))
    long_tokens: Optional[int] = field(default=None, metadata=flag(
        "--long", type=int, nargs="?", const=1_000_000,
        help="also stream this many tokens (default 1,000,000) through the fast forward in pieces"))
    piece: int = field(default=16384, metadata=flag(type=int, help="piece length for --long"))
    json: Optional[str] = field(default=None, metadata=flag(
        help="where to write the results (default docs/results/chunk_speed.json; --lm: docs/results/lm_speed.json)"))
    default_allocator: bool = field(default=False, metadata=flag(
        action="store_true", help="leave glibc's malloc thresholds alone (by default they are raised: fastweights/training/allocator.py)"))
    no_roofline: bool = field(default=False, metadata=flag(action="store_true", help="skip the roofline (benchmarks/roofline.py)"))
    roofline_only: bool = field(default=False, metadata=flag(action="store_true", help="run only the roofline"))
    roofline_heads: int = field(default=8, metadata=flag(type=int, help="H of the roofline's ops (B = 1)"))
    roofline_head_dim: int = field(default=128, metadata=flag(type=int, help="K = V of the roofline's ops"))
    roofline_T: int = field(default=2048, metadata=flag(type=int, help="T of the roofline's ops"))
    decode_batch: int = field(default=16, metadata=flag(
        type=int, help="sequences of the roofline's decode step (state B·H·K·V·4 bytes: 16 MiB by default)"))
    clock: str = field(default="wall", metadata=flag(
        choices=["cpu", "wall"],
        help="wall: elapsed time; cpu: the process's CPU time (use with --threads 1 on a busy machine)"))


def add_arguments(parser) -> None:
    """The flags of :class:`Config` on ``parser`` (what the benchmark runner builds from it)."""
    add_declared_arguments(parser, Config)


def main(args: Config) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("fastweights bench: --device cuda requested but CUDA is not available", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    tuned = False if args.default_allocator else tune_cpu_allocator()
    if args.repeats is None:
        args.repeats = 8
    if args.json is None:
        args.json = "docs/results/chunk_speed.json"
    B, H, K, C = args.batch, args.heads, args.head_dim, args.chunk_size
    V = K
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else _cpu_name()
    meta = dict(B=B, H=H, K=K, V=V, chunk_size=C, dtype="float32", device=args.device, device_name=device_name,
                threads=torch.get_num_threads(), torch=torch.__version__, python=platform.python_version(),
                repeats=args.repeats, baseline="textbook chunk form (row-by-row forward substitution, per-chunk "
                "loop of matmuls, autograd backward) and the recurrent form with autograd",
                flop_count="chunk algorithm matmuls: 2C^2(3K+2V) + 6CKV per chunk and head; backward = 2x forward",
                memory="CPU: VmHWM growth over VmRSS in a fresh child process (allocator slack included); "
                "CUDA: max_memory_allocated growth. saved_for_backward: bytes autograd keeps (distinct storages)",
                allocator="glibc mmap/trim thresholds raised in the timing process (fastweights/training/allocator.py), "
                "the same for every contender" if tuned else "the platform's default malloc settings",
                time_s=time.strftime("%Y-%m-%d %H:%M:%S"))
    if args.device == "cpu":  # which compiled path (ISA) each CPU kernel took, and why
        from fastweights.ops import cpu as cpu_kernels

        meta.update(cpu_path=cpu_kernels.status(), cpu_kernels=cpu_kernels.kernel_report())
    if args.roofline_only:
        result = dict(meta=meta, roofline=_roofline(args))
        return _write(args, result)
    batched = (B * H * (-(-2048 // C)), C, C)
    matmul = matmul_rates(args.device, batched)
    rows = time_all(args.T, B, H, K, V, C, args.device, args.repeats, args.recurrent_max_t)
    for r in rows:
        r["fraction_of_matmul"] = r["gflops"] / matmul["square_1024"] if "gflops" in r else None
    if not args.no_memory:
        for r in rows:
            if r["mode"] != "fwd+bwd" or "skipped" in r:
                continue
            r.update(memory_child(r["impl"], r["T"], B, H, K, V, C, args.threads, args.device))
            print(f"  memory {r['impl']} T={r['T']}: {r.get('peak_mib', r.get('error'))}", file=sys.stderr)
    ratio = ratios(rows, args.T)
    print_table(rows, matmul, ratio, meta)
    targets = check_targets(ratio)
    print("\nTargets:")
    for t in targets:
        got = "n/a" if t["got"] is None else f"{t['got']:.1f}x"
        print(f"  {t['target']} at T={t['T']}: want >= {t['want_at_least']:g}x, got {got}"
              f"{'' if t['met'] is None else (' (met)' if t['met'] else ' (MISSED)')}")
    result = dict(meta=meta, matmul_gflops=matmul, rows=rows, ratios=ratio, targets=targets)
    if args.long_tokens:
        long = long_child(args.long_tokens, args.piece, H, K, V, C, args.threads, args.device)
        result["long"] = long
        print(f"\nLong input: {json.dumps(long)}")
    if not args.no_roofline:
        result["roofline"] = _roofline(args)
    return _write(args, result)


def _roofline(args: Config) -> Dict:
    """The roofline section of the run (:func:`.roofline.run_roofline`), printed and returned."""
    from .roofline import print_roofline, run_roofline

    d = args.roofline_head_dim
    result = run_roofline(B=1, H=args.roofline_heads, T=args.roofline_T, K=d, V=d, C=args.chunk_size,
                          decode_batch=args.decode_batch, repeats=args.repeats, device=args.device,
                          clock=args.clock)
    print_roofline(result)
    return result


def _write(args: Config, result: Dict) -> int:
    if args.json:
        path = Path(args.json)
        atomic_write_text(path, json.dumps(result, indent=2, default=str))
        print(f"\nwrote {path}")
    return 0


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return platform.processor() or "cpu"
