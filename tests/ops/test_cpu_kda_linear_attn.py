"""The compiled CPU kernels of linear attention (``chunk_linear_attn.cpp``: forward and backward)
and KDA (``chunk_kda.cpp``: the chunk forward and backward, and the decode step) against the
float64 recurrence, against the fp32 recurrence's own error, and against the PyTorch path
(``FASTWEIGHTS_CPU_KERNELS=0``) they replace. A fixture counts the kernels' calls, so a test
that silently ran the PyTorch path fails.
"""


import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.ops import cpu as cpu_kernels
from fastweights.ops.kda import chunk as kda_chunk_module
from fastweights.ops.step import kda_update
from fastweights.ops.linear_attn import chunk as linear_chunk_module
from helpers import RULES, call, make_inputs, rel_err, thread_and_batch_runs

LINEAR_RULES = ["linear", "linear_decay", "linear_elu_normalized"]



@pytest.fixture
def native_calls(monkeypatch):
    """Counts the compiled kernels' calls, so that a test fails if the PyTorch path ran instead."""
    seen = []
    for module, names in ((linear_chunk_module, ("_native_forward", "_native_backward")),
                          (kda_chunk_module, ("_native_forward", "_native_backward"))):
        for name in names:
            original = getattr(module, name)

            def wrapped(*args, _original=original, _name=name, _module=module.__name__, **kw):
                out = _original(*args, **kw)
                if out is not None:
                    seen.append(f"{_module}.{_name}")
                return out

            monkeypatch.setattr(module, name, wrapped)
    return seen


