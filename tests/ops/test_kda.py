"""Kimi Delta Attention (the per-key-channel gated delta rule): every form against the float64
recurrence, forward and every gradient (dgk included), on awkward shapes, with strong decays;
fla's call forms and options; ``gk``/``gv`` in ``fused_recurrent_gated_delta_rule``; bad
inputs; low precision, autocast and torch.compile.

The recurrence itself is checked against an independent loop written here (and, when fla
is installed, against fla's ``naive_recurrent_kda``): decay first, then the delta write on
the decayed state.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F

from fastweights import ops

from helpers import assert_close, chunk_option, forward_backward, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def kda_inputs(B, T, H, K, V, *, seed=0, dtype=F64, strong=False, initial_state=True, HV=None):
    """Random KDA inputs: unit keys, β in (0, 1), gk in (−6.9, 0) per channel when ``strong``
    (α down to 1e-3 per token), else in about (−1, 0)."""
    gen = torch.Generator().manual_seed(seed)
    HV = HV or H

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=F64)

    x = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, HV, V),
             g=(-6.9 * torch.rand(B, T, HV, K, generator=gen, dtype=F64)) if strong else F.logsigmoid(rand(B, T, HV, K) + 2),
             beta=torch.sigmoid(rand(B, T, HV)))
    x = {n: t.to(dtype) for n, t in x.items()}
    if initial_state:
        x["initial_state"] = rand(B, HV, K, V) * 0.5
    return x


def loop_kda(q, k, v, g, beta, initial_state=None, gv=None, scale=None):
    """KDA written out plainly, one token and one head at a time (float64)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    h = torch.zeros(B, H, K, V, dtype=F64) if initial_state is None else initial_state.double().clone()
    o = torch.zeros(B, T, H, V, dtype=F64)
    for t in range(T):
        for b in range(B):
            for i in range(H):
                hi = h[b, i] * torch.exp(g[b, t, i].double())[:, None]
                if gv is not None:
                    hi = hi * torch.exp(gv[b, t, i].double())[None, :]
                kt = k[b, t, i].double()
                hi = hi + beta[b, t, i].double() * torch.outer(kt, v[b, t, i].double() - hi.T @ kt)
                h[b, i] = hi
                o[b, t, i] = scale * hi.T @ q[b, t, i].double()
    return o, h


FORMS = {
    "parallel": (ops.parallel_kda, {}),
    "chunk16": (ops.chunk_kda, dict(chunk_size=16)),
    "chunk64": (ops.chunk_kda, dict(chunk_size=64)),
}
SHAPES = {  # B, T, H, K, V
    "T1": (2, 1, 2, 8, 4),
    "T63_K60": (1, 63, 2, 60, 20),
    "T100_KneV": (2, 100, 2, 12, 10),
}


run = forward_backward  # (o, h_T, grads) of (o·do).sum() + (h_T·dh).sum()


def test_recurrence_is_decay_then_delta_write():
    """The reference against the plain loop."""
    x = kda_inputs(2, 9, 2, 5, 3)
    o, h = ops.recurrent_kda(**x, output_final_state=True)
    o_ref, h_ref = loop_kda(**x)
    assert_close("recurrent_kda o vs loop", o, o_ref, 1e-13)
    assert_close("recurrent_kda h_T vs loop", h, h_ref, 1e-13)


@pytest.mark.slow  # importing fla costs ~10 s
def test_recurrence_equals_fla_naive_recurrent_kda():
    naive = pytest.importorskip("fla.ops.kda.naive")
    x = kda_inputs(2, 9, 2, 5, 3)
    o, h = ops.recurrent_kda(**x, output_final_state=True)
    o_fla, h_fla = naive.naive_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                             initial_state=x["initial_state"], output_final_state=True)
    assert_close("recurrent_kda vs fla naive_recurrent_kda (fp32 inside)", o, o_fla.double(), 1e-5)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("form", list(FORMS), ids=list(FORMS))
def test_form_equals_recurrence_forward_and_gradients(form, shape):
    x = kda_inputs(*SHAPES[shape], seed=3)
    fn, options = FORMS[form]
    o_ref, h_ref, g_ref = run(ops.recurrent_kda, x)
    o, h, grads = run(fn, x, options)
    assert_close(f"{form} {shape} o", o, o_ref, 1e-12)
    assert_close(f"{form} {shape} h_T", h, h_ref, 1e-12)
    for name in g_ref:
        assert_close(f"{form} {shape} d{name}", grads[name], g_ref[name], 1e-11)


