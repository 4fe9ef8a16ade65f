"""Mixed precision: every op, layer and the LM under ``torch.autocast("cpu", dtype=torch.bfloat16)``.

Autocast hands the ops bf16 projections; the ops compute in fp32 with an fp32 state
and return the input dtype (autocast would otherwise run their matmuls in bf16).
DESIGN's rule judges them: measured against a float64 ground truth, the error of
the form under test may be at most 2× (3× for gradients) that of the recurrent form
run the same way (the same autocast region, the same bf16 inputs).

- Ops: the bf16 inputs come from projections computed under autocast; the ground
  truth is the float64 recurrent form on exactly those bf16 values, so only the
  op's own arithmetic is measured. The fp32 final state h_T exposes any product
  that autocast would have lowered to bf16 inside the op (its error would be ~1e-3,
  not ~1e-7); it is held to fp32 accuracy rather than to the ratio, since between
  two fp32 computations the order of a sum alone can decide a factor of 2-3.
- Layers and the LM: the ground truth is a float64 copy of the module without
  autocast; the baseline swaps every chunk op for its recurrent form. The error of
  the autocast run against the fp32 run (no autocast) is printed as well.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fastweights import layers, ops
from fastweights.models import LM, LMConfig
from fastweights.ops._frontend import autocast_off

from helpers import in_chunk_place, RULES, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)

OP_FORMS = {  # (rule of helpers.RULES, form index: 1 parallel, 2 chunk)
    "chunk_delta_rule": ("delta_l2", 2),
    "chunk_gated_delta_rule": ("gated_delta", 2),
    "chunk_linear_attn": ("linear_elu_normalized", 2),
    "parallel_delta_rule": ("delta_l2", 1),
    "parallel_gated_delta_rule": ("gated_delta", 1),
    "parallel_linear_attn": ("linear_elu_normalized", 1),
}


def _check_ratios(label, checks):
    """``checks``: (name, error of the form under test, error of the recurrent form, factor)."""
    if len(checks) > 10:  # a module's parameters: the summary, then each check only when it fails
        worst = max(checks, key=lambda c: c[1] / (c[2] * c[3]))
        print(f"{label}: {len(checks)} checks, highest ratio {worst[1] / worst[2]:.2f} at {worst[0]} (limit {worst[3]:g})")
    else:
        for name, e_fast, e_rec, factor in checks:
            print(f"{label} {name}: autocast {e_fast:.2e}, recurrent {e_rec:.2e}, ratio {e_fast / e_rec:.2f} (limit {factor:g})")
    for name, e_fast, e_rec, factor in checks:
        assert e_fast <= factor * e_rec, f"{label} {name}: error {e_fast:.2e} > {factor:g} x recurrent {e_rec:.2e}"


def _projected_inputs(rule, B=2, T=45, H=2, K=16, V=12, seed=0):
    """bf16 q, k, v (and fp32 β, g) as autocast makes them: from a projection of fp32 activations."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, 24, generator=gen)
    weights = {name: torch.randn(24, H * d, generator=gen) / 24 ** 0.5 for name, d in (("q", K), ("k", K), ("v", V))}
    with torch.autocast(**BF16):
        made = {name: (x @ w).reshape(B, T, H, -1) for name, w in weights.items()}
    assert all(t.dtype == torch.bfloat16 for t in made.values())
    if rule.beta:
        made["beta"] = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    if rule.g:
        made["g"] = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 2.0)
    made["initial_state"] = torch.randn(B, H, *rule.state_dims(K, V), generator=gen) * 0.1
    if rule.options.get("normalize"):
        made["initial_state"][..., -1] = made["initial_state"][..., -1].abs() + 1.0
    return made


