"""(Gated) DeltaProduct (n_h Householder steps per token, one decay per token): every form
against the float64 recurrence, forward and every gradient, on awkward shapes, n_h = 1, 2, 3,
β in [0, 2] (``allow_neg_eigval``), strong decays; the recurrence against a plain loop, the
gated delta rule (n_h = 1) and fla's naive reference; fla's call form; bad inputs; low
precision and torch.compile.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from fastweights import ops

from helpers import assert_all_close, chunk_option, forward_backward, assert_close, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
NAMES = ("q", "k", "v", "g", "beta")


def dp_inputs(B, T, H, K, V, n_h, *, seed=0, dtype=F64, strong=False, initial_state=True, neg=True):
    """Random inputs in fla's layout: unit keys, β in (0, 2) (``neg``) or (0, 1), g per token in
    (−6.9, 0) when ``strong`` (α down to 1e-3 per token), else in about (−1, 0)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    x = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T * n_h, H, K), dim=-1), v=rand(B, T * n_h, H, V),
             g=(-6.9 * torch.rand(B, T, H, generator=gen, dtype=F64)) if strong else F.logsigmoid(rand(B, T, H) + 2),
             beta=(2 if neg else 1) * torch.sigmoid(rand(B, T * n_h, H)))
    x = {n: t.to(dtype) for n, t in x.items()}
    if initial_state:
        x["initial_state"] = rand(B, H, K, V) * 0.5
    return x


def loop_dp(q, k, v, g, beta, n_h, initial_state=None):
    """DeltaProduct written out plainly, one token, head and Householder step at a time (float64)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    h = torch.zeros(B, H, K, V, dtype=F64) if initial_state is None else initial_state.double().clone()
    o = torch.zeros(B, T, H, V, dtype=F64)
    for t in range(T):
        for n in range(B):
            for i in range(H):
                h[n, i] = h[n, i] * torch.exp(g[n, t, i].double())
                for j in range(n_h):
                    s = t * n_h + j
                    kt, bt = k[n, s, i].double(), beta[n, s, i].double()
                    h[n, i] = (torch.eye(K, dtype=F64) - bt * torch.outer(kt, kt)) @ h[n, i] + bt * torch.outer(kt, v[n, s, i].double())
                o[n, t, i] = K ** -0.5 * h[n, i].T @ q[n, t, i].double()
    return o, h


def run(form, x, n_h, options=None, seed=1):
    """:func:`helpers.forward_backward` with ``n_h`` Householder steps and β ∈ [0, 2]: ``(o, h_T, grads)``."""
    return forward_backward(form, x, dict(num_householder=n_h, allow_neg_eigval=True, **(options or {})), seed)




@pytest.mark.parametrize("n_h", [2, 3])
def test_recurrence_equals_the_plain_loop(n_h):
    x = dp_inputs(2, 6, 2, 5, 3, n_h)
    o, h = ops.recurrent_gated_delta_product(**x, num_householder=n_h, allow_neg_eigval=True, output_final_state=True)
    o_ref, h_ref = loop_dp(**x, n_h=n_h)
    assert_close("recurrence o vs loop", o, o_ref, 1e-13)
    assert_close("recurrence h_T vs loop", h, h_ref, 1e-13)


def test_one_householder_step_is_the_gated_delta_rule_and_no_g_no_decay():
    x = dp_inputs(2, 20, 2, 6, 4, 1, neg=False)
    for fn in (ops.recurrent_gated_delta_product, ops.chunk_gated_delta_product):
        o, h = fn(**x, num_householder=1, output_final_state=True, **chunk_option(fn, 8))
        o_ref, h_ref = ops.recurrent_gated_delta_rule(**x, output_final_state=True)
        assert_close(f"{fn.__name__} n_h=1 vs gated delta rule o", o, o_ref, 1e-13)
        assert_close(f"{fn.__name__} n_h=1 vs gated delta rule h_T", h, h_ref, 1e-13)
    x = dp_inputs(1, 5, 1, 4, 3, 2)
    o, _ = ops.chunk_gated_delta_product(**{**x, "g": None}, num_householder=2, allow_neg_eigval=True, chunk_size=4)
    o_ref, _ = loop_dp(**{**x, "g": torch.zeros(1, 5, 1, dtype=F64)}, n_h=2)
    assert_close("g=None: no decay", o, o_ref, 1e-13)


@pytest.mark.slow  # importing fla costs ~10 s
def test_recurrence_equals_fla_naive_reference():
    """fla's naive reference computes in float32 (its initial state is used as given)."""
    naive = pytest.importorskip("fla.ops.gated_delta_product.naive")
    x = dp_inputs(2, 30, 2, 8, 6, 3, seed=2)
    o, h = ops.recurrent_gated_delta_product(**x, num_householder=3, allow_neg_eigval=True, output_final_state=True)
    o_fla, h_fla = naive.naive_recurrent_gated_delta_product(
        *(x[n].float() for n in NAMES), 8 ** -0.5, initial_state=x["initial_state"].float(), output_final_state=True,
        num_householder=3)
    assert_close("recurrent vs fla naive o", o, o_fla.double(), 1e-5)
    assert_close("recurrent vs fla naive h_T", h, h_fla.double(), 1e-5)