@pytest.mark.parametrize("chunk_size", [64, 128])
def test_strong_decays_do_not_overflow(chunk_size):
    """α down to 1e-3 per token and channel: e^{−b} would reach e^{6.9·C}, far beyond fp32's
    (and for C = 128 fp64's) range; the relative form never takes it. float64: equal to the
    recurrence; fp32: finite and within 2x (3x for gradients) of the fp32 recurrence's error."""
    x = kda_inputs(1, 200, 2, 16, 8, seed=5, strong=True)
    o_ref, h_ref, g_ref = run(ops.recurrent_kda, x)
    o, h, grads = run(ops.chunk_kda, x, dict(chunk_size=chunk_size))
    assert_close(f"C={chunk_size} fp64 o", o, o_ref, 1e-12)
    for name in g_ref:
        assert_close(f"C={chunk_size} fp64 d{name}", grads[name], g_ref[name], 1e-11)
    x32 = {n: t.float() for n, t in x.items()}
    o32, h32, g32 = run(ops.chunk_kda, x32, dict(chunk_size=chunk_size))
    r32, rh32, rg32 = run(ops.recurrent_kda, x32)
    assert all(torch.isfinite(t).all() for t in (o32, h32, *g32.values()))
    for name, got, base, want, factor in [("o", o32, r32, o_ref, 2), ("h_T", h32, rh32, h_ref, 2)] + [
            (f"d{n}", g32[n], rg32[n], g_ref[n], 3) for n in g_ref]:
        err, base_err = rel_err(got, want), rel_err(base, want)
        print(f"C={chunk_size} fp32 {name}: chunk {err:.2e}, recurrent {base_err:.2e}")
        assert err <= factor * base_err, (name, err, base_err)


@pytest.mark.parametrize("form", ["parallel", "chunk16"])
def test_varlen_equals_each_sequence_alone(form):
    """Uneven packed lengths (5, 32, 63), each with its own initial state; gradients too."""
    fn, options = FORMS[form]
    lengths = [5, 32, 63]
    x = kda_inputs(1, sum(lengths), 2, 12, 6, seed=7, initial_state=False)
    x["initial_state"] = torch.randn(3, 2, 12, 6, dtype=F64)
    cu = torch.tensor([0, 5, 37, 100])
    o, h, grads = run(fn, x, dict(options, cu_seqlens=cu))
    o_ref, h_ref, g_ref = run(ops.recurrent_kda, x, dict(cu_seqlens=cu))
    assert_close(f"{form} packed o", o, o_ref, 1e-12)
    assert_close(f"{form} packed h_T", h, h_ref, 1e-12)
    for name in g_ref:
        assert_close(f"{form} packed d{name}", grads[name], g_ref[name], 1e-11)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):  # the reference, sequence by sequence
        alone = {n: t[:, a:b] for n, t in x.items() if n != "initial_state"}
        o_i, h_i = ops.recurrent_kda(**alone, initial_state=x["initial_state"][i:i + 1], output_final_state=True)
        assert_close(f"sequence {i} alone", o_ref[:, a:b], o_i, 1e-13)
        assert_close(f"sequence {i} state", h_ref[i:i + 1], h_i, 1e-13)


def test_gradcheck_chunk_and_parallel():
    x = kda_inputs(1, 6, 1, 3, 2, seed=9)
    names = list(x)
    for fn, options in ((ops.chunk_kda, dict(chunk_size=4)), (ops.parallel_kda, {})):
        def f(*tensors):
            o, h = fn(**dict(zip(names, tensors)), output_final_state=True, **options)
            return o, h

        leaves = [x[n].clone().requires_grad_(True) for n in names]
        assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8)


def test_state_split_mid_chunk_equals_the_whole():
    x = kda_inputs(2, 50, 2, 8, 8, seed=11)
    o, h = ops.chunk_kda(**x, output_final_state=True, chunk_size=16)
    first = {n: (t[:, :21] if n != "initial_state" else t) for n, t in x.items()}
    o1, h1 = ops.chunk_kda(**first, output_final_state=True, chunk_size=16)
    rest = {n: t[:, 21:] for n, t in x.items() if n != "initial_state"}
    o2, h2 = ops.chunk_kda(**rest, initial_state=h1, output_final_state=True, chunk_size=16)
    assert_close("split o", torch.cat([o1, o2], 1), o, 1e-13)
    assert_close("split h_T", h2, h, 1e-13)


