"""fla drop-in: fla 0.6.0's options and names on our ops, judged by fla's own references.

The oracles are fla's pure-torch references (``fla.ops.*.naive``, ``naive_gdn_gate``)
and transformers' pure-torch l2norm; they compute in fp32, so our ops run in float64
and the tolerance is fp32's (outputs are O(1)). Without fla these tests skip.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.ops import _fla_compat
from helpers import chunk_option

pytest.importorskip("transformers", reason="transformers not installed (its l2norm is one of the oracles)")
fla_gdr_naive = pytest.importorskip("fla.ops.gated_delta_rule.naive", reason="flash-linear-attention not installed (test-only oracle)")
from fla.ops.delta_rule.naive import delta_rule_recurrence as fla_delta_naive
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.linear_attn.naive import naive_recurrent_linear_attn

fla_gated_naive = fla_gdr_naive.naive_recurrent_gated_delta_rule
TOL = 2e-5  # fp32 references against our float64

GATED_FORMS = [
    pytest.param(ops.recurrent_gated_delta_rule, id="recurrent"),
    pytest.param(ops.parallel_gated_delta_rule, id="parallel"),
    pytest.param(ops.chunk_gated_delta_rule, id="chunk"),
]
DELTA_FORMS = [
    pytest.param(ops.recurrent_delta_rule, id="recurrent"),
    pytest.param(ops.parallel_delta_rule, id="parallel"),
    pytest.param(ops.chunk_delta_rule, id="chunk"),
]


def fla_l2norm(x):
    """fla's / transformers' l2 normalization, written out: x · rsqrt(Σx² + 1e-6)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm

    return l2norm(x, dim=-1, eps=1e-6)


