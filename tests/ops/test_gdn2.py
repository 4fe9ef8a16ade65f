"""Gated DeltaNet-2 (erase gate b per key channel, write gate w per value channel): every form
against the float64 recurrence, forward and every gradient, on awkward shapes, with strong
decays; the recurrence against a plain loop, against KDA when b = w = β, and against fla's
``naive_recurrent_gdn2``; fla's call forms; bad inputs; low precision and torch.compile.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from fastweights import ops

from helpers import assert_all_close, assert_close, chunk_option, forward_backward, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def gdn2_inputs(B, T, H, K, V, *, seed=0, dtype=F64, strong=False, initial_state=True):
    """Random GDN-2 inputs: unit keys, b in (0, 2), w in (0, 1), g in (−6.9, 0) per channel
    when ``strong`` (α down to 1e-3 per token), else in about (−1, 0)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    x = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V),
             g=(-6.9 * torch.rand(B, T, H, K, generator=gen, dtype=F64)) if strong else F.logsigmoid(rand(B, T, H, K) + 2),
             b=2 * torch.sigmoid(rand(B, T, H, K)), w=torch.sigmoid(rand(B, T, H, V)))
    x = {n: t.to(dtype) for n, t in x.items()}
    if initial_state:
        x["initial_state"] = rand(B, H, K, V) * 0.5
    return x


def loop_gdn2(q, k, v, g, b, w, initial_state=None, scale=None):
    """GDN-2 written out plainly, one token and one head at a time (float64)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    h = torch.zeros(B, H, K, V, dtype=F64) if initial_state is None else initial_state.double().clone()
    o = torch.zeros(B, T, H, V, dtype=F64)
    for t in range(T):
        for n in range(B):
            for i in range(H):
                kt, decay = k[n, t, i].double(), torch.exp(g[n, t, i].double())
                transition = torch.eye(K, dtype=F64) - torch.outer(kt, b[n, t, i].double() * kt)
                h[n, i] = transition @ torch.diag(decay) @ h[n, i] + torch.outer(kt, w[n, t, i].double() * v[n, t, i].double())
                o[n, t, i] = scale * h[n, i].T @ q[n, t, i].double()
    return o, h


FORMS = {
    "parallel": (ops.parallel_gdn2, {}),
    "chunk16": (ops.chunk_gdn2, dict(chunk_size=16)),
    "chunk64": (ops.chunk_gdn2, dict(chunk_size=64)),
}
SHAPES = {  # B, T, H, K, V
    "T1": (2, 1, 2, 8, 4),
    "T63_K60": (1, 63, 2, 60, 20),
    "T100_KneV": (2, 100, 2, 12, 10),
}


run = forward_backward  # (o, h_T, grads) of (o·do).sum() + (h_T·dh).sum()




def test_recurrence_equals_the_plain_loop_and_kda_when_b_equals_w():
    x = gdn2_inputs(2, 9, 2, 5, 3)
    o, h = ops.recurrent_gdn2(**x, output_final_state=True)
    o_ref, h_ref = loop_gdn2(**x)
    assert_close("recurrent_gdn2 o vs loop", o, o_ref, 1e-13)
    assert_close("recurrent_gdn2 h_T vs loop", h, h_ref, 1e-13)
    beta = torch.rand(2, 9, 2, dtype=F64)
    x.update(b=beta[..., None].expand(-1, -1, -1, 5), w=beta[..., None].expand(-1, -1, -1, 3))
    o, h = ops.recurrent_gdn2(**x, output_final_state=True)
    o_kda, h_kda = ops.recurrent_kda(x["q"], x["k"], x["v"], x["g"], beta, initial_state=x["initial_state"],
                                     output_final_state=True)
    assert_close("GDN-2 with b = w = β vs KDA o", o, o_kda, 1e-13)
    assert_close("GDN-2 with b = w = β vs KDA h_T", h, h_kda, 1e-13)


@pytest.mark.slow  # importing fla costs ~10 s
def test_recurrence_equals_fla_naive_references():
    """fla's naive references compute in float32 whatever the input dtype."""
    naive = pytest.importorskip("fla.ops.gdn2.naive")
    x = gdn2_inputs(2, 40, 2, 8, 6, seed=2)
    o, h = ops.recurrent_gdn2(**x, output_final_state=True)
    args = [x[n] for n in ("q", "k", "v", "g", "b", "w")]
    o_fla, h_fla = naive.naive_recurrent_gdn2(*args, initial_state=x["initial_state"], output_final_state=True)
    assert_close("recurrent_gdn2 vs fla naive_recurrent_gdn2 o", o, o_fla.double(), 1e-5)
    assert_close("recurrent_gdn2 vs fla naive_recurrent_gdn2 h_T", h, h_fla.double(), 1e-5)
    o_fla, h_fla = naive.naive_chunk_gdn2(*args, initial_state=x["initial_state"], output_final_state=True, chunk_size=16)
    o, h = ops.chunk_gdn2(**x, output_final_state=True, chunk_size=16)
    assert_close("chunk_gdn2 vs fla naive_chunk_gdn2 o", o, o_fla.double(), 1e-5)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("form", list(FORMS), ids=list(FORMS))