def test_fla_options_gate_beta_norm_grouped_heads_and_state_layout():
    """fla's in-kernel gate (softplus and lower_bound formulas), β sigmoid, l2 norm, grouped value
    heads (HV = 2H) and state_v_first, on all three forms, against the plain inputs."""
    gen = torch.Generator().manual_seed(13)
    B, T, H, HV, K, V = 1, 20, 2, 4, 6, 5
    q, k = torch.randn(B, T, H, K, dtype=F64, generator=gen), torch.randn(B, T, H, K, dtype=F64, generator=gen)
    v, raw = torch.randn(B, T, HV, V, dtype=F64, generator=gen), torch.randn(B, T, HV, K, dtype=F64, generator=gen)
    b_logits, h0 = torch.randn(B, T, HV, dtype=F64, generator=gen), torch.randn(B, HV, V, K, dtype=F64, generator=gen)
    A_log, dt_bias = torch.randn(HV, dtype=F64, generator=gen), torch.randn(HV * K, dtype=F64, generator=gen)
    x_dt = raw + dt_bias.view(HV, K)
    plain = dict(q=F.normalize(q, dim=-1, eps=0).repeat_interleave(2, 2), v=v, beta=torch.sigmoid(b_logits),
                 initial_state=h0.transpose(-1, -2))
    plain["k"] = (k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(2, 2)
    plain["q"] = (q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(2, 2)
    gates = {None: -A_log.exp().view(HV, 1) * F.softplus(x_dt), -5.0: -5.0 * torch.sigmoid(A_log.exp().view(HV, 1) * x_dt)}
    for lower_bound, gate in gates.items():
        o_ref, h_ref = loop_kda(plain["q"], plain["k"], v, gate, plain["beta"], plain["initial_state"])
        for fn in (ops.recurrent_kda, ops.parallel_kda, ops.chunk_kda):
            o, h = fn(q, k, v, raw, b_logits, None, h0, True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, A_log=A_log, dt_bias=dt_bias,
                      state_v_first=True, **chunk_option(fn, 8), safe_gate=True, disable_recompute=True)
            assert_close(f"{fn.__name__} fla options (lower_bound={lower_bound}) o", o, o_ref, 1e-12)
            assert_close(f"{fn.__name__} fla options h_T [N, HV, V, K]", h.transpose(-1, -2), h_ref, 1e-12)
    assert_close("kda_gate", ops.kda_gate(raw, A_log, dt_bias), gates[None], 1e-15)


@pytest.mark.slow  # importing fla costs ~10 s
def test_kda_gate_equals_fla_naive_kda_gate():
    """fla's reference gates compute in float32 whatever the input dtype (``g.float()``), so ours,
    in float64 for float64 inputs, agrees with them to float32 rounding (measured 4.5e-8)."""
    fla_gate = pytest.importorskip("fla.ops.kda.gate")
    raw, A_log, dt_bias = torch.randn(2, 5, 3, 4, dtype=F64), torch.randn(3, dtype=F64), torch.randn(12, dtype=F64)
    assert_close("kda_gate vs fla naive_kda_gate", ops.kda_gate(raw, A_log, dt_bias),
                 fla_gate.naive_kda_gate(raw, A_log, dt_bias, output_dtype=F64), 1e-6)
    assert_close("lower_bound gate vs fla", ops.kda_gate(raw, A_log, dt_bias, lower_bound=-5.0),
                 fla_gate.naive_kda_lowerbound_gate(raw, A_log, dt_bias, lower_bound=-5.0, output_dtype=F64), 1e-6)
    # in float32, fla's own precision, the two are the same computation
    raw32, A32, dt32 = raw.float(), A_log.float(), dt_bias.float()
    assert_close("kda_gate vs fla naive_kda_gate, float32", ops.kda_gate(raw32, A32, dt32),
                 fla_gate.naive_kda_gate(raw32, A32, dt32), 1e-6)


def test_fused_recurrent_kda_alias_has_fla_positional_order():
    x = kda_inputs(1, 12, 2, 4, 3, seed=15)
    A_log, dt_bias = torch.randn(2, dtype=F64), torch.randn(8, dtype=F64)
    o, h = ops.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log, dt_bias, None,
                                   x["initial_state"], True, False, True)
    o_ref, h_ref = ops.recurrent_kda(**x, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, output_final_state=True)
    assert torch.equal(o, o_ref) and torch.equal(h, h_ref)


def test_gk_and_gv_in_fused_recurrent_gated_delta_rule():
    """fla's per-key and per-value decays: h ← diag(e^gk) h diag(e^gv), then the delta write."""
    x = kda_inputs(2, 10, 2, 5, 4, seed=17)
    gv = F.logsigmoid(torch.randn(2, 10, 2, 4, dtype=F64) + 1)
    o, h = ops.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], gk=x["g"], gv=gv, beta=x["beta"],
                                                initial_state=x["initial_state"], output_final_state=True)
    o_ref, h_ref = loop_kda(**x, gv=gv)
    assert_close("gk + gv o", o, o_ref, 1e-13)
    assert_close("gk + gv h_T", h, h_ref, 1e-13)
    g_head = F.logsigmoid(torch.randn(2, 10, 2, dtype=F64))  # a per-head g with gv: broadcast over K
    o, _ = ops.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g_head, gv=gv, beta=x["beta"])
    o_ref, _ = loop_kda(x["q"], x["k"], x["v"], g_head[..., None].expand(-1, -1, -1, 5), x["beta"], gv=gv)
    assert_close("g + gv o", o, o_ref, 1e-13)
    o, _ = ops.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], gk=x["g"], beta=x["beta"])
    assert torch.equal(o, ops.recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])[0])