FORMS = {
    "parallel-n2": (ops.parallel_gated_delta_product, {}, 2),
    "chunk16-n2": (ops.chunk_gated_delta_product, dict(chunk_size=16), 2),
    "chunk64-n3": (ops.chunk_gated_delta_product, dict(chunk_size=64), 3),
}
SHAPES = {  # B, T, H, K, V
    "T1": (2, 1, 2, 8, 4),
    "T63_K60": (1, 63, 2, 60, 20),
    "T100_KneV": (2, 100, 2, 12, 10),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("form", list(FORMS), ids=list(FORMS))
def test_form_equals_recurrence_forward_and_gradients(form, shape):
    fn, options, n_h = FORMS[form]
    x = dp_inputs(*SHAPES[shape], n_h, seed=3)
    assert_all_close(f"{form} {shape}", run(fn, x, n_h, options), run(ops.recurrent_gated_delta_product, x, n_h),
                     1e-12, 1e-11)


def test_chunk_form_at_T_1000():
    x = dp_inputs(1, 1000, 1, 16, 12, 2, seed=4)
    assert_all_close("chunk T=1000", run(ops.chunk_gated_delta_product, x, 2, dict(chunk_size=32)),
                     run(ops.recurrent_gated_delta_product, x, 2), 1e-12, 1e-11)


def test_strong_decays_fp64_equal_and_fp32_within_2x():
    """α down to 1e-3 per token: float64 equal to the recurrence; fp32 finite and within 2x (3x
    for gradients) of the fp32 recurrence's error against float64."""
    x = dp_inputs(1, 150, 2, 16, 8, 2, seed=5, strong=True)
    truth = run(ops.recurrent_gated_delta_product, x, 2)
    assert_all_close("strong fp64", run(ops.chunk_gated_delta_product, x, 2, dict(chunk_size=64)), truth, 1e-12, 1e-11)
    x32 = {n: t.float() for n, t in x.items()}
    got = run(ops.chunk_gated_delta_product, x32, 2, dict(chunk_size=64))
    base = run(ops.recurrent_gated_delta_product, x32, 2)
    assert all(torch.isfinite(t).all() for t in (got[0], got[1], *got[2].values()))
    pairs = [("o", got[0], base[0], truth[0], 2), ("h_T", got[1], base[1], truth[1], 2)]
    pairs += [(f"d{n}", got[2][n], base[2][n], truth[2][n], 3) for n in truth[2]]
    for name, a, b, want, factor in pairs:
        err, base_err = rel_err(a, want), rel_err(b, want)
        print(f"fp32 {name}: chunk {err:.2e}, recurrent {base_err:.2e}")
        assert err <= factor * base_err, (name, err, base_err)


@pytest.mark.parametrize("form", ["parallel-n2", "chunk16-n2"])
def test_varlen_equals_each_sequence_alone(form):
    """Uneven packed lengths (5, 32, 63), each with its own initial state; gradients too."""
    fn, options, n_h = FORMS[form]
    x = dp_inputs(1, 100, 2, 12, 6, n_h, seed=7, initial_state=False)
    x["initial_state"] = torch.randn(3, 2, 12, 6, dtype=F64)
    cu = torch.tensor([0, 5, 37, 100])
    want = run(ops.recurrent_gated_delta_product, x, n_h, dict(cu_seqlens=cu))
    assert_all_close(f"{form} packed", run(fn, x, n_h, dict(options, cu_seqlens=cu)), want, 1e-12, 1e-11)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = dict(q=x["q"][:, a:b], g=x["g"][:, a:b], k=x["k"][:, a * n_h:b * n_h], v=x["v"][:, a * n_h:b * n_h],
                     beta=x["beta"][:, a * n_h:b * n_h])
        o_i, h_i = ops.recurrent_gated_delta_product(**alone, num_householder=n_h, allow_neg_eigval=True,
                                                     initial_state=x["initial_state"][i:i + 1], output_final_state=True)
        assert_close(f"sequence {i} alone", want[0][:, a:b], o_i, 1e-13)
        assert_close(f"sequence {i} state", want[1][i:i + 1], h_i, 1e-13)


def test_gradcheck_chunk_and_parallel():
    x = dp_inputs(1, 5, 1, 3, 2, 2, seed=9)
    names = list(x)
    for fn, options in ((ops.chunk_gated_delta_product, dict(chunk_size=2)), (ops.parallel_gated_delta_product, {})):
        def f(*tensors):
            return fn(**dict(zip(names, tensors)), num_householder=2, allow_neg_eigval=True, output_final_state=True,
                      **options)

        leaves = [x[n].clone().requires_grad_(True) for n in names]
        assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8)