def test_form_equals_recurrence_forward_and_gradients(form, shape):
    x = gdn2_inputs(*SHAPES[shape], seed=3)
    fn, options = FORMS[form]
    assert_all_close(f"{form} {shape}", run(fn, x, options), run(ops.recurrent_gdn2, x), 1e-12, 1e-11)


def test_chunk_form_at_T_1000():
    x = gdn2_inputs(1, 1000, 1, 16, 12, seed=4)
    assert_all_close("chunk T=1000", run(ops.chunk_gdn2, x, dict(chunk_size=64)), run(ops.recurrent_gdn2, x),
                     1e-12, 1e-11)


@pytest.mark.parametrize("chunk_size", [64, 128])
def test_strong_decays_do_not_overflow(chunk_size):
    """α down to 1e-3 per token and channel: float64 equal to the recurrence; fp32 finite and
    within 2x (3x for gradients) of the fp32 recurrence's error against float64."""
    x = gdn2_inputs(1, 200, 2, 16, 8, seed=5, strong=True)
    truth = run(ops.recurrent_gdn2, x)
    assert_all_close(f"C={chunk_size} fp64", run(ops.chunk_gdn2, x, dict(chunk_size=chunk_size)), truth, 1e-12, 1e-11)
    x32 = {n: t.float() for n, t in x.items()}
    got = run(ops.chunk_gdn2, x32, dict(chunk_size=chunk_size))
    base = run(ops.recurrent_gdn2, x32)
    assert all(torch.isfinite(t).all() for t in (got[0], got[1], *got[2].values()))
    pairs = [("o", got[0], base[0], truth[0], 2), ("h_T", got[1], base[1], truth[1], 2)]
    pairs += [(f"d{n}", got[2][n], base[2][n], truth[2][n], 3) for n in truth[2]]
    for name, a, b, want, factor in pairs:
        err, base_err = rel_err(a, want), rel_err(b, want)
        print(f"C={chunk_size} fp32 {name}: chunk {err:.2e}, recurrent {base_err:.2e}")
        assert err <= factor * base_err, (name, err, base_err)


@pytest.mark.parametrize("form", ["parallel", "chunk16"])
def test_varlen_equals_each_sequence_alone(form):
    """Uneven packed lengths (5, 32, 63), each with its own initial state; gradients too."""
    fn, options = FORMS[form]
    x = gdn2_inputs(1, 100, 2, 12, 6, seed=7, initial_state=False)
    x["initial_state"] = torch.randn(3, 2, 12, 6, dtype=F64)
    cu = torch.tensor([0, 5, 37, 100])
    want = run(ops.recurrent_gdn2, x, dict(cu_seqlens=cu))
    assert_all_close(f"{form} packed", run(fn, x, dict(options, cu_seqlens=cu)), want, 1e-12, 1e-11)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = {n: t[:, a:b] for n, t in x.items() if n != "initial_state"}
        o_i, h_i = ops.recurrent_gdn2(**alone, initial_state=x["initial_state"][i:i + 1], output_final_state=True)
        assert_close(f"sequence {i} alone", want[0][:, a:b], o_i, 1e-13)
        assert_close(f"sequence {i} state", want[1][i:i + 1], h_i, 1e-13)