KDA_FORMS = [ops.recurrent_kda, ops.parallel_kda, ops.chunk_kda]


@pytest.mark.parametrize("fn", KDA_FORMS, ids=lambda f: f.__name__)
def test_bad_gates_are_refused_naming_the_argument(fn):
    x = kda_inputs(1, 6, 2, 4, 3, initial_state=False)
    name = fn.__name__
    with pytest.raises(ValueError, match=rf"{name}: `g` .*\[B, T, H, K\] = \[1, 6, 2, 4\], got \[1, 6, 2\]"):
        fn(**{**x, "g": x["g"][..., 0]})
    with pytest.raises(ValueError, match=rf"{name}: `gk` .*got \[1, 6, 2, 5\]"):
        fn(**{n: t for n, t in x.items() if n != "g"}, gk=torch.zeros(1, 6, 2, 5, dtype=F64))
    with pytest.raises(ValueError, match=rf"{name}: `g` \(a per-key-channel log decay\) must be <= 0, got values up to 0.5; a decay exp\(g\)"):
        fn(**{**x, "g": x["g"].clone().index_fill_(3, torch.tensor([1]), 0.5)})
    with pytest.raises(ValueError, match=rf"{name}: got both `g` and `gk`"):
        fn(**x, gk=x["g"])
    with pytest.raises(TypeError, match=rf"{name}: `g` must be a floating-point tensor"):
        fn(**{**x, "g": x["g"].long()})
    gv = torch.zeros(1, 6, 2, 3, dtype=F64)
    if fn is ops.recurrent_kda:
        with pytest.raises(ValueError, match=rf"{name}: `gv` .*\[1, 6, 2, 3\], got \[1, 6, 2, 4\]"):
            fn(**x, gv=torch.zeros(1, 6, 2, 4, dtype=F64))
        with pytest.raises(ValueError, match=rf"{name}: `gv` \(a per-value-channel log decay\) must be <= 0, got values up to 0.1; a decay exp\(gv\)"):
            fn(**x, gv=gv + 0.1)
    else:
        with pytest.raises(ValueError, match=rf"{name}: `gv` .*recurrent form only"):
            fn(**x, gv=gv)
    with pytest.raises(ValueError, match=rf"{name}: `use_gate_in_kernel=True` needs `A_log`"):
        fn(**x, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match=rf"{name}: `dt_bias` must have shape \[HV·K\] = \[8\], got \[2\]"):
        fn(**x, use_gate_in_kernel=True, A_log=torch.zeros(2), dt_bias=torch.zeros(2))
    with ops.value_checks(False):  # a growing memory, when asked for
        fn(**{**x, "g": x["g"] + 0.01})


