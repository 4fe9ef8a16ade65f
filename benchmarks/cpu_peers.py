"""Peers on the CPU, side by side: what a CPU user would otherwise run for the gated delta rule.

``python -m benchmarks.run cpu_peers [--threads 1 2] [--T 2048] [--repeats 5] [--clock wall|cpu] [--json PATH]
[--load-library PATH ...]``

For each thread count and head shape — Qwen3-Next's (16 key / 32 value heads × 128: the keys
repeated to the 32 value heads, as the model does before the op) and H 8 × 128 — it times,
interleaved round by round (best of ``--repeats``), fp32, no grad:

- prefill, T tokens from a zero state: ours (``chunk_gated_delta_rule``), transformers'
  ``torch_chunk_gated_delta_rule`` (the Qwen3-Next torch fallback), fla's
  ``naive_chunk_gated_delta_rule`` (its plain-PyTorch reference), Attention Gym's
  ``attn_gym.linear.chunk_gdn(..., impl="reference")`` (eager PyTorch);
- decode, one token from a state: ours (``gated_delta_rule_step``), transformers'
  ``torch_recurrent_gated_delta_rule``, fla's ``naive_recurrent_gated_delta_rule``, Attention
  Gym's ``recurrent_gdn(..., impl="reference")`` (its state is ``[N, H, V, K]``: handed the
  transposed copy, made before timing).

and, with bf16 q, k, v (β rounded to bf16, g and the state fp32):

- prefill bf16: ours under :func:`fastweights.ops.bf16_products` (bf16 products, fp32 state) and
  the serving engines' CPU kernel, SGLang's ``torch.ops.sgl_kernel.chunk_gated_delta_rule_cpu``
  (bf16 products on AMX through oneDNN's brgemm, fp32 state; vLLM's CPU backend carries a copy),
  where a CPU build of SGLang's ``sgl-kernel`` is installed, or its library is named with
  ``--load-library`` (a kernel built from source). Both the older form of that op and the newer
  one (a pool of states, ``initial_state_indices``) are called, told apart by the op's schema.

A peer that is not installed (or lacks the function) is a row with ``skipped`` and the reason,
never a failure; no peer's code is shipped. Ratios are the peer's time over ours (> 1: ours is
faster). Each timed row also records ``max_abs_diff_vs_ours``, the largest difference of its
output from ours on the same inputs (so a row times the same computation), and
``max_rel_diff_vs_ours``, that over our output's largest entry (the bf16 rows' measure). The path each of our
compiled kernels took is recorded (``cpu_kernels``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple, Union

import torch

from fastweights.config import atomic_write_text, flag

from .cpu_table import _inputs
from .roofline import CLOCKS, interleaved, op_flops

SHAPES = {"Qwen3-Next heads (16 key / 32 value x 128)": 32, "H 8 x 128": 8}
D = 128

Case = Union[Callable[[], object], str]  # a call to time, or the reason it is skipped

#: The serving engines' CPU op, ``torch.ops.<namespace>.<name>`` (SGLang's sgl-kernel CPU build).
SGLANG_OP = ("sgl_kernel", "chunk_gated_delta_rule_cpu")


def _transformers():
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as qwen
    except Exception as exc:  # not installed, or too old for Qwen3-Next
        return f"transformers' Qwen3-Next module is not importable ({type(exc).__name__}: {exc})"
    return qwen


def _fla():
    try:
        from fla.ops.gated_delta_rule import naive
    except Exception as exc:
        return f"flash-linear-attention is not importable ({type(exc).__name__}: {exc})"
    return naive


def _attn_gym():
    try:
        import attn_gym  # noqa: F401
    except Exception as exc:
        return f"attn-gym is not installed ({type(exc).__name__}); pip install attn-gym to add its row"
    try:
        from attn_gym import linear
        linear.chunk_gdn, linear.recurrent_gdn  # noqa: B018 (the two functions this benchmark calls)
    except Exception as exc:
        return f"attn-gym is installed but has no chunk_gdn / recurrent_gdn ({type(exc).__name__}: {exc})"
    return linear


def _sglang():
    """SGLang's CPU chunk op as ``call(q, k, v, g, beta) -> (o, h_T [N, H, K, V])`` on ``[1, T, H, ·]``
    bf16 q, k, v (β bf16, g fp32), from a zero state; or the reason it is missing.

    The op's schema tells its two forms apart: the newer takes ``initial_state_indices`` (one pool
    slot per sequence). Both keep the state as ``[N, H, K, V]``: the newer one's comments name it
    ``[N, H, V, K]`` but it needs K = V and reads and writes the state as ours (its final state
    matched ours untransposed from a random initial state, and not transposed). Either updates the
    state it is given in place, so each call gets a fresh zero state. Its scale is fixed at K^−½,
    our default."""
    namespace, name = SGLANG_OP
    if namespace == "sgl_kernel":
        try:
            import sgl_kernel  # noqa: F401  (a CPU build registers torch.ops.sgl_kernel.*)
        except Exception:  # not installed, or a GPU build that does not load here: the lookup below says
            pass
    try:
        op = getattr(getattr(torch.ops, namespace), name)
        arguments = [a.name for a in op.default._schema.arguments]
    except (AttributeError, RuntimeError) as exc:
        return (f"SGLang's CPU kernels are not installed (torch.ops.{namespace}.{name}: {type(exc).__name__}); "
                f"a CPU build of sgl-kernel, or --load-library with its library, adds this row")
    pooled = "initial_state_indices" in arguments

    def call(q, k, v, g, beta):
        H, K, V = v.shape[2], q.shape[-1], v.shape[-1]
        state = torch.zeros(1, H, K, V, dtype=torch.float32)
        cu_seqlens = torch.tensor([0, q.shape[1]], dtype=torch.int32)
        extra = {"initial_state_indices": torch.zeros(1, dtype=torch.int32)} if pooled else {}
        return op(query=q, key=k, value=v, g=g, beta=beta, initial_state=state, output_final_state=True,
                  cu_seqlens=cu_seqlens, head_first=False, use_qk_l2norm_in_kernel=False, **extra)

    return call


def _output(result) -> torch.Tensor:
    """A call's output tensor: the first of a tuple, or the tensor itself."""
    return result[0] if isinstance(result, (tuple, list)) else result


