"""Every form of every rule equals its recurrent form in float64.

Outputs and final states agree to ≤ 1e-10 relative (docs/design.md: equal forms
agree to ~1e-12), on awkward shapes: T ∈ {1, 63, 100, 257}, K ≠ V, K = 60,
B > 1, chunk sizes 16/32/64, with and without an initial state; packed
``cu_seqlens`` equals running each sequence alone; a sequence split in two
(also mid-chunk) with its state carried over equals the whole.
"""

import pytest
import torch

from fastweights import ops
from helpers import RULES, assert_close, call, chunk_option, make_inputs

TOL = 1e-10

# (B, T, H, K, V, chunk_size)
SHAPES = [
    (2, 1, 2, 8, 8, 16),
    (2, 63, 2, 60, 20, 16),
    (1, 100, 3, 16, 24, 32),
    (2, 257, 2, 12, 10, 64),
    (3, 100, 1, 60, 60, 64),
]
SHAPE_IDS = [f"B{b}-T{t}-H{h}-K{k}-V{v}-C{c}" for b, t, h, k, v, c in SHAPES]


def _fast_forms():
    for rule in RULES.values():
        for form in rule.forms[1:]:
            yield pytest.param(rule, form, id=f"{rule.name}-{form.__name__.split('_')[0]}")


FAST_FORMS = list(_fast_forms())


@pytest.mark.parametrize("with_state", [False, True], ids=["h0=None", "h0"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("rule,form", FAST_FORMS)
def test_form_equals_recurrence(rule, form, shape, with_state):
    B, T, H, K, V, C = shape
    x = make_inputs(rule, B, T, H, K, V, initial_state=with_state)
    o_ref, h_ref = call(rule.reference, rule, x, output_final_state=True)
    o, h = call(form, rule, x, output_final_state=True, chunk_size=C)
    assert o.dtype == torch.float64 and h.dtype == torch.float64
    assert_close("output", o, o_ref, TOL)
    assert_close("final state", h, h_ref, TOL)


@pytest.mark.parametrize("rule,form", FAST_FORMS)
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_varlen_equals_each_sequence_alone(rule, form, chunk_size):
    lengths = [37, 1, 100, 64, 5]
    H, K, V = 2, 12, 9
    x = make_inputs(rule, 1, sum(lengths), H, K, V, initial_state=False, seed=1)
    h0 = make_inputs(rule, len(lengths), 1, H, K, V, initial_state=True, seed=2)["initial_state"]
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, h = call(form, rule, x, initial_state=h0, cu_seqlens=cu, output_final_state=True, chunk_size=chunk_size)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = {name: t[:, start:end] for name, t in x.items()}
        o_n, h_n = call(rule.reference, rule, alone, initial_state=h0[n : n + 1], output_final_state=True)
        assert_close(f"sequence {n} output", o[:, start:end], o_n, TOL)
        assert_close(f"sequence {n} state", h[n : n + 1], h_n, TOL)


@pytest.mark.parametrize("split", [1, 40, 50, 99], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("rule,form", FAST_FORMS)
def test_state_carried_across_a_split_equals_the_whole(rule, form, split):
    x = make_inputs(rule, 2, 100, 2, 16, 8, initial_state=True, seed=3)
    o_all, h_all = call(form, rule, x, output_final_state=True, chunk_size=32)  # split 40/50 are mid-chunk
    first = {n: (t[:, :split] if n != "initial_state" else t) for n, t in x.items()}
    second = {n: t[:, split:] for n, t in x.items() if n != "initial_state"}
    o1, h1 = call(form, rule, first, output_final_state=True, chunk_size=32)
    o2, h2 = call(form, rule, second, initial_state=h1, output_final_state=True, chunk_size=32)
    assert_close("output", torch.cat([o1, o2], dim=1), o_all, TOL)
    assert_close("final state", h2, h_all, TOL)


FEATURE_MAPS = {
    "relu": "relu",
    "dpfp3": ops.DPFP(nu=3),
    "favor+": ops.FavorPlus(12, num_features=20, seed=7),
    "taylor": ops.Taylor(input_scale=0.5),
}


@pytest.mark.parametrize("normalize", [False, True], ids=["plain", "normalized"])
@pytest.mark.parametrize("qk_norm", [None, "l2", "sum"])
@pytest.mark.parametrize("name", list(FEATURE_MAPS))
@pytest.mark.parametrize("form", RULES["linear"].forms[1:], ids=["parallel", "chunk"])
def test_feature_maps_and_norms_keep_forms_equal(form, name, qk_norm, normalize):
    rule = RULES["linear_decay"]
    x = make_inputs(rule, 2, 45, 2, 12, 7, seed=4)
    kwargs = dict(feature_map=FEATURE_MAPS[name], qk_norm=qk_norm, normalize=normalize, output_final_state=True)
    o_ref, h_ref = ops.recurrent_linear_attn(**x, **kwargs)
    o, h = form(**x, **kwargs, **chunk_option(form, 16))
    assert torch.isfinite(o_ref).all()
    assert_close("output", o, o_ref, TOL)
    assert_close("final state", h, h_ref, TOL)


@pytest.mark.parametrize("qk_norm", [None, "sum"])
@pytest.mark.parametrize("rule_name", ["delta", "gated_delta"])
def test_delta_rules_accept_feature_maps(rule_name, qk_norm):
    """Schlag et al. 2021 pair the delta rule with DPFP and sum normalization."""
    rule = RULES[rule_name]
    x = make_inputs(rule, 1, 50, 2, 6, 5, seed=5)
    kwargs = dict(feature_map=ops.DPFP(nu=2), qk_norm=qk_norm, output_final_state=True)
    o_ref, h_ref = call(rule.reference, rule, x, **kwargs)
    assert h_ref.shape == (1, 2, 24, 5)
    for form in rule.forms[1:]:
        o, h = call(form, rule, x, **kwargs, chunk_size=16)
        assert_close(f"{form.__name__} output", o, o_ref, TOL)
        assert_close(f"{form.__name__} state", h, h_ref, TOL)


def test_fla_spelling_of_l2_norm_is_qk_norm_l2():
    rule = RULES["delta"]
    x = make_inputs(rule, 1, 20, 1, 8, 8)
    x["k"] = x["k"] * 3.0
    a, _ = ops.chunk_delta_rule(**x, use_qk_l2norm_in_kernel=True)
    b, _ = ops.chunk_delta_rule(**x, qk_norm="l2")
    c, _ = ops.chunk_delta_rule(**x)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule_name", ["linear_decay", "delta", "gated_delta"])
def test_dtypes_round_trip(rule_name, dtype):
    """Outputs come back in the input dtype; the state is fp32 for every non-fp64 input."""
    rule = RULES[rule_name]
    x = make_inputs(rule, 1, 20, 2, 8, 8, dtype=dtype)
    for form in rule.forms:
        o, h = call(form, rule, x, output_final_state=True, chunk_size=8)
        assert o.dtype == dtype and h.dtype == torch.float32
        assert torch.isfinite(o).all()


def test_no_final_state_unless_asked():
    rule = RULES["gated_delta"]
    x = make_inputs(rule, 1, 10, 1, 4, 4)
    for form in rule.forms:
        assert call(form, rule, x)[1] is None