def _backward(o, h, leaves):
    gen = torch.Generator().manual_seed(5)
    (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum().add((h * h).sum()).backward()
    return [o, h] + [leaves[n].grad for n in sorted(leaves)]


def _run(form, x, kernels_on=True, **kwargs):
    """``form``'s output, final state and the gradients of every input (fixed random cotangents)."""
    cpu_kernels.set_enabled(kernels_on)
    try:
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        o, h = form(**leaves, output_final_state=True, **kwargs)
        return _backward(o, h, leaves)
    finally:
        cpu_kernels.set_enabled(None)


def _names(x):
    return ["o", "h_T"] + ["d" + n for n in sorted(x)]


def _kda_inputs(B, T, H, K, V, decay=1.0, initial_state=True, seed=0, dtype=torch.float64):
    """Random KDA inputs: unit keys, β in (0, 1), per-channel log decays in (−decay, 0)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V),
             g=-torch.rand(B, T, H, K, generator=gen, dtype=torch.float64) * decay, beta=torch.sigmoid(rand(B, T, H)))
    if initial_state:
        x["initial_state"] = rand(B, H, K, V)
    return {n: t.to(dtype) for n, t in x.items()}


# -- linear attention ------------------------------------------------------------------------


@pytest.mark.parametrize("rule_name", LINEAR_RULES)
@pytest.mark.parametrize("T,K,V,C,h0", [(1, 16, 24, 32, True), (63, 60, 33, 64, False), (100, 16, 24, 32, True),
                                       (1000, 8, 12, 64, True)])
def test_linear_attn_float64_kernel_equals_the_recurrence(kernels, native_calls, rule_name, T, K, V, C, h0, one_thread):
    """Forward, final state and every gradient (decay and normalizer included): ~1e-12 of the recurrence."""
    rule = RULES[rule_name]
    x = make_inputs(rule, 2, T, 2, K, V, initial_state=h0, seed=T)
    got = _run(lambda **a: call(rule.forms[2], rule, a), x, chunk_size=C)
    want = _run(lambda **a: call(rule.reference, rule, a), x, kernels_on=False)
    for name, a, b in zip(_names(x), got, want):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"
    assert {"fastweights.ops.linear_attn.chunk._native_forward",
            "fastweights.ops.linear_attn.chunk._native_backward"} <= set(native_calls)


@pytest.mark.parametrize("decay", [0.05, 7.0])
def test_linear_attn_float64_kernel_with_mild_and_strong_decays(kernels, native_calls, decay, one_thread):
    """Log decays of −0.05 and −7 per token (|b| reaches 448 in a chunk of 64: Γ from each
    difference's exponential): still the recurrence to ~1e-12."""
    rule = RULES["linear_decay"]
    x = make_inputs(rule, 1, 150, 2, 16, 20, initial_state=True, seed=6)
    x["g"] = torch.full_like(x["g"], -decay) + 0.01 * torch.rand_like(x["g"])
    got = _run(lambda **a: call(rule.forms[2], rule, a), x, chunk_size=64)
    want = _run(lambda **a: call(rule.reference, rule, a), x, kernels_on=False)
    for name, a, b in zip(_names(x), got, want):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"
    assert native_calls


@pytest.mark.parametrize("rule_name", ["linear_decay", "linear_elu_normalized"])
def test_linear_attn_fp32_kernel_error_within_2x_of_the_fp32_recurrence(kernels, rule_name, one_thread):
    rule = RULES[rule_name]
    x64 = make_inputs(rule, 2, 300, 2, 32, 40, initial_state=True, seed=3)
    x32 = {n: t.float() for n, t in x64.items()}
    exact = _run(lambda **a: call(rule.reference, rule, a), x64, kernels_on=False)
    ref32 = _run(lambda **a: call(rule.reference, rule, a), x32, kernels_on=False)
    got = _run(lambda **a: call(rule.forms[2], rule, a), x32)
    for i, (name, a, r, e) in enumerate(zip(_names(x64), got, ref32, exact)):
        bound = (2.0 if i < 2 else 3.0) * max(rel_err(r, e), 1e-7)
        assert rel_err(a, e) <= bound, f"{name}: {rel_err(a, e):.2e} vs the recurrence's {rel_err(r, e):.2e}"


def _packed_linear_case(rule_name):
    """Uneven packed sequences with a length-1 segment, an initial state each: the inputs and the
    chunk form on them (C 32)."""
    rule = RULES[rule_name]
    lengths = [5, 70, 1, 33, 2]
    x = make_inputs(rule, 1, sum(lengths), 3, 20, 12, initial_state=False, seed=8)
    kd, vd = rule.state_dims(20, 12)
    x["initial_state"] = torch.randn(len(lengths), 3, kd, vd, dtype=torch.float64).abs()
    cu = torch.tensor([0] + lengths).cumsum(0)
    return x, (lambda **a: call(rule.forms[2], rule, a, cu_seqlens=cu, chunk_size=32))


@pytest.mark.parametrize("rule_name", ["linear_decay", "linear_elu_normalized"])
def test_linear_attn_kernel_matches_the_pytorch_path_with_packed_sequences(kernels, rule_name, one_thread):
    """Uneven packed sequences with length-1 segments (cu_seqlens must increase strictly: no empty
    segment is accepted), an initial state each: the
    kernel and ``FASTWEIGHTS_CPU_KERNELS=0``'s path agree to 1e-13, forward and every gradient."""
    x, form = _packed_linear_case(rule_name)
    on, off = _run(form, x, True), _run(form, x, False)
    for name, a, b in zip(_names(x), on, off):
        assert rel_err(a, b) < 1e-13, f"{name}: {rel_err(a, b):.2e}"


def test_linear_attn_kernel_is_bitwise_the_same_on_one_and_two_threads_and_in_a_batch(kernels):
    rule = RULES["linear_decay"]
    x = {n: t.float() for n, t in make_inputs(rule, 3, 130, 3, 32, 32, initial_state=True, seed=2).items()}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(lambda **a: call(rule.forms[2], rule, a), x)
        torch.set_num_threads(2)
        two = _run(lambda **a: call(rule.forms[2], rule, a), x)
        alone = _run(lambda **a: call(rule.forms[2], rule, a), {n: t[:1] for n, t in x.items()})
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(alone[0], one[0][:1]) and torch.equal(alone[1], one[1][:1])


# -- KDA -------------------------------------------------------------------------------------


@pytest.mark.parametrize("T,K,V,C,h0", [(1, 16, 24, 64, True), (63, 60, 33, 64, False), (100, 16, 24, 32, True),
                                       (1000, 8, 12, 64, True)])
def test_kda_float64_kernel_equals_the_recurrence(kernels, native_calls, T, K, V, C, h0, one_thread):
    """The compiled forward and backward: output, final state and every gradient ~1e-12 of the recurrence."""
    x = _kda_inputs(2, T, 2, K, V, initial_state=h0, seed=T)
    got = _run(ops.chunk_kda, x, chunk_size=C)
    want = _run(ops.recurrent_kda, x, kernels_on=False)
    for name, a, b in zip(_names(x), got, want):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"
    assert {"fastweights.ops.kda.chunk._native_forward", "fastweights.ops.kda.chunk._native_backward"} <= set(native_calls)


@pytest.mark.parametrize("decay,C", [(0.05, 64), (7.0, 64), (7.0, 128)])
def test_kda_float64_kernel_with_mild_and_strong_decays(kernels, native_calls, decay, C, one_thread):
    """α down to 1e-3 per token and channel (|b| up to about 450 over a chunk of 128: in float64 still
    within the whole-chunk products' e^{±600}); still ~1e-12. The sub-block and pair-by-pair forms:
    test_kda_kernel_across_its_three_forms_of_s_and_p."""
    x = _kda_inputs(1, 150, 2, 16, 20, decay=decay, seed=6)
    got = _run(ops.chunk_kda, x, chunk_size=C)
    want = _run(ops.recurrent_kda, x, kernels_on=False)
    for name, a, b in zip(_names(x), got, want):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"
    assert native_calls


@pytest.mark.parametrize("decay", [1.0, 7.0])
def test_kda_fp32_kernel_error_within_2x_of_the_fp32_recurrence(kernels, decay, one_thread):
    x64 = _kda_inputs(2, 300, 2, 32, 40, decay=decay, seed=3)
    x32 = {n: t.float() for n, t in x64.items()}
    exact = _run(ops.recurrent_kda, x64, kernels_on=False)
    ref32 = _run(ops.recurrent_kda, x32, kernels_on=False)
    got = _run(ops.chunk_kda, x32)
    for i, (name, a, r, e) in enumerate(zip(_names(x64), got, ref32, exact)):
        bound = (2.0 if i < 2 else 3.0) * max(rel_err(r, e), 1e-7)
        assert rel_err(a, e) <= bound, f"{name}: {rel_err(a, e):.2e} vs the recurrence's {rel_err(r, e):.2e}"


@pytest.mark.parametrize("dtype,strong", [(torch.float64, 25.0), (torch.float64, 400.0), (torch.float32, 4.0),
                                          (torch.float32, 40.0)], ids=["f64-d25", "f64-d400", "f32-d4", "f32-d40"])
def test_kda_kernel_across_its_three_forms_of_s_and_p(kernels, native_calls, dtype, strong, one_thread):
    """The kernel forms a chunk's S and P in one of three ways, by its decays (chunk_kda.cpp): one
    product over the whole chunk where every |b| stays within 60 (600 in float64), else sub-block
    products, and pair by pair inside a sub-block whose span passes that limit. Log decays in
    (−1, 0) per token (|b| ≤ 64 over a chunk, about 32: the whole chunk at once) except the second
    chunk's, in (−strong, 0): float64 25 (|b| ≈ 800 over the chunk, ≈ 100 over a sub-block of 8: the
    sub-block products) and 400 (≈ 1600 over a sub-block: pair by pair); float32 4 (|b| ≈ 128, ≈ 16
    over a sub-block) and 40 (≈ 160 over a sub-block). So one sequence passes from one form to the
    other and back, forward and backward: float64 ~1e-12 of the recurrence, float32 within 2×
    (gradients 3×) of the float32 recurrence's error."""
    x64 = _kda_inputs(2, 200, 2, 32, 20, decay=1.0, seed=11)
    x64["g"][:, 64:128] *= strong
    exact = _run(ops.recurrent_kda, x64, kernels_on=False)
    if dtype == torch.float64:
        got = _run(ops.chunk_kda, x64, chunk_size=64)
        for name, a, b in zip(_names(x64), got, exact):
            assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"
    else:
        x32 = {n: t.float() for n, t in x64.items()}
        ref32 = _run(ops.recurrent_kda, x32, kernels_on=False)
        got = _run(ops.chunk_kda, x32, chunk_size=64)
        for i, (name, a, r, e) in enumerate(zip(_names(x64), got, ref32, exact)):
            bound = (2.0 if i < 2 else 3.0) * max(rel_err(r, e), 1e-7)
            assert rel_err(a, e) <= bound, f"{name}: {rel_err(a, e):.2e} vs the recurrence's {rel_err(r, e):.2e}"
    assert {"fastweights.ops.kda.chunk._native_forward", "fastweights.ops.kda.chunk._native_backward"} <= set(native_calls)


def test_kda_kernel_matches_the_pytorch_path_with_packed_sequences(kernels, one_thread):
    lengths = [5, 70, 1, 33, 2]
    x = _kda_inputs(1, sum(lengths), 3, 20, 12, initial_state=False, seed=8)
    x["initial_state"] = torch.randn(len(lengths), 3, 20, 12, dtype=torch.float64)
    cu = torch.tensor([0] + lengths).cumsum(0)
    on = _run(ops.chunk_kda, x, True, cu_seqlens=cu, chunk_size=32)
    off = _run(ops.chunk_kda, x, False, cu_seqlens=cu, chunk_size=32)
    for name, a, b in zip(_names(x), on, off):
        assert rel_err(a, b) < 1e-13, f"{name}: {rel_err(a, b):.2e}"


def test_kda_kernel_is_bitwise_the_same_on_one_and_two_threads_and_in_a_batch(kernels):
    x = _kda_inputs(3, 130, 3, 32, 32, seed=2, dtype=torch.float32)
    one, two, alone = thread_and_batch_runs(ops.chunk_kda, x)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(alone[0], one[0][:1]) and torch.equal(alone[1], one[1][:1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kda_decode_step_kernel_equals_the_pytorch_step(kernels, dtype, one_thread):
    """The compiled step (no grad, CPU) against :func:`kda_update` (the reference's step): float64
    to 1e-13; fp32 within 2× of the PyTorch step's own error against float64. A new state is
    returned and the old one left as it was."""
    gen = torch.Generator().manual_seed(1)
    N, H, K, V = 3, 4, 60, 33

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v, h = rand(N, H, K), F.normalize(rand(N, H, K), dim=-1), rand(N, H, V), rand(N, H, K, V)
    g, beta = -rand(N, H, K).abs() * 3, torch.rand(N, H, generator=gen, dtype=torch.float64)
    exact = kda_update(q, k, v, beta, g, h, 0.3)
    args = [t.to(dtype) for t in (q, k, v, beta, g, h)]
    before = args[-1].clone()
    with torch.no_grad():
        got = ops.kda_step(*args, 0.3)
        torch_step = kda_update(*args, 0.3)
    assert torch.equal(args[-1], before) and got[1].data_ptr() != args[-1].data_ptr()
    for a, t, e in zip(got, torch_step, exact):
        if dtype == torch.float64:
            assert rel_err(a, e) < 1e-13
        else:
            assert rel_err(a, e) <= 2.0 * max(rel_err(t, e), 1e-7)


def test_kda_decode_step_keeps_the_pytorch_step_for_gradients(kernels):
    """With a gradient to record the step is the PyTorch one (autograd reaches every input)."""
    x = _kda_inputs(2, 1, 2, 8, 6, seed=4)
    leaves = [x[n][:, 0].clone().requires_grad_(True) for n in ("q", "k", "v", "beta", "g")]
    h = x["initial_state"].clone().requires_grad_(True)
    o, h_new = ops.kda_step(*leaves, h, 0.5)
    (o.sum() + h_new.sum()).backward()
    assert all(t.grad is not None for t in leaves + [h])


def test_linear_attention_flop_count_of_the_roofline_rows():
    from benchmarks.roofline import linear_attn_flops

    # C = 64, K = V = 128: Q Kᵀ and P V (2·64²·128 each), Q h and K̄ᵀ V (2·64·128² each)
    assert linear_attn_flops(1, 1, 64, 128, 128, 64) == 2 * 1048576 + 2 * 2097152
    # the backward adds Q Kᵀ, dP K, dPᵀ Q, Pᵀ dO, dO Vᵀ (C²·K or C²·V) and four C·K·V products
    fwd = 2 * 1048576 + 2 * 2097152
    assert linear_attn_flops(1, 1, 64, 128, 128, 64, backward=True) == fwd + 5 * 1048576 + 4 * 2097152
    # a partial chunk counts as a whole one
    assert linear_attn_flops(2, 3, 65, 8, 8, 64) == 2 * 3 * 2 * linear_attn_flops(1, 1, 64, 8, 8, 64)


# -- the inference path: no gradient asked for, nothing kept ----------------------------------
#
# Without a gradient to record, both ops call their inference custom op
# (``fastweights::chunk_linear_attn_infer`` / ``chunk_kda_infer``): the kernels then keep no
# chunk copies or states, and linear attention reads a whole chunk's rows where they lie in the
# token-major input (the partial last chunk gathered and zero-padded).


@pytest.fixture
def keep_flags(monkeypatch):
    """The ``keep`` flag of every compiled forward call (the last argument of ``_native_forward``)."""
    flags = []
    for module in (linear_chunk_module, kda_chunk_module):
        original = module._native_forward

        def wrapped(*args, _original=original, _plain=7 + (module is kda_chunk_module), **kw):
            out = _original(*args, **kw)
            if out is not None:  # keep is passed positionally, or left at its default (True)
                flags.append(args[-1] if len(args) > _plain else True)
            return out

        monkeypatch.setattr(module, "_native_forward", wrapped)
    return flags


def _infer(form, x, kernels_on=True, **kwargs):
    """``form``'s output and final state under ``torch.no_grad()``."""
    cpu_kernels.set_enabled(kernels_on)
    try:
        with torch.no_grad():
            return list(form(**x, output_final_state=True, **kwargs))
    finally:
        cpu_kernels.set_enabled(None)


@pytest.mark.parametrize("rule_name", LINEAR_RULES)
@pytest.mark.parametrize("B,T,K,V,C,h0", [(2, 1, 16, 24, 32, True), (2, 63, 60, 33, 64, False), (3, 200, 60, 40, 64, True),
                                         (1, 1000, 8, 12, 64, True)])
def test_linear_attn_float64_inference_kernel_equals_the_recurrence(kernels, keep_flags, rule_name, B, T, K, V, C, h0,
                                                                    one_thread):
    """No grad: output and final state ~1e-12 of the recurrence, whole chunks read in place and a
    partial last one; and the kernel kept nothing (keep False)."""
    rule = RULES[rule_name]
    x = make_inputs(rule, B, T, 3, K, V, initial_state=h0, seed=T + 1)
    got = _infer(lambda **a: call(rule.forms[2], rule, a), x, chunk_size=C)
    want = _infer(lambda **a: call(rule.reference, rule, a), x, kernels_on=False)
    for name, a, b in zip(["o", "h_T"], got, want):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"
    assert keep_flags and not any(keep_flags)


@pytest.mark.parametrize("decay", [0.05, 7.0])
def test_linear_attn_float64_inference_kernel_with_mild_and_strong_decays(kernels, keep_flags, decay, one_thread):
    rule = RULES["linear_decay"]
    x = make_inputs(rule, 1, 150, 2, 16, 20, initial_state=True, seed=6)
    x["g"] = torch.full_like(x["g"], -decay) + 0.01 * torch.rand_like(x["g"])
    got = _infer(lambda **a: call(rule.forms[2], rule, a), x, chunk_size=64)
    want = _infer(lambda **a: call(rule.reference, rule, a), x, kernels_on=False)
    for name, a, b in zip(["o", "h_T"], got, want):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"
    assert keep_flags == [False]


@pytest.mark.parametrize("rule_name", ["linear_decay", "linear_elu_normalized"])
def test_linear_attn_inference_kernel_matches_the_pytorch_path_with_packed_sequences(kernels, rule_name, one_thread):
    x, form = _packed_linear_case(rule_name)
    for name, a, b in zip(["o", "h_T"], _infer(form, x, True), _infer(form, x, False)):
        assert rel_err(a, b) < 1e-13, f"{name}: {rel_err(a, b):.2e}"


def test_linear_attn_inference_and_training_forwards_agree(kernels, keep_flags, one_thread):
    """The same forward with and without a gradient (kept chunks read vs the input read in place):
    float64 to 1e-14; fp32 inference bitwise the same alone and in a batch, on 1 and 2 threads."""
    rule = RULES["linear_decay"]
    x = make_inputs(rule, 2, 300, 2, 32, 24, initial_state=True, seed=9)
    trained = _run(lambda **a: call(rule.forms[2], rule, a), x)[:2]
    inferred = _infer(lambda **a: call(rule.forms[2], rule, a), x)
    for a, b in zip(inferred, trained):
        assert rel_err(a, b) < 1e-14
    assert keep_flags == [True, False]
    x32 = {n: t.float() for n, t in x.items()}
    threads = torch.get_num_threads()
    try:
        one = _infer(lambda **a: call(rule.forms[2], rule, a), x32)
        torch.set_num_threads(2)
        two = _infer(lambda **a: call(rule.forms[2], rule, a), x32)
        alone = _infer(lambda **a: call(rule.forms[2], rule, a), {n: t[1:] for n, t in x32.items()})
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(alone[0], one[0][1:]) and torch.equal(alone[1], one[1][1:])


def test_linear_attn_kernel_with_decays_that_fold_in_some_chunks_and_not_in_others(kernels, native_calls, one_thread):
    """The forward moves a chunk's decays onto row and column factors where they stay within e^±60
    and runs the plain form elsewhere: log decays from −0.01 to −12 per token, so chunks of both
    kinds (and a chunk sum beyond −60) meet in one sequence, K = V = 128 (whole 16 × 16 tiles of the
    key transpose); float64 forward, final state and every gradient to ~1e-12 of the recurrence,
    with and without a gradient."""
    rule = RULES["linear_decay"]
    x = make_inputs(rule, 2, 300, 2, 128, 128, initial_state=True, seed=21)
    gen = torch.Generator().manual_seed(22)
    x["g"] = -torch.exp(torch.empty_like(x["g"]).uniform_(-4.6, 2.5, generator=gen)) * (torch.arange(300) // 64 % 2 + 0.05).view(1, -1, 1).double()
    got = _run(lambda **a: call(rule.forms[2], rule, a), x, chunk_size=64)
    want = _run(lambda **a: call(rule.reference, rule, a), x, kernels_on=False)
    for name, g, w in zip(_names(x), got, want):
        assert rel_err(g, w) < 1e-12, f"{name}: {rel_err(g, w):.2e}"
    for name, g, w in zip(["o", "h_T"], _infer(lambda **a: call(rule.forms[2], rule, a), x, chunk_size=64), want):
        assert rel_err(g, w) < 1e-12, f"inference {name}: {rel_err(g, w):.2e}"
    assert native_calls


@pytest.mark.parametrize("gated", [False, True])
def test_linear_attn_fp32_inference_at_the_benchmark_heads(kernels, gated, one_thread):
    """No grad, fp32, H 8 and K = V = 128 (the benchmark's heads, worked in groups; rows read in
    place, and a partial last chunk): within 2× of the fp32 recurrence's error against float64,
    and bitwise the same alone, in a batch of 2 and on 2 threads."""
    rule = RULES["linear_decay" if gated else "linear"]
    x64 = make_inputs(rule, 2, 200, 8, 128, 128, initial_state=True, seed=23)
    x32 = {n: t.float() for n, t in x64.items()}
    exact = _infer(lambda **a: call(rule.reference, rule, a), x64, kernels_on=False)
    ref32 = _infer(lambda **a: call(rule.reference, rule, a), x32, kernels_on=False)
    got = _infer(lambda **a: call(rule.forms[2], rule, a), x32, chunk_size=64)
    for name, a, r, e in zip(["o", "h_T"], got, ref32, exact):
        assert rel_err(a, e) <= 2.0 * max(rel_err(r, e), 1e-7), f"{name}: {rel_err(a, e):.2e} vs {rel_err(r, e):.2e}"
    one, two, alone = thread_and_batch_runs(lambda **a: call(rule.forms[2], rule, a, chunk_size=64), x32)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(alone[0], one[0][:1]) and torch.equal(alone[1], one[1][:1])


@pytest.mark.parametrize("T,K,V,C,h0", [(1, 16, 24, 64, True), (63, 60, 33, 64, False), (200, 60, 40, 64, True),
                                       (1000, 8, 12, 64, True)])
def test_kda_float64_inference_kernel_equals_the_recurrence(kernels, keep_flags, T, K, V, C, h0, one_thread):
    x = _kda_inputs(2, T, 3, K, V, initial_state=h0, seed=T + 1)
    got = _infer(ops.chunk_kda, x, chunk_size=C)
    want = _infer(ops.recurrent_kda, x, kernels_on=False)
    for name, a, b in zip(["o", "h_T"], got, want):
        assert rel_err(a, b) < 1e-12, f"{name}: {rel_err(a, b):.2e}"
    assert keep_flags and not any(keep_flags)


def test_kda_inference_and_training_forwards_agree(kernels, keep_flags, one_thread):
    x = _kda_inputs(2, 300, 2, 32, 24, decay=3.0, seed=9)
    trained = _run(ops.chunk_kda, x)[:2]
    inferred = _infer(ops.chunk_kda, x)
    for a, b in zip(inferred, trained):
        assert rel_err(a, b) < 1e-14
    assert keep_flags == [True, False]


@pytest.mark.parametrize("op_name", ["chunk_linear_attn_infer", "chunk_kda_infer"])
def test_inference_ops_fakes_match_the_kernels(kernels, op_name, one_thread):
    """opcheck: the inference ops' fakes give the real outputs' shapes, dtypes and strides (T not
    a multiple of C, K != V, with and without the gate and the initial state)."""
    gen = torch.Generator().manual_seed(0)
    n, h, t, dk, dv, c = 2, 3, 10, 5, 4, 4

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = rand(n, h, t, dk), F.normalize(rand(n, h, t, dk), dim=-1), rand(n, h, t, dv)
    op = getattr(torch.ops.fastweights, op_name).default
    if op_name == "chunk_linear_attn_infer":
        samples = [(q, k, v, -torch.rand(n, h, t, generator=gen), rand(n, h, dk, dv), 0.5, c, True),
                   (q, k, v, None, None, 0.5, c, True), (q, k, v, None, None, 0.5, c, False)]
    else:
        beta, gk = torch.rand(n, h, t, generator=gen), -torch.rand(n, h, t, dk, generator=gen)
        samples = [(q, k, v, beta, gk, rand(n, h, dk, dv), 0.5, c, True), (q, k, v, beta, gk, None, 0.5, c, False)]
    for args in samples:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