def inputs(B=2, T=37, H=2, HV=4, K=12, V=10, seed=0, dtype=torch.float64):
    """Raw (pre-activation) inputs of a gated op with grouped value heads."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    return dict(
        q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), b=r(B, T, HV), a=r(B, T, HV),
        A_log=torch.log(torch.empty(HV, dtype=dtype).uniform_(1, 16, generator=g)),
        dt_bias=r(HV) * 0.5, h0=r(B, HV, K, V) * 0.1,
    )


def expand(x, r):
    return x.repeat_interleave(r, dim=2)


def report(name, err):
    print(f"{name}: max |ours - fla reference| = {err:.2e}")
    assert err < TOL, f"{name}: {err:.2e} >= {TOL}"


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("form", GATED_FORMS)
def test_gated_all_fla_options_match_naive(form):
    """use_qk_l2norm_in_kernel + use_beta_sigmoid_in_kernel + use_gate_in_kernel (A_log, dt_bias)
    + grouped value heads (HV = 2H) + initial state, against fla's naive recurrence."""
    x = inputs()
    r = x["v"].shape[2] // x["q"].shape[2]
    o, h = form(
        x["q"], x["k"], x["v"], x["a"], x["b"], initial_state=x["h0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
        A_log=x["A_log"], dt_bias=x["dt_bias"], **chunk_option(form, 16),
    )
    g = naive_gdn_gate(x["a"], x["A_log"], x["dt_bias"])
    o_ref, h_ref = fla_gated_naive(
        expand(fla_l2norm(x["q"].float()), r), expand(fla_l2norm(x["k"].float()), r), x["v"].float(),
        torch.sigmoid(x["b"].float()), g, initial_state=x["h0"].float(), output_final_state=True,
    )
    assert o.shape == x["v"].shape and h.shape == x["h0"].shape
    report(f"{form.__name__} output", max_err(o, o_ref))
    report(f"{form.__name__} state", max_err(h, h_ref))


@pytest.mark.parametrize("form", GATED_FORMS)
def test_allow_neg_eigval_doubles_the_sigmoid(form):
    x = inputs(seed=1, HV=2)
    o, _ = form(
        x["q"], x["k"], x["v"], x["a"] * 0 - 0.1, x["b"], use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, **chunk_option(form, 16),
    )
    o_ref, _ = fla_gated_naive(
        fla_l2norm(x["q"].float()), fla_l2norm(x["k"].float()), x["v"].float(),
        2 * torch.sigmoid(x["b"].float()), torch.full_like(x["a"], -0.1).float(),
    )
    report(f"{form.__name__} allow_neg_eigval", max_err(o, o_ref))
    # Without the sigmoid, β ∈ [0, 2] is taken as given (fla raises here; see _fla_compat).
    beta2 = 2 * torch.sigmoid(x["b"])
    o2, _ = form(x["q"], x["k"], x["v"], x["a"] * 0 - 0.1, beta2, use_qk_l2norm_in_kernel=True,
                 allow_neg_eigval=True, **chunk_option(form, 16))
    report(f"{form.__name__} allow_neg_eigval, beta given", max_err(o2, o_ref))


@pytest.mark.parametrize("form", GATED_FORMS)
def test_gated_beta_none_and_g_none_are_fla_defaults(form):
    x = inputs(seed=2, HV=2)
    q, k = fla_l2norm(x["q"]), fla_l2norm(x["k"])
    o, _ = form(q, k, x["v"], None, None, **chunk_option(form, 16))
    ones, zeros = torch.ones_like(x["b"]).float(), torch.zeros_like(x["a"]).float()
    o_ref, _ = fla_gated_naive(q.float(), k.float(), x["v"].float(), ones, zeros)
    report(f"{form.__name__} beta=None, g=None", max_err(o, o_ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("form", GATED_FORMS)
def test_low_precision_initial_state_is_cast_up(form, dtype):
    x = inputs(seed=3, HV=2)
    q, k = fla_l2norm(x["q"]).float(), fla_l2norm(x["k"]).float()
    g = -F.softplus(x["a"]).float()
    beta = torch.sigmoid(x["b"]).float()
    h0 = x["h0"].to(dtype)
    o, h = form(q, k, x["v"].float(), g, beta, initial_state=h0, output_final_state=True, **chunk_option(form, 16))
    assert h.dtype == torch.float32
    o_ref, h_ref = fla_gated_naive(q, k, x["v"].float(), beta, g, initial_state=h0.float(), output_final_state=True)
    report(f"{form.__name__} {dtype} initial_state", max(max_err(o, o_ref), max_err(h, h_ref)))


@pytest.mark.parametrize("form", GATED_FORMS)
def test_cu_seqlens_cpu_alone_packs_the_sequences(form):
    """``cu_seqlens_cpu`` without ``cu_seqlens``: each packed sequence equals fla's naive run alone."""
    x = inputs(B=1, T=41, seed=4, HV=2)
    q, k = fla_l2norm(x["q"]), fla_l2norm(x["k"])
    g, beta = -F.softplus(x["a"]), torch.sigmoid(x["b"])
    bounds = [0, 9, 30, 41]
    o, h = form(q, k, x["v"], g, beta, output_final_state=True, **chunk_option(form, 16),
                cu_seqlens_cpu=torch.tensor(bounds))
    worst = 0.0
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        o_ref, h_ref = fla_gated_naive(*(t[:, s:e].float() for t in (q, k, x["v"], beta, g)), output_final_state=True)
        worst = max(worst, max_err(o[:, s:e], o_ref), max_err(h[i:i + 1], h_ref))
    report(f"{form.__name__} cu_seqlens_cpu", worst)


@pytest.mark.parametrize("form", GATED_FORMS)
def test_gradients_through_fla_options(form):
    """dq, dk, dv, d(beta logits), d(gate input), dA_log, ddt_bias, dh0: ours (float64) against
    autograd through fla's naive recurrence and gate (fp32)."""
    x = inputs(B=1, T=21, HV=4, seed=5)
    names = ["q", "k", "v", "b", "a", "A_log", "dt_bias", "h0"]
    ours = {n: x[n].clone().requires_grad_(True) for n in names}
    ref = {n: x[n].float().clone().requires_grad_(True) for n in names}
    do = torch.randn(x["v"].shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    o, h = form(ours["q"], ours["k"], ours["v"], ours["a"], ours["b"], initial_state=ours["h0"],
                output_final_state=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                use_gate_in_kernel=True, A_log=ours["A_log"], dt_bias=ours["dt_bias"], **chunk_option(form, 8))
    ((o * do).sum() + h.sum()).backward()
    o_ref, h_ref = fla_gated_naive(
        expand(fla_l2norm(ref["q"]), 2), expand(fla_l2norm(ref["k"]), 2), ref["v"], torch.sigmoid(ref["b"]),
        naive_gdn_gate(ref["a"], ref["A_log"], ref["dt_bias"]), initial_state=ref["h0"], output_final_state=True,
    )
    ((o_ref * do.float()).sum() + h_ref.sum()).backward()
    worst = max(max_err(ours[n].grad, ref[n].grad) / (1 + ref[n].grad.abs().max().item()) for n in names)
    report(f"{form.__name__} gradients (relative to 1 + max|grad|)", worst)


@pytest.mark.parametrize("form", DELTA_FORMS)
def test_delta_rule_options_match_naive(form):
    """use_qk_l2norm_in_kernel, beta=None, bf16 initial state on the delta rule."""
    x = inputs(seed=6, HV=2)
    q, k, v = x["q"], x["k"], x["v"]
    h0 = x["h0"].to(torch.bfloat16)
    beta = torch.sigmoid(x["b"])
    for b in (beta, None):
        o, h = form(q.float(), k.float(), v.float(), b if b is None else b.float(), initial_state=h0,
                    output_final_state=True, use_qk_l2norm_in_kernel=True, **chunk_option(form, 16))
        head_first = lambda t: t.float().transpose(1, 2)
        o_ref, h_ref = fla_delta_naive(
            head_first(fla_l2norm(q)), head_first(fla_l2norm(k)), head_first(v),
            head_first(torch.ones_like(beta) if b is None else b), initial_state=h0.float(),
        )
        report(f"{form.__name__} beta={'None' if b is None else 'given'}",
               max(max_err(o, o_ref.transpose(1, 2)), max_err(h, h_ref)))


def test_l2norm_is_fla_formula_not_f_normalize():
    """At small norms x·rsqrt(Σx²+1e-6) and F.normalize differ by ~1e-3; we give fla's."""
    x = torch.randn(3, 5, 2, 8, dtype=torch.float64) * 1e-3
    ours = ops.normalize_qk(x, "l2")
    err_fla = max_err(ours, fla_l2norm(x))
    err_f = max_err(ours, F.normalize(x, dim=-1))
    print(f"small-norm l2: vs fla {err_fla:.1e}, vs F.normalize {err_f:.1e}")
    assert err_fla < 1e-15 and err_f > 1e-4


def test_fused_recurrent_aliases_match_naive():
    x = inputs(seed=7, HV=2)
    q, k = fla_l2norm(x["q"]), fla_l2norm(x["k"])
    beta, g = torch.sigmoid(x["b"]), -F.softplus(x["a"])
    o, h = ops.fused_recurrent_gated_delta_rule(q, k, x["v"], g, beta=beta, initial_state=x["h0"],
                                                output_final_state=True)
    o_ref, h_ref = fla_gated_naive(*(t.float() for t in (q, k, x["v"], beta, g)), initial_state=x["h0"].float(),
                                   output_final_state=True)
    report("fused_recurrent_gated_delta_rule", max(max_err(o, o_ref), max_err(h, h_ref)))
    o, h = ops.fused_recurrent_delta_rule(q, k, x["v"], beta, None, x["h0"], True)  # fla's positional order
    o_ref, h_ref = fla_delta_naive(*(t.float().transpose(1, 2) for t in (q, k, x["v"], beta)), initial_state=x["h0"].float())
    report("fused_recurrent_delta_rule", max(max_err(o, o_ref.transpose(1, 2)), max_err(h, h_ref)))
    for bad in (dict(gk=torch.zeros(1)), dict(gv=torch.zeros(1))):
        with pytest.raises(ValueError, match=f"`{next(iter(bad))}`"):
            ops.fused_recurrent_gated_delta_rule(q, k, x["v"], g, beta=beta, **bad)


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("alias", [ops.fused_recurrent_linear_attn, ops.fused_chunk_linear_attn], ids=["recurrent", "chunk"])
def test_linear_attn_aliases_match_naive(alias, normalize):
    """fla's linear attention: positional (q, k, v, scale, initial_state, output_final_state),
    ε = 1e-10, and with ``normalize`` the state tuple (S, z [N, 1, H, K])."""
    g = torch.Generator().manual_seed(8)
    B, T, H, K, V = 2, 70, 2, 8, 6
    q, k = (F.elu(torch.randn(B, T, H, K, generator=g, dtype=torch.float64)) + 1 for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    s0 = torch.rand(B, H, K, V, generator=g, dtype=torch.float64)
    z0 = torch.rand(B, 1, H, K, generator=g, dtype=torch.float64)
    init = (s0, z0) if normalize else s0
    o, h = alias(q, k, v, None, init, True, normalize=normalize)
    init_ref = (s0.float(), z0.float()) if normalize else s0.float()
    o_ref, h_ref = naive_recurrent_linear_attn(q.float(), k.float(), v.float(), initial_state=init_ref,
                                               output_final_state=True, normalize=normalize)
    if normalize:
        assert isinstance(h, tuple) and h[1].shape == (B, 1, H, K)
        err = max(max_err(o, o_ref), max_err(h[0], h_ref[0]), max_err(h[1], h_ref[1]))
    else:
        err = max(max_err(o, o_ref), max_err(h, h_ref))
    report(f"{alias.__name__} normalize={normalize}", err / (1 + o_ref.abs().max().item()))
    with pytest.raises(ValueError, match="`reverse`"):
        ops.fused_recurrent_linear_attn(q, k, v, reverse=True)


def test_kwargs_pass_through_silent_unknown_refused_raise():
    x = inputs(B=1, T=5, HV=2, seed=10)
    args = (x["q"], x["k"], x["v"], -F.softplus(x["a"]), torch.sigmoid(x["b"]))
    _fla_compat._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ops.chunk_gated_delta_rule(*args, use_cache=True, output_router_logits=False, position_ids=None,
                                   cache_position=None, chunk_indices=None, cu_seq_lens_k=None)
    assert not caught, [str(w.message) for w in caught]
    with pytest.raises(TypeError, match="`some_future_option`"):  # an unknown name could change the result
        ops.chunk_gated_delta_rule(*args, some_future_option=1)
    for name, value in (("gk", torch.zeros(1)), ("head_first", True), ("cp_context", object())):
        with pytest.raises(ValueError, match=f"chunk_gated_delta_rule: `{name}`"):
            ops.chunk_gated_delta_rule(*args, **{name: value})
    with pytest.raises(ValueError, match="not a multiple"):
        ops.chunk_gated_delta_rule(x["q"], x["k"], torch.randn(1, 5, 3, 10, dtype=torch.float64), *args[3:4],
                                   torch.rand(1, 5, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="`A_log`"):
        ops.chunk_gated_delta_rule(*args, use_gate_in_kernel=True)


@pytest.mark.parametrize("form", GATED_FORMS)
def test_state_v_first_transposes_the_states(form):
    """fla's GatedDeltaNet layer passes ``state_v_first=True``: states in and out are [N, HV, V, K]."""
    x = inputs(seed=11, HV=2)
    q, k = fla_l2norm(x["q"]), fla_l2norm(x["k"])
    g, beta = -F.softplus(x["a"]), torch.sigmoid(x["b"])
    o, h = form(q, k, x["v"], g, beta, initial_state=x["h0"].transpose(-1, -2).contiguous(),
                output_final_state=True, state_v_first=True, **chunk_option(form, 16))
    o_ref, h_ref = fla_gated_naive(*(t.float() for t in (q, k, x["v"], beta, g)), initial_state=x["h0"].float(),
                                   output_final_state=True)
    assert h.shape == x["h0"].transpose(-1, -2).shape
    report(f"{form.__name__} state_v_first", max(max_err(o, o_ref), max_err(h.transpose(-1, -2), h_ref)))
    with pytest.raises(ValueError, match="chunk_delta_rule: `state_v_first`"):
        ops.chunk_delta_rule(q, k, x["v"], beta, state_v_first=True)