def test_step_equals_the_recurrence():
    x = dp_inputs(2, 7, 2, 5, 4, 3, seed=10)
    o_ref, h_ref = ops.recurrent_gated_delta_product(**x, num_householder=3, allow_neg_eigval=True,
                                                     output_final_state=True)
    h = x["initial_state"]
    for t in range(7):
        sub = slice(3 * t, 3 * t + 3)
        o_t, h = ops.gated_delta_product_step(x["q"][:, t], x["k"][:, sub].transpose(1, 2), x["v"][:, sub].transpose(1, 2),
                                              x["beta"][:, sub].transpose(1, 2), x["g"][:, t], h, 5 ** -0.5)
        assert_close(f"step {t}", o_t, o_ref[:, t], 1e-14)
    assert_close("step h_T", h, h_ref, 1e-14)


def test_fla_positional_order_and_l2_norm():
    x = dp_inputs(1, 12, 2, 6, 5, 2, seed=11, neg=False)
    o, h = ops.chunk_gated_delta_product(x["q"], x["k"], x["v"], x["g"], x["beta"], 2, None, x["initial_state"], True,
                                         True, None, None, chunk_size=4)

    def l2(t):
        return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)

    o_ref, h_ref = loop_dp(l2(x["q"]), l2(x["k"]), x["v"], x["g"], x["beta"], 2, x["initial_state"])
    assert_close("fla positional order + l2 norm o", o, o_ref, 1e-13)
    assert_close("fla positional order + l2 norm h_T", h, h_ref, 1e-13)


DP_FORMS = [ops.recurrent_gated_delta_product, ops.parallel_gated_delta_product, ops.chunk_gated_delta_product]