def _add(out: Dict[str, Case], name: str, peer, call: Callable[[object], object]) -> None:
    """``out[name]``: the reason where ``peer`` is one (a str), else a no-grad call of ``call(peer)``."""
    if isinstance(peer, str):
        out[name] = peer
        return

    def case():
        with torch.no_grad():
            return call(peer)

    out[name] = case


def _unwrapped(fn):
    """transformers' function itself, past its decorators (``__wrapped__``)."""
    return getattr(fn, "__wrapped__", fn)


def prefill_cases(T: int, H: int, gen: torch.Generator) -> Dict[str, Case]:
    from fastweights import ops

    q, k, v, beta, g = _inputs(1, T, H, D, D, gen)
    out: Dict[str, Case] = {}
    _add(out, "fastweights chunk_gated_delta_rule", ops, lambda m: m.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64))
    _add(out, "transformers torch_chunk_gated_delta_rule", _transformers(),
         lambda m: _unwrapped(m.torch_chunk_gated_delta_rule)(q, k, v, g=g, beta=beta, chunk_size=64, initial_state=None,
                                                              output_final_state=False, use_qk_l2norm_in_kernel=False))
    _add(out, "fla naive_chunk_gated_delta_rule", _fla(), lambda m: m.naive_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64))
    _add(out, "attn-gym reference", _attn_gym(), lambda m: m.chunk_gdn(q, k, v, g, beta, impl="reference"))
    return out


def prefill_bf16_cases(T: int, H: int, gen: torch.Generator) -> Dict[str, Case]:
    """Ours with bf16 products against the serving engines' CPU kernel, on the same bf16 values."""
    from fastweights import ops

    q, k, v, beta, g = _inputs(1, T, H, D, D, gen)
    q, k, v, beta16 = q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.bfloat16()
    beta = beta16.float()  # the values the engines' kernel reads

    def ours(m):
        with m.bf16_products():
            return m.chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, output_final_state=True)

    out: Dict[str, Case] = {}
    _add(out, "fastweights chunk_gated_delta_rule (bf16 products)", ops, ours)
    _add(out, "sglang chunk_gated_delta_rule_cpu", _sglang(), lambda call: call(q, k, v, g, beta16))
    return out


def decode_cases(H: int, gen: torch.Generator) -> Dict[str, Case]:
    from fastweights import ops

    q, k, v, beta, g = _inputs(1, 1, H, D, D, gen)
    state = torch.randn(1, H, D, D, generator=gen) * 0.1
    state_vk = state.transpose(-1, -2).contiguous()  # attn-gym's [N, H, V, K]
    out: Dict[str, Case] = {}
    _add(out, "fastweights gated_delta_rule_step", ops,
         lambda m: m.gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], g[:, 0], state))
    _add(out, "transformers torch_recurrent_gated_delta_rule", _transformers(),
         lambda m: _unwrapped(m.torch_recurrent_gated_delta_rule)(q, k, v, g=g, beta=beta, initial_state=state,
                                                                  output_final_state=True, use_qk_l2norm_in_kernel=False))
    _add(out, "fla naive_recurrent_gated_delta_rule", _fla(),
         lambda m: m.naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=state, output_final_state=True))
    _add(out, "attn-gym reference", _attn_gym(),
         lambda m: m.recurrent_gdn(q, k, v, g, beta, initial_state=state_vk, output_final_state=True, impl="reference"))
    return out