def _run_op(op, rule, inputs, do, dh, autocast: bool, **kwargs):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()}
    with torch.autocast(**BF16, enabled=autocast):
        o, h = op(**leaves, **rule.options, output_final_state=True, **kwargs)
        loss = (o.double() * do).sum() + (h.double() * dh).sum()
    loss.backward()
    return o, h, {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("op_name", list(OP_FORMS))
def test_op_under_autocast_within_2x_of_recurrent(op_name):
    rule_name, form = OP_FORMS[op_name]
    rule = RULES[rule_name]
    op = getattr(ops, op_name)
    assert op is rule.forms[form]
    inputs = _projected_inputs(rule)
    exact = {n: t.double() for n, t in inputs.items()}
    o_ref, h_ref = rule.reference(**exact, **rule.options, output_final_state=True)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    dh = torch.randn(h_ref.shape, generator=gen, dtype=torch.float64)
    _, _, g_ref = _run_op(rule.reference, rule, exact, do, dh, autocast=False)
    kwargs = dict(chunk_size=16) if form == 2 else {}
    o, h, grads = _run_op(op, rule, inputs, do, dh, autocast=True, **kwargs)
    o_rec, h_rec, g_rec = _run_op(rule.reference, rule, inputs, do, dh, autocast=True)

    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32  # input dtype out; fp32 state
    assert all(grads[n].dtype == inputs[n].dtype for n in inputs)
    checks = [("o", rel_err(o, o_ref), rel_err(o_rec, o_ref), 2.0)]
    checks += [(f"d{n}", rel_err(grads[n], g_ref[n]), rel_err(g_rec[n], g_ref[n]), 3.0) for n in g_ref]
    _check_ratios(op_name, checks)
    # h_T is fp32 and so are its errors (~1e-7, where the order of a long sum can decide a
    # factor of 2-3 between forms): hold it to fp32 accuracy. bf16 products would give ~1e-3.
    e_h, e_h_rec = rel_err(h, h_ref), rel_err(h_rec, h_ref)
    print(f"{op_name} h_T (fp32): autocast {e_h:.2e}, recurrent {e_h_rec:.2e} (limit 1e-5)")
    assert e_h < 1e-5 and e_h_rec < 1e-5, "the fp32 state saw bf16 arithmetic"


def test_softmax_attn_under_autocast_within_2x_of_reference():
    rule = RULES["linear"]
    inputs = {n: t for n, t in _projected_inputs(rule, T=33).items() if n in "qkv"}
    exact = {n: t.double() for n, t in inputs.items()}

    def reference(q, k, v):  # the definition, one query at a time, in fp32 (or fp64)
        with autocast_off(q.device):
            dt = torch.float64 if q.dtype == torch.float64 else torch.float32
            return ops.softmax_attn_reference(q.to(dt), k.to(dt), v.to(dt)).to(q.dtype)

    do = torch.randn(2, 33, 2, 12, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    runs = {}
    for name, fn, x, autocast in (("ref", reference, exact, False), ("fast", lambda **a: ops.softmax_attn(**a)[0], inputs, True),
                                  ("rec", reference, inputs, True)):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
        with torch.autocast(**BF16, enabled=autocast):
            o = fn(**leaves)
        (o.double() * do).sum().backward()
        runs[name] = (o, {n: t.grad for n, t in leaves.items()})
    assert runs["fast"][0].dtype == torch.bfloat16
    checks = [("o", rel_err(runs["fast"][0], runs["ref"][0]), rel_err(runs["rec"][0], runs["ref"][0]), 2.0)]
    checks += [(f"d{n}", rel_err(runs["fast"][1][n], runs["ref"][1][n]), rel_err(runs["rec"][1][n], runs["ref"][1][n]), 3.0)
               for n in inputs]
    _check_ratios("softmax_attn", checks)


# -- layers and the LM -------------------------------------------------------------------

def _recurrent_softmax(q, k, v, **kwargs):
    """softmax_attn's reference form in place of the fast op (training forward only: no cache)."""
    with autocast_off(q.device):
        return ops.softmax_attn_reference(q.float(), k.float(), v.float()).to(q.dtype), None


RECURRENT_FORMS = {  # module attribute -> the recurrent form that replaces the fast op there
    ("fastweights.layers.deltanet", "chunk_delta_rule"): in_chunk_place(ops.recurrent_delta_rule),
    ("fastweights.layers.gated_deltanet", "chunk_gated_delta_rule"): in_chunk_place(ops.recurrent_gated_delta_rule),
    ("fastweights.layers.kda", "chunk_kda"): in_chunk_place(ops.recurrent_kda),
    ("fastweights.layers.linear_attention", "chunk_linear_attn"): in_chunk_place(ops.recurrent_linear_attn),
    ("fastweights.layers.softmax_attention", "softmax_attn"): _recurrent_softmax,
}


def _module_runs(module, forward, monkeypatch, low=torch.bfloat16):
    """Output and parameter gradients of ``forward(module, dtype)`` four ways: float64 (the
    ground truth), fp32, autocast to ``low`` with the fast ops, and with the recurrent forms."""
    runs = {}
    for name in ("fp64", "fp32", "autocast", "autocast_recurrent"):
        m = copy.deepcopy(module).to(torch.float64 if name == "fp64" else torch.float32)
        with monkeypatch.context() as patch:
            if name == "autocast_recurrent":
                for (where, attr), form in RECURRENT_FORMS.items():
                    patch.setattr(f"{where}.{attr}", form)
            with torch.autocast("cpu", dtype=low, enabled=name.startswith("autocast")):
                out = forward(m, torch.float64 if name == "fp64" else torch.float32)
            (out.double() * torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)).sum().backward()
        runs[name] = (out, {n: p.grad for n, p in m.named_parameters()})
    return runs


def _judge(label, runs, out_dtype):
    assert runs["autocast"][0].dtype == out_dtype
    ref_out, ref_grads = runs["fp64"]
    checks = [("output", rel_err(runs["autocast"][0], ref_out), rel_err(runs["autocast_recurrent"][0], ref_out), 2.0)]
    checks += [(f"d{n}", rel_err(g, ref_grads[n]), rel_err(runs["autocast_recurrent"][1][n], ref_grads[n]), 3.0)
               for n, g in runs["autocast"][1].items()]
    vs_fp32 = rel_err(runs["autocast"][0], runs["fp32"][0])
    worst = max(checks[1:], key=lambda c: c[1])
    print(f"{label}: output error vs fp32 run {vs_fp32:.2e}; worst gradient {worst[0]} {worst[1]:.2e} vs float64")
    _check_ratios(label, checks)


LAYERS = {
    "deltanet": lambda: layers.DeltaNet(32, 2, chunk_size=16),
    "gated_deltanet": lambda: layers.GatedDeltaNet(32, 2, chunk_size=16),
    "kda": lambda: layers.KimiDeltaAttention(32, 2, chunk_size=16),
    "linear": lambda: layers.LinearAttention(32, 2, chunk_size=16),
    "softmax": lambda: layers.SoftmaxAttention(32, 2),
}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_under_autocast_within_2x_of_recurrent(name, monkeypatch):
    torch.manual_seed(1)
    layer = LAYERS[name]()
    x = torch.randn(2, 37, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    runs = _module_runs(layer, lambda m, dt: m(x.to(dt))[0], monkeypatch)
    _judge(name, runs, torch.bfloat16)


@pytest.mark.parametrize("mixer", ["deltanet", "hybrid", "hybrid-fp16"])
def test_lm_under_autocast_within_2x_of_recurrent(mixer, monkeypatch):
    torch.manual_seed(3)
    hybrid = mixer.startswith("hybrid")
    low = torch.float16 if mixer.endswith("fp16") else torch.bfloat16
    mixers = ["deltanet", "gated_deltanet", "linear", "softmax"] if hybrid else "deltanet"
    model = LM(LMConfig(vocab_size=41, d_model=32, n_layers=4 if hybrid else 2, n_heads=2,
                        mixer=mixers, chunk_size=16))
    ids = torch.randint(0, 41, (2, 40), generator=torch.Generator().manual_seed(4))
    runs = _module_runs(model, lambda m, dt: m(ids, return_cache=False)[0], monkeypatch, low)
    _judge(f"LM ({mixer})", runs, low)


# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("op_name", ["chunk_delta_rule", "recurrent_linear_attn", "softmax_attn"])
def test_float64_inside_autocast_is_refused(op_name):
    x = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    extra = dict(beta=torch.rand(1, 8, 2, dtype=torch.float64)) if "delta" in op_name else {}
    with torch.autocast(**BF16):
        with pytest.raises(TypeError, match=r"`q` is float64 inside torch.autocast\(device_type='cpu', dtype=torch.bfloat16\)"):
            getattr(ops, op_name)(x, x, x, **extra)
    getattr(ops, op_name)(x, x, x, **extra)  # float64 outside autocast is the reference precision