@pytest.mark.parametrize("fn", DP_FORMS, ids=lambda f: f.__name__)
def test_bad_inputs_are_refused_naming_the_argument(fn):
    x = dp_inputs(1, 6, 2, 4, 3, 2, initial_state=False, neg=False)
    name = fn.__name__
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=rf"{name}: `num_householder` must be an int >= 1"):
            fn(**x, num_householder=bad)
    with pytest.raises(ValueError, match=rf"{name}: `k` must have shape \[B, T·n_h, H, K\] = \[1, 18, 2, 4\] "
                                         r"\(num_householder=3 .*got \[1, 12, 2, 4\]"):
        fn(**x, num_householder=3)
    with pytest.raises(ValueError, match=rf"{name}: `beta` must have shape \[B, T·n_h, H\] = \[1, 12, 2\].*got \[1, 6, 2\]"):
        fn(**{**x, "beta": x["beta"][:, :6]}, num_householder=2)
    with pytest.raises(ValueError, match=rf"{name}: `beta` must lie in \[0, 1\] \(\[0, 2\] with allow_neg_eigval=True\), "
                                         r"got values up to 1.5"):
        fn(**{**x, "beta": x["beta"].clone().fill_(1.5)}, num_householder=2)
    with pytest.raises(ValueError, match=rf"{name}: `beta` must lie in \[0, 2\] \(allow_neg_eigval=True\), got values up to 2.5"):
        fn(**{**x, "beta": x["beta"].clone().fill_(2.5)}, num_householder=2, allow_neg_eigval=True)
    with pytest.raises(ValueError, match=rf"{name}: `g` \(the log decay\) must be <= 0"):
        fn(**{**x, "g": x["g"] + 2}, num_householder=2)
    with pytest.raises(ValueError, match=rf"{name}: `cp_context`"):
        fn(**x, num_householder=2, cp_context=object())
    with pytest.raises(TypeError, match=rf"{name}\(\) got an unexpected keyword argument `num_housholder`; did you mean"):
        fn(**x, num_housholder=2)
    with pytest.raises(TypeError, match=rf"{name}: `v` must have the dtype of `q`"):
        fn(**{**x, "v": x["v"].float()}, num_householder=2)


@pytest.mark.parametrize("fn", [ops.chunk_gated_delta_product, ops.parallel_gated_delta_product], ids=lambda f: f.__name__)
def test_bf16_within_2x_of_the_recurrent_form(fn):
    """bf16 inputs, fp32 compute: error vs float64 at most 2x (3x for gradients) the recurrent form's."""
    x = dp_inputs(1, 60, 2, 16, 16, 2, seed=19, initial_state=False)
    xb = {n: t.to(torch.bfloat16) for n, t in x.items()}
    truth = run(ops.recurrent_gated_delta_product, {n: t.double() for n, t in xb.items()}, 2)
    base = run(ops.recurrent_gated_delta_product, xb, 2)
    got = run(fn, xb, 2, chunk_option(fn, 16))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    pairs = [("o", got[0], base[0], truth[0], 2), ("h_T", got[1], base[1], truth[1], 2)]
    pairs += [(f"d{n}", got[2][n], base[2][n], truth[2][n], 3) for n in truth[2]]
    for name, a, b, want, factor in pairs:
        err, base_err = rel_err(a, want), rel_err(b, want)
        print(f"{fn.__name__} bf16 {name}: {err:.2e} (recurrent {base_err:.2e})")
        assert err <= factor * base_err, (name, err, base_err)


@pytest.mark.slow  # ~5 s; the LM test of tests/layers/test_gdn2_deltaproduct_layers.py checks no graph break
def test_chunk_compiles_without_graph_breaks_and_equals_eager():
    torch._dynamo.reset()
    x = dp_inputs(2, 9, 2, 4, 3, 2, seed=23)

    def call(**inputs):
        return ops.chunk_gated_delta_product(**inputs, chunk_size=4)

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    o_c, h_c, g_c = run(compiled, x, 2)
    o_e, h_e, g_e = run(call, x, 2)
    errors = {"o": rel_err(o_c, o_e), "h_T": rel_err(h_c, h_e), **{f"d{n}": rel_err(g_c[n], g_e[n]) for n in g_e}}
    assert all(e <= 1e-12 for e in errors.values()), errors
    torch._dynamo.reset()