@pytest.mark.parametrize("fn", [*KDA_FORMS, ops.fused_recurrent_kda], ids=lambda f: f.__name__)
def test_state_v_first_error_quotes_the_callers_layout(fn):
    """With ``state_v_first=True`` the caller's state is [N, HV, V, K]: a wrong one is refused with
    the shape it must have in that layout and the shape it has, never the caller's own shape as
    the required one (a [N, HV, K, V] state passed by mistake used to be "required")."""
    x = kda_inputs(1, 6, 2, 4, 3, initial_state=False)
    name = fn.__name__
    k_first = torch.zeros(1, 2, 4, 3, dtype=F64)
    with pytest.raises(ValueError) as e:
        fn(**x, initial_state=k_first, state_v_first=True)
    assert str(e.value).startswith(f"{name}: `initial_state` must have shape [N, H, V, K] = [1, 2, 3, 4] (state_v_first=True), "
                                   f"got [1, 2, 4, 3]"), str(e.value)
    with pytest.raises(ValueError, match=rf"^{name}: `initial_state` must have shape \[N, H, K, V\] = \[1, 2, 4, 3\], got \[1, 2, 3, 4\]"):
        fn(**x, initial_state=torch.zeros(1, 2, 3, 4, dtype=F64))  # without the flag: our layout, quoted as ours
    fn(**x, initial_state=torch.zeros(1, 2, 3, 4, dtype=F64), state_v_first=True)  # the right shape passes


def test_fused_recurrent_gated_delta_rule_errors_name_it_and_the_argument():
    """With ``gk``/``gv`` the alias runs KDA's recurrent form, but every error names the function
    called, the argument (``gv`` as ``gv``, not ``gk``), the expected and the received."""
    x = kda_inputs(1, 6, 2, 4, 3, initial_state=False)
    q, k, v, gk, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    fn = ops.fused_recurrent_gated_delta_rule
    cases = [
        (dict(gk=gk[..., :2], beta=beta),
         "`gk` (a per-key-channel log decay) must have shape [B, T, H, K] = [1, 6, 2, 4], got [1, 6, 2, 2]"),
        (dict(gk=gk, gv=torch.zeros(1, 6, 2, 5, dtype=F64), beta=beta),
         "`gv` (a per-value-channel log decay) must have shape [B, T, H, V] = [1, 6, 2, 3], got [1, 6, 2, 5]"),
        (dict(gk=gk, gv=torch.full((1, 6, 2, 3), 0.25, dtype=F64), beta=beta),
         "`gv` (a per-value-channel log decay) must be <= 0, got values up to 0.25; a decay exp(gv) above 1"),
        (dict(gk=gk, beta=beta[..., :1]), "`beta` must have shape [B, T, H] = [1, 6, 2], got [1, 6, 1]"),
        (dict(gk=gk, beta=beta, initial_state=torch.zeros(1, 2, 4, 3, dtype=F64), state_v_first=True),
         "`initial_state` must have shape [N, H, V, K] = [1, 2, 3, 4] (state_v_first=True), got [1, 2, 4, 3]"),
    ]
    for kwargs, words in cases:
        with pytest.raises(ValueError) as e:
            fn(q, k, v, **kwargs)
        message = str(e.value)
        print(message)
        assert message.startswith(f"fused_recurrent_gated_delta_rule: {words}"), message
        assert "recurrent_kda" not in message
    with pytest.raises(ValueError, match=r"^recurrent_kda: `gv` \(a per-value-channel log decay\) must be <= 0.*exp\(gv\)"):
        ops.recurrent_kda(**x, gv=torch.full((1, 6, 2, 3), 0.25, dtype=F64))


def test_gk_refused_by_the_per_head_ops_and_with_g_in_the_fla_alias():
    x = kda_inputs(1, 6, 2, 4, 3, initial_state=False)
    g = torch.zeros(1, 6, 2, dtype=F64)
    with pytest.raises(ValueError, match="chunk_gated_delta_rule: `gk`.*chunk_kda"):
        ops.chunk_gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"], gk=x["g"])
    with pytest.raises(ValueError, match="fused_recurrent_gated_delta_rule: got both `g` .* and `gk`"):
        ops.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g, gk=x["g"], beta=x["beta"])