def test_gradcheck_chunk_and_parallel():
    x = gdn2_inputs(1, 6, 1, 3, 2, seed=9)
    names = list(x)
    for fn, options in ((ops.chunk_gdn2, dict(chunk_size=4)), (ops.parallel_gdn2, {})):
        def f(*tensors):
            return fn(**dict(zip(names, tensors)), output_final_state=True, **options)

        leaves = [x[n].clone().requires_grad_(True) for n in names]
        assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8)


def test_step_equals_the_recurrence():
    x = gdn2_inputs(2, 7, 2, 5, 4, seed=10)
    o_ref, h_ref = ops.recurrent_gdn2(**x, output_final_state=True)
    h = x["initial_state"]
    for t in range(7):
        o_t, h = ops.gdn2_step(*(x[n][:, t] for n in ("q", "k", "v", "g", "b", "w")), h, 5 ** -0.5)
        assert_close(f"step {t}", o_t, o_ref[:, t], 1e-14)
    assert_close("step h_T", h, h_ref, 1e-14)


def test_fla_options_gate_norm_grouped_heads_and_state_layout():
    """fla's in-kernel gate, l2 norm, grouped value heads (HV = 2H), state_v_first and
    fla's positional order on every form and the alias, against the plain inputs."""
    gen = torch.Generator().manual_seed(13)
    B, T, H, HV, K, V = 1, 20, 2, 4, 6, 5

    def rand(*shape):
        return torch.randn(*shape, dtype=F64, generator=gen)

    q, k, v, raw = rand(B, T, H, K), rand(B, T, H, K), rand(B, T, HV, V), rand(B, T, HV, K)
    b, w = 2 * torch.sigmoid(rand(B, T, HV, K)), torch.sigmoid(rand(B, T, HV, V))
    h0, A_log, dt_bias = rand(B, HV, V, K), rand(HV), rand(HV * K)
    gate = ops.kda_gate(raw, A_log, dt_bias)

    def l2(x):
        return (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(2, 2)

    o_ref, h_ref = loop_gdn2(l2(q), l2(k), v, gate, b, w, h0.transpose(-1, -2))
    for fn in (ops.recurrent_gdn2, ops.parallel_gdn2, ops.chunk_gdn2):
        o, h = fn(q, k, v, raw, b, w, None, h0, True, True, True, A_log=A_log, dt_bias=dt_bias, state_v_first=True,
                  **chunk_option(fn, 8), safe_gate=True, disable_recompute=True)
        assert_close(f"{fn.__name__} fla options o", o, o_ref, 1e-12)
        assert_close(f"{fn.__name__} fla options h_T [N, HV, V, K]", h.transpose(-1, -2), h_ref, 1e-12)
    o, h = ops.fused_recurrent_gdn2(q, k, v, raw, b, w, A_log, dt_bias, None, h0, True, True, True, None, True)
    assert_close("fused_recurrent_gdn2 positional o", o, o_ref, 1e-12)
    assert_close("fused_recurrent_gdn2 positional h_T", h.transpose(-1, -2), h_ref, 1e-12)


GDN2_FORMS = [ops.recurrent_gdn2, ops.parallel_gdn2, ops.chunk_gdn2]


@pytest.mark.parametrize("fn", GDN2_FORMS, ids=lambda f: f.__name__)
def test_bad_inputs_are_refused_naming_the_argument(fn):
    x = gdn2_inputs(1, 6, 2, 4, 3, initial_state=False)
    name = fn.__name__
    with pytest.raises(ValueError, match=rf"{name}: `b` \(the erase gate\) must have shape \[B, T, HV, K\] = "
                                         r"\[1, 6, 2, 4\], got \[1, 6, 2, 3\]"):
        fn(**{**x, "b": x["b"][..., :3]})
    with pytest.raises(ValueError, match=rf"{name}: `w` \(the write gate\) must have shape .*got \[1, 6, 2\]"):
        fn(**{**x, "w": x["w"][..., 0]})
    with pytest.raises(ValueError, match=rf"{name}: `b` \(the erase gate\) must lie in \[0, 2\], got values up to 2.5"):
        fn(**{**x, "b": x["b"].clone().index_fill_(3, torch.tensor([1]), 2.5)})
    with pytest.raises(ValueError, match=rf"{name}: `w` \(the write gate\) must lie in \[0, 1\], got values down to -0.1"):
        fn(**{**x, "w": x["w"].clone().index_fill_(3, torch.tensor([0]), -0.1)})
    with pytest.raises(ValueError, match=rf"{name}: `g` \(a per-key-channel log decay\) must be <= 0, got values up to 0.5"):
        fn(**{**x, "g": x["g"].clone().index_fill_(3, torch.tensor([1]), 0.5)})
    with pytest.raises(ValueError, match=rf"{name}: `g` .*\[B, T, H, K\] = \[1, 6, 2, 4\], got \[1, 6, 2\]"):
        fn(**{**x, "g": x["g"][..., 0]})
    with pytest.raises(TypeError, match=rf"{name}: `w` is required"):
        fn(**{n: t for n, t in x.items() if n != "w"})
    with pytest.raises(TypeError, match=rf"{name}: `b` must be a floating-point tensor"):
        fn(**{**x, "b": x["b"].long()})
    poisoned = x["b"].clone()
    poisoned[0, 2, 1, 1] = float("nan")
    with pytest.raises(ValueError, match=rf"{name}: `b` contains 1 non-finite"):
        fn(**{**x, "b": poisoned})
    with pytest.raises(TypeError, match=rf"{name}\(\) got an unexpected keyword argument `cu_seqlen`; did you mean"):
        fn(**x, cu_seqlen=torch.tensor([0, 6]))
    with ops.value_checks(False):  # out-of-range gates, when asked for
        fn(**{**x, "b": x["b"] + 1.5})


@pytest.mark.parametrize("fn", [ops.chunk_gdn2, ops.parallel_gdn2], ids=lambda f: f.__name__)
def test_bf16_within_2x_of_the_recurrent_form(fn):
    """bf16 inputs, fp32 compute: error vs float64 at most 2x (3x for gradients) the recurrent form's."""
    x = gdn2_inputs(1, 80, 2, 16, 16, seed=19, initial_state=False)
    xb = {n: t.to(torch.bfloat16) for n, t in x.items()}
    truth = run(ops.recurrent_gdn2, {n: t.double() for n, t in xb.items()})
    base = run(ops.recurrent_gdn2, xb)
    got = run(fn, xb, chunk_option(fn, 32))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    pairs = [("o", got[0], base[0], truth[0], 2), ("h_T", got[1], base[1], truth[1], 2)]
    pairs += [(f"d{n}", got[2][n], base[2][n], truth[2][n], 3) for n in truth[2]]
    for name, a, b, want, factor in pairs:
        err, base_err = rel_err(a, want), rel_err(b, want)
        print(f"{fn.__name__} bf16 {name}: {err:.2e} (recurrent {base_err:.2e})")
        assert err <= factor * base_err, (name, err, base_err)


@pytest.mark.slow  # ~5 s; the LM test of tests/layers/test_gdn2_deltaproduct_layers.py checks no graph break
def test_chunk_compiles_without_graph_breaks_and_equals_eager():
    """``fullgraph=True`` (a graph break raises), forward and backward, equal to eager."""
    torch._dynamo.reset()
    x = gdn2_inputs(2, 11, 2, 4, 3, seed=23)

    def call(**inputs):
        return ops.chunk_gdn2(**inputs, chunk_size=4)

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    o_c, h_c, g_c = run(compiled, x)
    o_e, h_e, g_e = run(call, x)
    errors = {"o": rel_err(o_c, o_e), "h_T": rel_err(h_c, h_e), **{f"d{n}": rel_err(g_c[n], g_e[n]) for n in g_e}}
    assert all(e <= 1e-12 for e in errors.values()), errors
    torch._dynamo.reset()


def test_intermediate_states_are_the_recurrence_at_chunk_entries():
    """``return_intermediate_states=True`` (fla's serving output): ``h[:, c]`` is the state entering chunk c,
    the recurrence's final state after c·C tokens (float64, T not a multiple of C, an initial state)."""
    x = gdn2_inputs(2, 23, 2, 5, 3, seed=4)
    o, h_t, states = ops.chunk_gdn2(**x, chunk_size=8, output_final_state=True, return_intermediate_states=True)
    assert states.shape == (2, 3, 2, 5, 3)
    for c in range(3):
        prefix = {n: (t[:, :8 * c] if n != "initial_state" else t) for n, t in x.items()}
        want = x["initial_state"] if c == 0 else ops.recurrent_gdn2(**prefix, output_final_state=True)[1]
        assert_close(f"entry state of chunk {c}", states[:, c], want, 1e-12)
    assert_close("o", o, ops.recurrent_gdn2(**x)[0], 1e-12)


@pytest.mark.parametrize("chunk_size", [7, 24, 32])
def test_forward_only_path_equals_kda_driver_and_recurrence(chunk_size):
    """The chunk forward's own driver (S and P formed together by recursive halving, one triangular
    solve) against KDA's driver with GDN-2's block terms and the float64 recurrence, at chunk sizes
    padded to a power of two (C = 7, 24) and not (C = 32),
    T not a multiple of C, K != V, B > 1, an initial state; fp32 with strong decays within 2x of
    the fp32 recurrence's error, floored at 1e-7 as the other fp32 checks are: where the last
    chunk is short (T 200 at C 7: 4 tokens) and an initial state enters it, the chunk form's final
    state sits at about 2x the recurrence's error (1.9-2.1x over 64 heads), both near fp32's unit
    roundoff (6e-8), so the product order of the machine's BLAS decides the bare ratio."""
    from fastweights.ops.gdn2 import chunk as gdn2_chunk_module
    from fastweights.ops.gdn2.parallel import gdn2_block_terms
    from fastweights.ops.kda import chunk as kda_chunk_module

    x = gdn2_inputs(2, 75, 2, 60, 20, seed=7)
    q, k, v, g, b, w = (x[n].transpose(1, 2).contiguous() for n in ("q", "k", "v", "g", "b", "w"))
    h0 = x["initial_state"].reshape(4, 60, 20)
    ours = gdn2_chunk_module.gdn2_chunk_fwd(q, k, b * k, w * v, g, h0, 0.3, chunk_size)
    kdas = kda_chunk_module.chunk_kda_fwd(q, k, w * v, b * k, g, h0, 0.3, chunk_size, terms=gdn2_block_terms)
    for name, a, want in zip(("o", "h_T", "states"), ours, kdas):
        assert rel_err(a, want) < 1e-12, (name, rel_err(a, want))
    with torch.no_grad():
        got64 = ops.chunk_gdn2(**x, output_final_state=True, chunk_size=chunk_size)
        want64 = ops.recurrent_gdn2(**x, output_final_state=True)
        assert_close("fp64 no grad o", got64[0], want64[0], 1e-12)
        assert_close("fp64 no grad h_T", got64[1], want64[1], 1e-12)
        strong = gdn2_inputs(1, 200, 2, 16, 8, seed=5, strong=True)
        truth = ops.recurrent_gdn2(**strong, output_final_state=True)
        x32 = {n: t.float() for n, t in strong.items()}
        got = ops.chunk_gdn2(**x32, output_final_state=True, chunk_size=chunk_size)
        base = ops.recurrent_gdn2(**x32, output_final_state=True)
    for name, a, b_, want in zip(("o", "h_T"), got, base, truth):
        assert torch.isfinite(a).all()
        err, base_err = rel_err(a, want), rel_err(b_, want)
        assert err <= 2 * max(base_err, 1e-7), (name, err, base_err)
