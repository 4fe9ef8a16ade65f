"""The machine's limits and the chunk ops' share of them, measured side by side in one run.

``fastweights bench --roofline`` runs :func:`run_roofline`. In one process, interleaved
round by round (so a noisy shared machine disturbs every measurement alike; each
figure is the best of its rounds), it times:

- the limits: ``torch.matmul`` at the chunk kernels' tile shapes (a batch of
  ``[C, K] @ [K, V]`` products, the shape of the state products, and ``[C, K] @ [K, C]``,
  the shape of Q Kᵀ and K Kᵀ) and a 1024³ product, in fp32 and, where the CPU
  multiplies bf16 in hardware (AVX512-BF16 or AMX) or on CUDA, in bf16; and the
  memory copy bandwidth (``dst.copy_(src)``, read + write) at 64 MiB and at the decode
  step's state size;
- the ops: ``chunk_delta_rule``, ``chunk_gated_delta_rule``, ``chunk_kda`` (per-channel
  decay) and ``chunk_linear_attn`` (scalar decay) forward (no grad) and forward+backward in fp32
  (on the CPU with the compiled kernels, :mod:`fastweights.ops.cpu`,
  and the same calls on the PyTorch path beside them), the forward on bf16 inputs under
  :func:`fastweights.ops.bf16_products`, and decode steps: the gated op at T = 1
  (``recurrent_gated_delta_rule``, the state passed in and a new one returned) and the
  public steps ``gated_delta_rule_step`` / ``delta_rule_step`` with ``inplace=True``
  (a decoding loop's call; on the CPU the compiled step, and the PyTorch step beside it).

Each op row reports GFLOP/s (GB/s for a decode step: it reads and writes the state
once) and its fraction of the matching limit: fp32 rows of the fp32 tile rate, the
bf16 row of the bf16 tile rate (and of the fp32 one), the decode step of the copy
bandwidth at the state's size.

FLOP counts per head and chunk of C tokens (docs/design.md, "Roofline"):
forward ``2·(3·C²·K + 2·C²·V + 3·C·K·V) + C³/3``;
backward ``2·(5·C²·K + 4·C²·V + 6·C·K·V)``. KDA counts the same products (its decay factors,
exponentials and sub-block sums are not counted). Linear attention: forward
``2·(C²·K + C²·V + 2·C·K·V)``, backward ``2·(3·C²·K + 2·C²·V + 4·C·K·V)``.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from fastweights.ops import cpu as cpu_kernels


def chunk_forward_flops(C: int, K: int, V: int) -> float:
    """Forward FLOPs per head and chunk: K Kᵀ, Q Kᵀ, W = T K (3·C²·K), U = T V, P U' (2·C²·V),
    W h, Q h, K̄ᵀ U' (3·C·K·V), each product 2 FLOPs per multiply-add, and the C×C unit-triangular
    inverse (C³/3)."""
    return 2 * (3 * C * C * K + 2 * C * C * V + 3 * C * K * V) + C**3 / 3


def chunk_backward_flops(C: int, K: int, V: int) -> float:
    """Backward FLOPs per head and chunk (the backward recomputes Q Kᵀ and K Kᵀ and reuses the
    forward's inverse blocks): C²·K products Q Kᵀ, K Kᵀ, dQ += dP K, dK += dPᵀ Q, dK += dS K (5);
    C²·V products Pᵀ dO, (I + A)⁻ᵀ dU', dP = dO U'ᵀ, dA = dZ U'ᵀ (4); C·K·V products Q_bᵀ dO,
    K̄ dh, Wᵀ dU', dO hᵀ, dZ hᵀ, U' dhᵀ (6)."""
    return 2 * (5 * C * C * K + 4 * C * C * V + 6 * C * K * V)


def op_flops(B: int, H: int, T: int, K: int, V: int, C: int, backward: bool = False) -> float:
    """FLOPs of a chunk delta op over ``B`` sequences of ``T`` tokens and ``H`` heads."""
    per_chunk = chunk_forward_flops(C, K, V) + (chunk_backward_flops(C, K, V) if backward else 0.0)
    return B * H * -(-T // C) * per_chunk


def linear_attn_flops(B: int, H: int, T: int, K: int, V: int, C: int, backward: bool = False) -> float:
    """FLOPs of ``chunk_linear_attn``: per head and chunk Q Kᵀ, P V, Q h, K̄ᵀ V forward; Q Kᵀ
    (recomputed), dP K, dPᵀ Q (C²·K), Pᵀ dO, dO Vᵀ (C²·V) and dO hᵀ, V dhᵀ, K̄ dh, Q̂ᵀ dO (C·K·V) backward."""
    per_chunk = 2 * (C * C * K + C * C * V + 2 * C * K * V)
    if backward:
        per_chunk += 2 * (3 * C * C * K + 2 * C * C * V + 4 * C * K * V)
    return B * H * -(-T // C) * per_chunk


def has_bf16_matmul(device: str) -> bool:
    """Whether bf16 products run in hardware: CUDA, or a CPU with AVX512-BF16 or AMX-BF16."""
    if device.startswith("cuda"):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved(cases: Dict[str, Callable[[], object]], repeats: int, device: str = "cpu",
                clock: str = "wall") -> Dict[str, List[float]]:
    """Seconds per call of every case, one call of each per round (after one warm-up round).

    ``clock="cpu"`` times by the process's CPU time (``time.process_time``, all threads):
    with one thread on an oversubscribed machine that is the work a call did, whatever
    the scheduler did to it (wall time, the default, is what a user waits)."""
    timer = CLOCKS[clock]
    times: Dict[str, List[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = timer()
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(timer() - t0)
    return times


def limit_cases(device: str, C: int, K: int, V: int, state_bytes: int, batch: int = 128) -> Dict[str, tuple]:
    """``name -> (fn, work, unit)`` for the machine's limits (see the module docstring)."""
    cases = {}
    dtypes = [torch.float32] + ([torch.bfloat16] if has_bf16_matmul(device) else [])
    for dt in dtypes:
        tag = "fp32" if dt == torch.float32 else "bf16"
        for name, (a_shape, b_shape) in {
            "tile_state": ((batch, C, K), (batch, K, V)),
            "tile_scores": ((batch, C, K), (batch, K, C)),
            "square_1024": ((1024, 1024), (1024, 1024)),
        }.items():
            a = torch.randn(*a_shape, device=device, dtype=dt)
            b = torch.randn(*b_shape, device=device, dtype=dt)
            flops = 2 * a.numel() * b_shape[-1]
            cases[f"matmul_{tag}_{name}"] = ((lambda a=a, b=b: torch.matmul(a, b)), flops, "GFLOP/s")
    for label, nbytes in (("state", state_bytes), ("64MiB", 64 << 20)):
        src = torch.randn(nbytes // 4, device=device)
        dst = torch.empty_like(src)
        cases[f"copy_{label}"] = ((lambda s=src, d=dst: d.copy_(s)), 2 * nbytes, "GB/s")
    return cases


def pytorch_path(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with the compiled CPU kernels off (:mod:`fastweights.ops.cpu`): the PyTorch path."""

    def run():
        cpu_kernels.set_enabled(False)
        try:
            return fn()
        finally:
            cpu_kernels.set_enabled(None)

    return run


def op_cases(device: str, B: int, H: int, T: int, K: int, V: int, C: int, decode_batch: int) -> Dict[str, tuple]:
    """``name -> (fn, work, unit)`` for the ops (see the module docstring)."""
    from fastweights import ops

    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q, v, do = rand(B, T, H, K), rand(B, T, H, V), rand(B, T, H, V)
    k = F.normalize(rand(B, T, H, K), dim=-1)
    beta, g = torch.sigmoid(rand(B, T, H)), F.logsigmoid(rand(B, T, H) + 3.0)
    fwd, both = op_flops(B, H, T, K, V, C), op_flops(B, H, T, K, V, C, backward=True)
    cases = {}
    for gated in (False, True):
        name = "chunk_gated_delta_rule" if gated else "chunk_delta_rule"

        def run(q, k, v, beta, gated=gated):
            if gated:
                return ops.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=C)
            return ops.chunk_delta_rule(q, k, v, beta, chunk_size=C)

        def forward(run=run):
            with torch.no_grad():
                run(q, k, v, beta)

        def forward_backward(run=run):
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v, beta)]
            o, _ = run(*leaves)
            (o * do).sum().backward()

        low = [t.bfloat16() for t in (q, k, v)]

        def forward_bf16(run=run, low=low):
            with torch.no_grad(), ops.bf16_products():
                run(*low, beta)

        cases[f"{name} fwd fp32"] = (forward, fwd, "GFLOP/s")
        cases[f"{name} fwd+bwd fp32"] = (forward_backward, both, "GFLOP/s")
        if device == "cpu" and cpu_kernels.available():  # the same calls on the PyTorch path, side by side
            cases[f"{name} fwd fp32, PyTorch path"] = (pytorch_path(forward), fwd, "GFLOP/s")
            cases[f"{name} fwd+bwd fp32, PyTorch path"] = (pytorch_path(forward_backward), both, "GFLOP/s")
        if has_bf16_matmul(device):
            cases[f"{name} fwd bf16 products"] = (forward_bf16, fwd, "GFLOP/s")
    gk = F.logsigmoid(rand(B, T, H, K) + 3.0)
    flops = {"chunk_kda": (fwd, both),
             "chunk_linear_attn": (linear_attn_flops(B, H, T, K, V, C), linear_attn_flops(B, H, T, K, V, C, backward=True))}
    for name, (f_fwd, f_both) in flops.items():

        def run(q, k, v, beta, name=name):
            if name == "chunk_kda":
                return ops.chunk_kda(q, k, v, gk, beta, chunk_size=C)
            return ops.chunk_linear_attn(q, k, v, g=g, chunk_size=C)

        def forward(run=run):
            with torch.no_grad():
                run(q, k, v, beta)

        def forward_backward(run=run):
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v, beta)]
            o, _ = run(*leaves)
            (o * do).sum().backward()

        cases[f"{name} fwd fp32"] = (forward, f_fwd, "GFLOP/s")
        cases[f"{name} fwd+bwd fp32"] = (forward_backward, f_both, "GFLOP/s")
        if device == "cpu" and cpu_kernels.available():
            cases[f"{name} fwd fp32, PyTorch path"] = (pytorch_path(forward), f_fwd, "GFLOP/s")
            cases[f"{name} fwd+bwd fp32, PyTorch path"] = (pytorch_path(forward_backward), f_both, "GFLOP/s")
    sq, sk, sv = rand(decode_batch, 1, H, K), F.normalize(rand(decode_batch, 1, H, K), dim=-1), rand(decode_batch, 1, H, V)
    sb, sg = torch.sigmoid(rand(decode_batch, 1, H)), F.logsigmoid(rand(decode_batch, 1, H) + 3.0)
    state = rand(decode_batch, H, K, V)

    def decode():
        with torch.no_grad():
            ops.recurrent_gated_delta_rule(sq, sk, sv, sg, sb, initial_state=state, output_final_state=True)

    live = state.clone()  # the public steps update it in place, as a decoding loop does
    step_args = [t[:, 0] for t in (sq, sk, sv, sb)]

    def step(gated: bool):
        with torch.no_grad():
            if gated:
                ops.gated_delta_rule_step(*step_args, sg[:, 0], live, inplace=True)
            else:
                ops.delta_rule_step(*step_args, live, inplace=True)

    moved = 2 * state.numel() * 4  # the state read and written once
    cases["decode: recurrent_gated_delta_rule T=1"] = (decode, moved, "GB/s")
    for gated, name in ((True, "decode: gated_delta_rule_step inplace"), (False, "decode: delta_rule_step inplace")):
        cases[name] = ((lambda gated=gated: step(gated)), moved, "GB/s")
        if device == "cpu" and cpu_kernels.available():  # the compiled step, and the PyTorch step beside it
            cases[f"{name}, PyTorch path"] = (pytorch_path(lambda gated=gated: step(gated)), moved, "GB/s")
    return cases


def limit_for(name: str, rates: Dict[str, float]) -> Dict[str, Optional[float]]:
    """The limits an op row is measured against: ``{limit name: its rate}``."""
    if name.startswith("decode"):
        return {"copy_state": rates.get("copy_state")}
    if "bf16" in name:
        return {"matmul_bf16_tile_state": rates.get("matmul_bf16_tile_state"),
                "matmul_fp32_tile_state": rates.get("matmul_fp32_tile_state")}
    return {"matmul_fp32_tile_state": rates.get("matmul_fp32_tile_state"),
            "matmul_fp32_square_1024": rates.get("matmul_fp32_square_1024")}


def run_roofline(B: int = 1, H: int = 8, T: int = 2048, K: int = 128, V: int = 128, C: int = 64,
                 decode_batch: int = 16, repeats: int = 5, device: str = "cpu", clock: str = "wall") -> Dict:
    """Measure the limits and the ops in one interleaved run; returns the JSON-ready result."""
    state_bytes = decode_batch * H * K * V * 4
    limits = limit_cases(device, C, K, V, state_bytes)
    ops_ = op_cases(device, B, H, T, K, V, C, decode_batch)
    everything = {**limits, **ops_}
    times = interleaved({n: c[0] for n, c in everything.items()}, repeats, device, clock)
    rates = {n: everything[n][1] / min(ts) / 1e9 for n, ts in times.items()}
    result = {
        "shape": dict(B=B, H=H, T=T, K=K, V=V, chunk_size=C, decode_batch=decode_batch, state_mib=state_bytes / 2**20),
        "threads": torch.get_num_threads(), "repeats": repeats, "device": device, "clock": clock,
        "bf16_matmul_in_hardware": has_bf16_matmul(device),
        "cpu_path": cpu_kernels.status() if device == "cpu" else None,
        "flop_count": {"forward_per_head_chunk": "2*(3*C^2*K + 2*C^2*V + 3*C*K*V) + C^3/3",
                       "backward_per_head_chunk": "2*(5*C^2*K + 4*C^2*V + 6*C*K*V)"},
        "limits": {n: {"rate": rates[n], "unit": limits[n][2], "ms_min": 1e3 * min(times[n])} for n in limits},
        "rows": [],
    }
    for n in ops_:
        row = {"op": n, "unit": ops_[n][2], "rate": rates[n], "ms_min": 1e3 * min(times[n]),
               "ms_median": 1e3 * statistics.median(times[n]), "work": ops_[n][1]}
        row["fraction_of"] = {lim: (None if r is None else rates[n] / r) for lim, r in limit_for(n, rates).items()}
        result["rows"].append(row)
    fp32 = {r["op"]: r for r in result["rows"]}
    for name in ("chunk_delta_rule", "chunk_gated_delta_rule"):
        low = fp32.get(f"{name} fwd bf16 products")
        if low is not None:
            result.setdefault("bf16_speedup_over_fp32", {})[name] = fp32[f"{name} fwd fp32"]["ms_min"] / low["ms_min"]
    return result


def print_roofline(result: Dict) -> None:
    s = result["shape"]
    print(f"\nRoofline: B={s['B']} H={s['H']} T={s['T']} K={s['K']} V={s['V']} C={s['chunk_size']}, "
          f"{result['threads']} threads, {result['clock']} clock, best of {result['repeats']} interleaved rounds")
    print("Limits (measured in this run):")
    for n, lim in result["limits"].items():
        print(f"  {n:28s} {lim['rate']:9.1f} {lim['unit']}")
    head = f"  {'op':38s} {'ms min':>9} {'rate':>9} {'unit':>8}  fraction of limit"
    print(head)
    for r in result["rows"]:
        frac = ", ".join(f"{v:.2f} of {k}" for k, v in r["fraction_of"].items() if v is not None)
        print(f"  {r['op']:38s} {r['ms_min']:9.2f} {r['rate']:9.1f} {r['unit']:>8}  {frac}")
    if result.get("cpu_path"):
        print(f"  CPU chunk path: {result['cpu_path']}")
    for name, x in result.get("bf16_speedup_over_fp32", {}).items():
        print(f"  {name}: bf16-products forward {x:.2f}x the fp32 forward")