@pytest.mark.parametrize("fn", [ops.chunk_kda, ops.parallel_kda], ids=lambda f: f.__name__)
def test_bf16_within_2x_of_the_recurrent_form(fn):
    """bf16 inputs, fp32 compute: error vs float64 at most 2x (3x for gradients) the recurrent form's."""
    x = kda_inputs(1, 80, 2, 16, 16, seed=19, initial_state=False)
    xb = {n: t.to(torch.bfloat16) for n, t in x.items()}
    truth = run(ops.recurrent_kda, {n: t.double() for n, t in xb.items()})
    base = run(ops.recurrent_kda, xb)
    got = run(fn, xb, chunk_option(fn, 32))
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    pairs = [("o", got[0], base[0], truth[0], 2), ("h_T", got[1], base[1], truth[1], 2)]
    pairs += [(f"d{n}", got[2][n], base[2][n], truth[2][n], 3) for n in truth[2]]
    for name, a, b, want, factor in pairs:
        err, base_err = rel_err(a, want), rel_err(b, want)
        print(f"{fn.__name__} bf16 {name}: {err:.2e} (recurrent {base_err:.2e})")
        assert err <= factor * base_err, (name, err, base_err)


def test_autocast_computes_in_fp32_and_returns_the_autocast_dtype():
    x = kda_inputs(1, 40, 2, 8, 8, seed=21, initial_state=False, dtype=torch.float32)
    w = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = x["q"] @ w  # bf16 under autocast
        o, h = ops.chunk_kda(q, x["k"].bfloat16(), x["v"].bfloat16(), x["g"], x["beta"], output_final_state=True,
                             chunk_size=16)
        o_ref, h_ref = ops.recurrent_kda(q, x["k"].bfloat16(), x["v"].bfloat16(), x["g"], x["beta"],
                                         output_final_state=True)
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
    assert_close("autocast chunk vs recurrent h_T (fp32 state)", h, h_ref, 1e-5)


@pytest.mark.parametrize("fn, packed", [(ops.chunk_kda, False), (ops.chunk_kda, True), (ops.recurrent_kda, False)],
                         ids=["chunk-batch", "chunk-cu_seqlens", "recurrent-batch"])
def test_compiles_without_graph_breaks_and_equals_eager(fn, packed):
    """``fullgraph=True`` (a graph break raises), forward and backward, equal to eager."""
    torch._dynamo.reset()
    short = fn is ops.recurrent_kda  # traced token by token: keep T small
    if packed:
        cu = [0, 2, 7, 8] if short else [0, 5, 17, 20]
        x = kda_inputs(1, cu[-1], 2, 4, 3, seed=23, initial_state=False)
        options = dict(cu_seqlens=torch.tensor(cu), max_seqlen=max(b - a for a, b in zip(cu, cu[1:])))
    else:
        x = kda_inputs(2, 5 if short else 11, 2, 4, 3, seed=23)
        options = {}
    if fn is ops.chunk_kda:
        options["chunk_size"] = 4

    def call(**inputs):
        return fn(**inputs, **options)

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    o_c, h_c, g_c = run(compiled, x)
    o_e, h_e, g_e = run(call, x)
    errors = {"o": rel_err(o_c, o_e), "h_T": rel_err(h_c, h_e), **{f"d{n}": rel_err(g_c[n], g_e[n]) for n in g_e}}
    print(f"{fn.__name__} compiled vs eager: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    assert all(e <= 1e-12 for e in errors.values()), errors
    torch._dynamo.reset()


def test_chunk_groups_carry_the_state_and_its_gradient(monkeypatch):
    """The chunk form works through groups of chunk-heads (bounded transient memory); many
    small groups give the same values and gradients as the recurrence."""
    import fastweights.ops.kda.chunk as chunk

    monkeypatch.setattr(chunk, "GROUP", 3)  # rows = N·H = 4: one chunk per group
    x = kda_inputs(2, 70, 2, 6, 5, seed=25)
    o_ref, h_ref, g_ref = run(ops.recurrent_kda, x)
    o, h, grads = run(ops.chunk_kda, x, dict(chunk_size=8))
    assert_close("grouped o", o, o_ref, 1e-12)
    assert_close("grouped h_T", h, h_ref, 1e-12)
    for name in g_ref:
        assert_close(f"grouped d{name}", grads[name], g_ref[name], 1e-11)
