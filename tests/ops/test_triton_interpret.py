"""The Triton kernels, run on the CPU by Triton's interpreter, equal the recurrence.

``TRITON_INTERPRET=1`` is set when this module is imported, before anything
imports the kernel modules (``@triton.jit`` picks GPU or interpreter when a
kernel is defined; fastweights imports the kernels only on first use). Skipped
when triton is not installed (``pip install 'fastweights[triton]'``).

- fp32: outputs, final states and all gradients (dq, dk, dv, dβ, dg, dh0) within
  1e-5 relative of the float64 recurrence;
- fp16: the rule of docs/design.md, error at most 2× (3× for gradients) the error of the
  plain recurrent form run in fp16; bf16 is left to the GPU (the interpreter's
  bf16 ``tl.dot`` is wrong);
- awkward shapes: T = 70 and 130 (not multiples of 64), K = V = 32, K ≠ V (48/80),
  B > 1, varlen with uneven lengths (30, 100, 70), an initial state, no state;
- the decode step, the backend switch and its errors.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton's kernels are defined (see the docstring)

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from fastweights import ops
from fastweights.ops.triton import select_backend
from fastweights.ops.triton import _chunk_kernels
from helpers import RULES, assert_close, call, make_inputs, rel_err

if type(_chunk_kernels._wy_fwd_kernel).__name__ != "InterpretedFunction":  # pragma: no cover
    pytest.skip("the kernels were compiled for the GPU before this module set TRITON_INTERPRET=1",
                allow_module_level=True)

FP32_TOL = 1e-5
RULE_NAMES = ["delta", "gated_delta"]

# id: (B, T, H, K, V, cu_seqlens, initial_state)
CASES = {
    "B2-T70-K32-V32-h0": (2, 70, 2, 32, 32, None, True),
    "B2-T130-K48-V80-h0": (2, 130, 1, 48, 80, None, True),
    "B1-T64-K16-V16-noh0": (1, 64, 1, 16, 16, None, False),
    "varlen-30,100,70-h0": (1, 200, 2, 32, 32, [0, 30, 130, 200], True),
}
SLOW_CASES = {
    "B1-T130-K128-V128-h0": (1, 130, 2, 128, 128, None, True),
    "B1-T70-K256-V200-h0": (1, 70, 1, 256, 200, None, True),
    "varlen-1,64,65,3-K60-V100": (1, 133, 2, 60, 100, [0, 1, 65, 130, 133], True),
}


def _inputs(rule, case, dtype):
    B, T, H, K, V, cu, with_h0 = case
    x = make_inputs(rule, B, T, H, K, V, dtype=torch.float64, initial_state=with_h0, seed=3)
    if cu is not None and with_h0:
        x["initial_state"] = make_inputs(rule, len(cu) - 1, 1, H, K, V, initial_state=True, seed=4)["initial_state"]
    cu = None if cu is None else torch.tensor(cu)
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = {n: t.to(state_dtype if n == "initial_state" else dtype).requires_grad_(True) for n, t in x.items()}
    return x, cu


def _run(form, rule, case, dtype, with_final_state=True, **kwargs):
    """Outputs, final state and the gradients of ``(o·do).sum() + (h_T·dh).sum()``; names alongside."""
    x, cu = _inputs(rule, case, dtype)
    o, h = call(form, rule, x, cu_seqlens=cu, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(h.shape, generator=gen, dtype=torch.float64)
    loss = (o.double() * do).sum()
    if with_final_state:
        loss = loss + (h.double() * dh).sum()
    grads = torch.autograd.grad(loss, list(x.values()))
    names = ["output", "final state"] + ["d" + ("h0" if n == "initial_state" else n) for n in x]
    return dict(zip(names, [o, h, *grads]))


def _triton(rule):
    return lambda **kw: rule.forms[2](**kw, backend="triton")


def _check_fp32(rule_name, case):
    rule = RULES[rule_name]
    want = _run(rule.reference, rule, case, torch.float64)
    got = _run(_triton(rule), rule, case, torch.float32)
    assert got["output"].dtype == torch.float32 and got["final state"].dtype == torch.float32
    for name in want:
        assert_close(name, got[name], want[name], FP32_TOL)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("rule_name", RULE_NAMES)
def test_fp32_equals_float64_recurrence(rule_name, case):
    _check_fp32(rule_name, CASES[case])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(SLOW_CASES), ids=list(SLOW_CASES))
@pytest.mark.parametrize("rule_name", RULE_NAMES)
def test_fp32_equals_float64_recurrence_large_heads(rule_name, case):
    _check_fp32(rule_name, SLOW_CASES[case])


@pytest.mark.parametrize("case", ["B2-T130-K48-V80-h0", "varlen-30,100,70-h0"])
@pytest.mark.parametrize("rule_name", RULE_NAMES)
def test_fp16_within_twice_the_plain_recurrence_error(rule_name, case):
    rule = RULES[rule_name]
    gold = _run(rule.reference, rule, CASES[case], torch.float64)
    plain = _run(rule.reference, rule, CASES[case], torch.float16)
    fast = _run(_triton(rule), rule, CASES[case], torch.float16)
    assert fast["output"].dtype == torch.float16
    for name in gold:
        err_fast, err_plain = rel_err(fast[name], gold[name]), rel_err(plain[name], gold[name])
        factor = 2.0 if name in ("output", "final state") else 3.0
        print(f"{name}: triton fp16 {err_fast:.2e}, recurrent fp16 {err_plain:.2e} (allowed {factor:g}x)")
        assert err_fast <= factor * err_plain, f"{name}: {err_fast:.3e} > {factor:g} x {err_plain:.3e}"


@pytest.mark.parametrize("rule_name", RULE_NAMES)
def test_no_final_state_cotangent_and_qk_l2_norm(rule_name):
    """Only o gets a cotangent (h_T's is None), and q/k pass through the l2 norm in front of the kernels."""
    rule = RULES[rule_name]
    case = (2, 70, 1, 24, 40, None, True)
    want = _run(rule.reference, rule, case, torch.float64, with_final_state=False, qk_norm="l2")
    got = _run(_triton(rule), rule, case, torch.float32, with_final_state=False, qk_norm="l2")
    for name in want:
        assert_close(name, got[name], want[name], FP32_TOL)


def test_auto_backend_keeps_cpu_tensors_on_pytorch():
    rule = RULES["gated_delta"]
    x = make_inputs(rule, 1, 20, 1, 8, 8, dtype=torch.float32)
    assert select_backend("op", "auto", x["q"], x["v"]) == "torch"
    o_auto, _ = call(ops.chunk_gated_delta_rule, rule, x)
    o_cpu, _ = call(ops.chunk_gated_delta_rule, rule, x, backend="cpu")  # auto's CPU path: the compiled kernels
    assert torch.equal(o_auto, o_cpu)


@pytest.mark.parametrize(
    "kwargs,shape,dtype,error,match",
    [
        (dict(backend="cuda"), (8, 8), torch.float32, ValueError, "backend"),
        (dict(backend="triton"), (260, 8), torch.float32, ValueError, "head sizes up to 256"),
        (dict(backend="triton"), (8, 300), torch.float32, ValueError, r"value \(v\) size 300"),
        (dict(backend="triton"), (8, 8), torch.float64, TypeError, "float64"),
        (dict(backend="triton", chunk_size=32), (8, 8), torch.float32, ValueError, "chunk_size"),
    ],
    ids=["unknown-backend", "K>256", "V>256", "fp64", "chunk32"],
)
def test_bad_backend_input_is_refused(kwargs, shape, dtype, error, match):
    rule = RULES["delta"]
    x = make_inputs(rule, 1, 5, 1, shape[0], shape[1], dtype=dtype)
    with pytest.raises(error, match=match):
        call(ops.chunk_delta_rule, rule, x, **kwargs)


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = make_inputs(RULES["delta"], 1, 5, 1, 8, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        call(ops.chunk_delta_rule, RULES["delta"], x, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("rule_name", RULE_NAMES)
def test_decode_step_equals_one_recurrent_step(rule_name, dtype):
    rule = RULES[rule_name]
    B, H, K, V = 3, 2, 48, 80
    x = make_inputs(rule, B, 1, H, K, V, dtype=torch.float64, initial_state=True, seed=6)
    o_ref, h_ref = call(rule.reference, rule, x, output_final_state=True)
    step = {n: t[:, 0].to(dtype) for n, t in x.items() if n != "initial_state"}
    args = (step["q"], step["k"], step["v"], step["beta"]) + ((step["g"],) if "g" in step else ())
    fn = ops.gated_delta_rule_step if "g" in step else ops.delta_rule_step
    for backend in ("triton", "torch"):
        for inplace in (True, False):
            state = x["initial_state"].float().clone()
            before = state.clone()
            o, h = fn(*args, state, backend=backend, inplace=inplace)
            if inplace:
                assert h.data_ptr() == state.data_ptr(), "inplace=True updates the state in place"
            else:
                assert torch.equal(state, before), "inplace=False leaves the caller's state alone"
            assert o.dtype == dtype
            # fp16 inputs carry ~5e-4 relative rounding; fp32 is exact up to fp32 arithmetic.
            tol = 1e-5 if dtype == torch.float32 else 3e-3
            assert_close(f"{fn.__name__} ({backend}) output", o, o_ref[:, 0], tol)
            assert_close(f"{fn.__name__} ({backend}) state", h, h_ref, tol)


def test_gpu_benchmark_dry_run(tmp_path):
    """The benchmark script's CPU-safe mode: tiny shapes, interpreter, every path it times."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "bench.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "gpu_chunk_delta", "--dry-run", "--json", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0
    assert out.exists() and '"rows"' in out.read_text()


# id: how the cotangents of o and h_T are laid out (all hold the same values' layout semantics)
LAYOUTS = {
    "stride0": lambda shape, gen: torch.randn((), generator=gen, dtype=torch.float64).expand(shape),
    "transposed": lambda shape, gen: torch.randn(shape[:-2] + shape[-2:][::-1], generator=gen,
                                                 dtype=torch.float64).transpose(-1, -2),
    "sliced": lambda shape, gen: torch.randn(shape[:-1] + (2 * shape[-1],), generator=gen, dtype=torch.float64)[..., ::2],
}


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=list(LAYOUTS))
def test_cotangents_in_any_layout(layout):
    """``loss = o.sum() + h_T.sum()`` hands the backward stride-0 cotangents; transposed and
    sliced ones come from other losses. The kernels index densely, so each must be made contiguous."""
    rule = RULES["gated_delta"]
    case = (2, 70, 2, 16, 16, None, True)
    grads = {}
    for form, dtype in ((rule.reference, torch.float64), (_triton(rule), torch.float32)):
        x, _ = _inputs(rule, case, dtype)
        o, h = call(form, rule, x, output_final_state=True)
        gen = torch.Generator().manual_seed(7)
        do, dh = (LAYOUTS[layout](tuple(t.shape), gen) for t in (o, h))
        assert not (do.is_contiguous() or dh.is_contiguous())
        grads[dtype] = torch.autograd.grad((o, h), list(x.values()), (do.to(o.dtype), dh.to(h.dtype)))
    for name, got, want in zip(x, grads[torch.float32], grads[torch.float64]):
        assert_close(f"d{name}", got, want, FP32_TOL)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_keeps_nothing_for_a_backward(mode, monkeypatch):
    """Inputs that require grad, under no_grad / inference_mode: the Triton Function keeps nothing
    and the state kernel does not write the per-chunk states."""
    from fastweights.ops.triton import chunk as triton_chunk
    from helpers import saved_by_function

    rule = RULES["gated_delta"]
    x, _ = _inputs(rule, (1, 70, 1, 16, 16, None, True), torch.float32)
    flags = []
    forward = triton_chunk.chunk_fwd
    monkeypatch.setattr(triton_chunk, "chunk_fwd", lambda *a: flags.append(a[-1]) or forward(*a))
    run = lambda: call(_triton(rule), rule, x, output_final_state=True)
    with getattr(torch, mode)():
        kept = saved_by_function(monkeypatch, run)
    trained = saved_by_function(monkeypatch, run)
    print(f"{mode}: kept {kept} B, states saved: {flags[0]} (with grad: {trained} B, {flags[1]})")
    assert (kept, flags[0]) == (0, False) and trained > 0 and flags[1] is True


def test_large_batches_fit_the_grid_and_int64_offsets():
    """N·H (and the decode step's B·H) goes on grid axis 0 (CUDA: 2³¹ − 1; axes 1, 2: 65,535), and
    state offsets (index · K · V) are computed in int64: index 40,000 at K = V = 256 is 2.6e9 > 2³¹."""
    import triton
    import triton.language as tl

    from fastweights.ops.triton.chunk import sequential_grid
    from fastweights.ops.triton.decode import step_grid

    for grid in (sequential_grid(8192, 16, 128, 64), step_grid(8192, 16, 128, 32)):
        assert grid[0] == 8192 * 16 and all(n <= 65_535 for n in grid[1:]), grid

    @triton.jit
    def offsets(out, BASE: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
        tl.store(out + tl.program_id(0), _chunk_kernels._state_offset(tl.program_id(0) + BASE, K, V))

    out = torch.zeros(2, dtype=torch.int64)
    offsets[(2,)](out, BASE=40_000, K=256, V=256)
    assert out.tolist() == [40_000 * 65_536, 40_001 * 65_536]


def test_chunk_tables_are_cached_and_right():
    """The kernels' chunk tables: built once per (B, T, device) or per packed offsets, then reused."""
    from fastweights.ops.triton.chunk import chunk_tables

    first, again = chunk_tables(None, 2, 130, "cpu"), chunk_tables(None, 2, 130, torch.device("cpu"))
    assert all(a is b for a, b in zip(first, again))
    cu, indices, offsets = first
    assert cu.tolist() == [0, 130, 260] and offsets.tolist() == [0, 3, 6]
    assert indices.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]
    cu, indices, offsets = chunk_tables(torch.tensor([0, 30, 130, 200]), 1, 200, "cpu")
    assert cu.tolist() == [0, 30, 130, 200] and offsets.tolist() == [0, 1, 3, 5]
    assert indices.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [2, 1]]
    assert chunk_tables(torch.tensor([0, 100, 200]), 1, 200, "cpu")[2].tolist() == [0, 2, 4]