#: Each phase: its cases and the dtype of its inputs.
PHASES = {"prefill": (prefill_cases, "float32"), "decode": (lambda T, H, gen: decode_cases(H, gen), "float32"),
          "prefill bf16": (prefill_bf16_cases, "bfloat16")}


def run(T: int = 2048, threads=(1, 2), repeats: int = 5, clock: str = "wall") -> Dict:
    """Every (threads, shape, phase) group timed interleaved; rows with ms, or skipped with the reason."""
    from fastweights.ops import cpu as cpu_kernels

    previous = torch.get_num_threads()
    rows, gen = [], torch.Generator().manual_seed(0)
    try:
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for shape, H in SHAPES.items():
                for phase, (make, dtype) in PHASES.items():
                    cases = make(T, H, gen)
                    timed = {n: c for n, c in cases.items() if callable(c)}
                    outputs = {n: _output(c()).detach().float().reshape(-1) for n, c in timed.items()}
                    best = {n: min(ts) for n, ts in interleaved(timed, repeats, "cpu", clock).items()}
                    ours = next(n for n in cases if n.startswith("fastweights"))
                    for name, case in cases.items():
                        row = {"threads": n_threads, "shape": shape, "phase": phase, "dtype": dtype, "impl": name}
                        if isinstance(case, str):
                            row["skipped"] = case
                        else:
                            row["ms"] = 1e3 * best[name]
                            row["peer_time_over_ours"] = best[name] / best[ours]
                            mine, theirs = outputs[ours], outputs[name]
                            if theirs.shape == mine.shape:
                                row["max_abs_diff_vs_ours"] = float((theirs - mine).abs().max())
                                row["max_rel_diff_vs_ours"] = row["max_abs_diff_vs_ours"] / max(float(mine.abs().max()), 1e-30)
                            else:
                                row["max_abs_diff_vs_ours"] = f"output has {theirs.numel()} entries, ours {mine.numel()}"
                            if phase.startswith("prefill"):
                                row["gflops"] = op_flops(1, H, T, D, D, 64) / best[name] / 1e9
                        rows.append(row)
    finally:
        torch.set_num_threads(previous)
    return {"T": T, "repeats": repeats, "clock": clock, "cpu_path": cpu_kernels.status(),
            "cpu_kernels": cpu_kernels.kernel_report(), "rows": rows, "load_average": os.getloadavg()}


@dataclass
class Config:
    """The flags of ``python -m benchmarks.run cpu_peers``."""

    T: int = field(default=2048, metadata=flag(type=int, help="default 2048"))
    threads: Tuple[int, ...] = field(default=(1, 2), metadata=flag(type=int, parse=tuple, nargs="+", help="thread counts (default 1 2)"))
    repeats: int = field(default=5, metadata=flag(type=int, help="default 5"))
    clock: str = field(default="wall", metadata=flag(choices=sorted(CLOCKS), help="default wall"))
    json: Optional[str] = field(default=None, metadata=flag(help="where to write the results (default: print only)"))
    load_library: Tuple[str, ...] = field(default=(), metadata=flag(
        parse=tuple, nargs="+", help="shared libraries to load with torch.ops.load_library before the peers are looked "
                                     "up (a peer's kernels built from source, e.g. SGLang's CPU ops)"))


def main(a: Config) -> int:
    for name, value in (("T", a.T), ("repeats", a.repeats), *(("threads", t) for t in a.threads)):
        if value < 1:
            raise ValueError(f"cpu_peers: `--{name}` must be >= 1, got {value}")
    for path in a.load_library:
        if not os.path.isfile(path):
            raise ValueError(f"cpu_peers: `--load-library` {path!r} is not a file")
        torch.ops.load_library(path)
    result = run(a.T, tuple(a.threads), a.repeats, a.clock)
    print(f"T {result['T']}, no grad, {result['clock']} clock, best of {result['repeats']}; {result['cpu_path']}")
    for r in result["rows"]:
        head = f"  {r['threads']} thr  {r['shape']:42s} {r['phase']:12s} {r['impl']:51s}"
        if "skipped" in r:
            print(f"{head} skipped: {r['skipped']}")
        else:
            diff = r["max_abs_diff_vs_ours"]
            diff = f"{diff:.1e} ({r['max_rel_diff_vs_ours']:.1e} of our largest)" if isinstance(diff, float) else diff
            print(f"{head} {r['ms']:9.3f} ms  peer/ours {r['peer_time_over_ours']:5.2f}x  max |diff| {diff}")
    if a.json:
        atomic_write_text(a.json, json.dumps(result, indent=1))
    return 0

