"""Bad input gets a ValueError/TypeError that names the argument, the expected and the received value."""

import inspect

import pytest
import torch

from fastweights import ops
from helpers import RULES, make_inputs, rel_err

ALL_FORMS = [
    pytest.param(rule, form, id=form.__name__)
    for name, rule in RULES.items()
    if name in ("linear_decay", "delta", "gated_delta")
    for form in rule.forms
]


def good(rule, **overrides):
    x = make_inputs(rule, 1, 12, 2, 4, 3, initial_state=True)
    x.update(overrides)
    return x


def bad_cases(rule):
    x = make_inputs(rule, 1, 12, 2, 4, 3, initial_state=True)
    B, T, H, K = x["q"].shape
    cases = {
        "k-shape": (ValueError, r"`k` must have the shape of `q` \[1, 12, 2, 4\].*got \[1, 12, 2, 5\]", dict(k=torch.randn(B, T, H, 5, dtype=torch.float64))),
        "v-shape": (ValueError, r"`v` must have shape \[B, T, H, V\] = \[1, 12, 2, V\].*got \[1, 11, 2, 3\]", dict(v=torch.randn(1, 11, 2, 3, dtype=torch.float64))),
        "q-rank": (ValueError, r"`q` must have rank 4 with layout \[B, T, H, K\], got shape \[12, 2, 4\]", dict(q=x["q"][0])),
        "k-dtype": (TypeError, r"`k` must have the dtype of `q` \(torch.float64\), got torch.float32", dict(k=x["k"].float())),
        "q-int": (TypeError, r"`q` must be a floating-point tensor, got dtype torch.int64", dict(q=x["q"].long())),
        "q-not-tensor": (TypeError, r"`q` must be a torch.Tensor", dict(q=x["q"].tolist())),
        "k-device": (ValueError, r"`k` is on meta, expected the device of `q` \(cpu\)", dict(k=torch.empty(x["k"].shape, dtype=torch.float64, device="meta"))),
        "state-shape": (ValueError, r"`initial_state` must have shape \[N, H, K, V\] = \[1, 2, 4, 3\], got \[1, 2, 3, 4\]", dict(initial_state=x["initial_state"].transpose(-1, -2).contiguous())),
        "state-dtype": (TypeError, r"`initial_state` must have dtype torch.float64.*got torch.float32", dict(initial_state=x["initial_state"].float())),
        "chunk-zero": (ValueError, r"`chunk_size` must be positive, got 0", dict(chunk_size=0)),
        "chunk-negative": (ValueError, r"`chunk_size` must be positive, got -4", dict(chunk_size=-4)),
        "chunk-float": (TypeError, r"`chunk_size` must be a positive int, got 2.5", dict(chunk_size=2.5)),
        "q-nan": (ValueError, r"`q` contains 8 non-finite value\(s\) \(NaN or Inf\)", dict(q=x["q"].index_put((torch.tensor(0), torch.tensor(3)), torch.tensor(float("nan"), dtype=torch.float64)))),
        "v-inf": (ValueError, r"`v` contains 6 non-finite value\(s\)", dict(v=torch.where(torch.arange(12)[None, :, None, None] == 5, float("inf"), x["v"]))),
        "state-nan": (ValueError, r"`initial_state` contains", dict(initial_state=x["initial_state"] * float("nan"))),
        "cu-not-increasing": (ValueError, r"`cu_seqlens` must be strictly increasing, got 5 followed by 5 at index 1", dict(cu_seqlens=torch.tensor([0, 5, 5, 12]), initial_state=None)),
        "cu-decreasing": (ValueError, r"`cu_seqlens` must be strictly increasing, got 7 followed by 3", dict(cu_seqlens=torch.tensor([0, 7, 3, 12]), initial_state=None)),
        "cu-wrong-end": (ValueError, r"`cu_seqlens` must end at the sequence length T=12, got 10", dict(cu_seqlens=torch.tensor([0, 4, 10]), initial_state=None)),
        "cu-wrong-start": (ValueError, r"`cu_seqlens` must start at 0, got 2", dict(cu_seqlens=torch.tensor([2, 4, 12]), initial_state=None)),
        "cu-float": (TypeError, r"`cu_seqlens` must have dtype torch.int64 or torch.int32, got torch.float32", dict(cu_seqlens=torch.tensor([0.0, 12.0]), initial_state=None)),
        "cu-state-count": (ValueError, r"`initial_state` must have shape \[N, H, K, V\] = \[2, 2, 4, 3\], got \[1, 2, 4, 3\]", dict(cu_seqlens=torch.tensor([0, 4, 12]))),
        "qk-norm": (ValueError, r"unknown `qk_norm` 'L2'", dict(qk_norm="L2")),
        "feature-map": (ValueError, r"unknown `feature_map` 'softplus'", dict(feature_map="softplus")),
        "scale-type": (TypeError, r"`scale` must be a float or None, got str", dict(scale="0.5")),
    }
    batched = make_inputs(rule, 2, 12, 2, 4, 3, initial_state=True)
    cases["cu-with-batch"] = (ValueError, r"`cu_seqlens` requires batch size 1.*got batch size 2", dict(batched, cu_seqlens=torch.tensor([0, 5, 12]), initial_state=None))
    for name in ("beta", "g"):
        if name in x:
            cases[f"{name}-shape"] = (ValueError, rf"`{name}` must have shape \[B, T, H\] = \[1, 12, 2\], got \[1, 11, 2\]", {name: x[name][:, :11]})
    return cases


def _applies(form, case: str) -> bool:
    """The ``chunk-*`` cases are for the forms that take a ``chunk_size`` (the chunk forms)."""
    return not case.startswith("chunk-") or "chunk_size" in inspect.signature(form).parameters


CASES = [
    pytest.param(p.values[0], p.values[1], case, id=f"{p.id}-{case}")
    for p in ALL_FORMS
    for case in sorted(bad_cases(p.values[0])) if _applies(p.values[1], case)
]


@pytest.mark.parametrize("rule,form,case", CASES)
def test_bad_input_names_the_argument(rule, form, case):
    error, pattern, overrides = bad_cases(rule)[case]
    x = good(rule, **overrides)
    with pytest.raises(error, match=rf"^{form.__name__}: .*{pattern}"):
        form(**x)


@pytest.mark.parametrize("form", [ops.recurrent_delta_rule, ops.chunk_delta_rule, ops.chunk_gated_delta_rule])
def test_beta_none_means_beta_one(form):
    """fla's default (its fused_recurrent ops): ``beta=None`` writes with β = 1."""
    x = make_inputs(RULES["gated_delta"], 1, 5, 1, 4, 4)
    if "gated" not in form.__name__:
        x.pop("g")
    o_ones, _ = form(**{**x, "beta": torch.ones_like(x["beta"])})
    o_none, _ = form(**{**x, "beta": None})
    err = (o_ones - o_none).abs().max().item()
    print(f"{form.__name__}: beta=None vs ones max diff {err:.1e}")
    assert err == 0


def test_g_none_means_no_decay():
    """fla's default (fused_recurrent_gated_delta_rule): ``g=None`` is g = 0, no decay."""
    x = make_inputs(RULES["gated_delta"], 1, 5, 1, 4, 4)
    o_zero, _ = ops.chunk_gated_delta_rule(**{**x, "g": torch.zeros_like(x["g"])})
    o_none, _ = ops.chunk_gated_delta_rule(**{**x, "g": None})
    err = (o_zero - o_none).abs().max().item()
    print(f"g=None vs zeros max diff {err:.1e}")
    assert err == 0


def test_finite_check_can_be_switched_off():
    """The documented flag: with the check off, NaN propagates instead of raising."""
    rule = RULES["delta"]
    x = make_inputs(rule, 1, 6, 1, 4, 4)
    x["v"][0, 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ops.chunk_delta_rule(**x)
    with ops.finite_checks(False):
        o, _ = ops.chunk_delta_rule(**x)
    assert torch.isnan(o).any()
    with pytest.raises(ValueError, match="non-finite"):  # the context restored the check
        ops.chunk_delta_rule(**x)


def test_finite_check_on_a_device_does_not_wait_for_the_values(monkeypatch):
    """On CUDA the NaN/Inf check must not sync the host: it runs as ``torch._assert_async``.

    No CUDA here: the device branch is taken for CPU tensors by patching the
    host test, and any conversion of a tensor to a Python value (the host sync)
    raises. On the CPU ``_assert_async`` fails at once, which shows the check ran.
    """
    from fastweights.ops import _checks

    def host_sync(*args):
        raise AssertionError("the finite check read a tensor value on the host")

    monkeypatch.setattr(_checks, "_checked_on_host", lambda t: False, raising=False)
    for method in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, host_sync)
    x = make_inputs(RULES["delta"], 1, 6, 1, 4, 4)
    _checks.check_inputs("op", x["q"], x["k"], x["v"], beta=x["beta"])
    x["v"][0, 2] = float("nan")
    with pytest.raises(RuntimeError, match="op: `v` contains non-finite values"):
        _checks.check_inputs("op", x["q"], x["k"], x["v"], beta=x["beta"])


def test_softmax_rejects_a_bad_cache():
    q = torch.randn(2, 3, 2, 4)
    _, cache = ops.softmax_attn(q, q, q, output_final_state=True)
    with pytest.raises(TypeError, match="softmax_attn: `initial_state` must be a KVCache"):
        ops.softmax_attn(q, q, q, initial_state=(cache.keys, cache.values))
    with pytest.raises(ValueError, match=r"softmax_attn: `initial_state.keys` must have shape"):
        ops.softmax_attn(q[:1], q[:1], q[:1], initial_state=cache)
    with pytest.raises(TypeError, match=r"softmax_attn: `initial_state.keys` must have the dtype of `q`"):
        ops.softmax_attn(q.double(), q.double(), q.double(), initial_state=cache)
    with pytest.raises(ValueError, match=r"softmax_attn: `v` must have shape"):
        ops.softmax_attn(q, q, q[:, :2])


# -- values, sizes and chunk sizes (bad values used to pass, empty inputs crashed) -------------------


def value_cases(rule):
    """Bad values of otherwise well-formed inputs: ``case -> (error, pattern, overrides)``."""
    x = make_inputs(rule, 1, 12, 2, 4, 3, initial_state=True)
    cases = {
        "scale-nan": (ValueError, r"`scale` must be a finite number > 0, got nan", dict(scale=float("nan"))),
        "scale-inf": (ValueError, r"`scale` must be a finite number > 0, got inf", dict(scale=float("inf"))),
        "scale-zero": (ValueError, r"`scale` must be a finite number > 0, got 0.0", dict(scale=0.0)),
        "scale-negative": (ValueError, r"`scale` must be a finite number > 0, got -1", dict(scale=-1)),
        "B-zero": (ValueError, r"`q` must have sizes B, H, K > 0 \(only T may be 0\), got shape \[0, 12, 2, 4\]",
                   {n: t[:0] for n, t in x.items()}),
        "H-zero": (ValueError, r"`q` must have sizes B, H, K > 0 \(only T may be 0\), got shape \[1, 12, 0, 4\]",
                   {n: t[:, :, :0] if n != "initial_state" else t[:, :0] for n, t in x.items()}),
        "K-zero": (ValueError, r"`q` must have sizes B, H, K > 0 \(only T may be 0\), got shape \[1, 12, 2, 0\]",
                   dict(q=x["q"][..., :0], k=x["k"][..., :0], initial_state=None)),
        "V-zero": (ValueError, r"`v` must have size V > 0, got shape \[1, 12, 2, 0\]",
                   dict(v=x["v"][..., :0], initial_state=None)),
        "q-0d": (ValueError, r"`q` must have rank 4 with layout \[B, T, H, K\], got shape \[\]", dict(q=torch.tensor(1.0, dtype=torch.float64))),
        # (chunk_size=None is the default: the policy of fastweights.ops.default_chunk_size picks C)
        "chunk-float": (TypeError, r"`chunk_size` must be a positive int, got 2.5", dict(chunk_size=2.5)),
    }
    if "beta" in x:
        cases["beta-above-1"] = (ValueError, r"`beta` must lie in \[0, 1\] \(\[0, 2\] with allow_neg_eigval=True\), got values up to 3",
                                 dict(beta=torch.full_like(x["beta"], 3.0)))
        cases["beta-negative"] = (ValueError, r"`beta` must lie in \[0, 1\].*got values down to -1",
                                  dict(beta=x["beta"].index_fill(1, torch.tensor([4]), -1.0)))
        cases["beta-above-2-neg-eigval"] = (ValueError, r"`beta` must lie in \[0, 2\] \(allow_neg_eigval=True\), got values up to 2.5",
                                            dict(beta=torch.full_like(x["beta"], 2.5), allow_neg_eigval=True))
    if "g" in x:
        cases["g-positive"] = (ValueError, r"`g` \(the log decay\) must be <= 0, got values up to 0.5.*value_checks\(False\)",
                               dict(g=x["g"].index_fill(1, torch.tensor([7]), 0.5)))
    return cases


VALUE_CASES = [
    pytest.param(p.values[0], p.values[1], case, id=f"{p.id}-{case}")
    for p in ALL_FORMS
    for case in sorted(value_cases(p.values[0])) if _applies(p.values[1], case)
]


@pytest.mark.parametrize("rule,form,case", VALUE_CASES)
def test_bad_value_names_the_argument(rule, form, case):
    error, pattern, overrides = value_cases(rule)[case]
    x = good(rule, **overrides)
    with pytest.raises(error, match=rf"^{form.__name__}: .*{pattern}"):
        form(**x)


@pytest.mark.parametrize("form", [*RULES["delta"].forms, *RULES["gated_delta"].forms], ids=lambda f: f.__name__)
def test_allow_neg_eigval_admits_beta_up_to_two(form):
    """β in (1, 2] is the documented option (negative eigenvalues of I − β k kᵀ), equal to the reference."""
    rule = RULES["gated_delta"] if "gated" in form.__name__ else RULES["delta"]
    x = good(rule, beta=1.0 + good(rule)["beta"])
    o, h = form(**x, allow_neg_eigval=True, output_final_state=True)
    o_ref, h_ref = rule.reference(**x, allow_neg_eigval=True, output_final_state=True)
    err = max(rel_err(o, o_ref), rel_err(h, h_ref))
    print(f"{form.__name__} with beta in (1, 2): relative error {err:.1e}")
    assert err < 1e-10


@pytest.mark.parametrize("form", RULES["gated_delta"].forms + RULES["linear_decay"].forms, ids=lambda f: f.__name__)
def test_positive_g_passes_with_value_checks_off(form):
    """The opt-out for decays above 1 (a growing memory): the reference and the fast form still agree."""
    rule = RULES["gated_delta"] if "gated" in form.__name__ else RULES["linear_decay"]
    x = good(rule)
    x["g"] = x["g"] + 0.05  # mostly still below zero, some entries above
    assert (x["g"] > 0).any()
    with pytest.raises(ValueError, match="must be <= 0"):
        form(**x)
    with ops.value_checks(False):
        o, _ = form(**x)
        o_ref, _ = rule.reference(**x)
    with pytest.raises(ValueError, match="must be <= 0"):  # the context restored the check
        form(**x)
    print(f"{form.__name__} with g > 0: relative error {rel_err(o, o_ref):.1e}")
    assert rel_err(o, o_ref) < 1e-10


EMPTY_FORMS = [
    pytest.param(rule, form, id=f"{name}-{form.__name__}")
    for name, rule in RULES.items()
    for form in rule.forms
]


@pytest.mark.parametrize("rule,form", EMPTY_FORMS)
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "no-state"])
def test_empty_sequence_returns_empty_output_and_a_copy_of_the_state(rule, form, with_state):
    x = make_inputs(rule, 2, 0, 3, 4, 5, initial_state=with_state)
    o, h = form(**x, **rule.options, output_final_state=True)
    kd, vd = rule.state_dims(4, 5)
    assert o.shape == (2, 0, 3, 5) and o.dtype == x["q"].dtype
    assert h.shape == (2, 3, kd, vd) and h.dtype == torch.float64
    if with_state:
        assert torch.equal(h, x["initial_state"])
        assert h.data_ptr() != x["initial_state"].data_ptr(), "the final state must be a copy, not the caller's tensor"
    else:
        assert not h.any()


def test_softmax_of_an_empty_sequence():
    q = torch.randn(2, 0, 3, 4)
    o, cache = ops.softmax_attn(q, q, q, output_final_state=True)
    assert o.shape == (2, 0, 3, 4)
    assert cache.keys.shape == (2, 3, 0, 4) and cache.lengths.tolist() == [0, 0]
    with pytest.raises(ValueError, match=r"^softmax_attn: `q` must have sizes B, H, K > 0"):
        ops.softmax_attn(q[:, :, :0], q[:, :, :0], q[:, :, :0])


@pytest.mark.parametrize("form", [ops.chunk_delta_rule, ops.chunk_gated_delta_rule, ops.chunk_linear_attn],
                         ids=lambda f: f.__name__)
def test_chunk_size_is_capped_at_the_sequence(form, monkeypatch):
    """T = 10 with chunk_size = 10**6 must not build 10**6 x 10**6 chunk matrices: the solver
    sees a chunk no longer than the next power of two of T (but not below 64, the cap's floor that
    keeps chunking independent of T: fastweights.ops._chunk.LONG_CHUNK), and the result is the reference's."""
    from fastweights.ops.delta_rule.chunk import CHUNK_DELTA_RULE
    from fastweights.ops.gated_delta_rule.chunk import CHUNK_GATED_DELTA_RULE
    from fastweights.ops.linear_attn.chunk import CHUNK_LINEAR_ATTN

    rule = RULES["gated_delta"] if "gated" in form.__name__ else RULES["delta"] if "delta" in form.__name__ else RULES["linear_decay"]
    spec = {"chunk_delta_rule": CHUNK_DELTA_RULE, "chunk_gated_delta_rule": CHUNK_GATED_DELTA_RULE,
            "chunk_linear_attn": CHUNK_LINEAR_ATTN}[form.__name__]
    seen = []
    real = spec.cpu  # the solver backend="auto" runs on the CPU
    monkeypatch.setattr(spec, "cpu", lambda *a, chunk_size, **kw: seen.append(chunk_size) or real(*a, chunk_size=chunk_size, **kw))
    x = make_inputs(rule, 1, 10, 2, 4, 3, initial_state=True)
    o, _ = form(**x, chunk_size=10**6)
    o_ref, _ = rule.reference(**x)
    print(f"{form.__name__}: T=10, chunk_size=10**6 -> solver chunk {seen}; relative error {rel_err(o, o_ref):.1e}")
    assert seen == [64]
    assert rel_err(o, o_ref) < 1e-10


@pytest.mark.parametrize("form", [ops.parallel_delta_rule, ops.parallel_gated_delta_rule, ops.parallel_linear_attn,
                                  ops.chunk_delta_rule], ids=lambda f: f.__name__)
def test_quadratic_memory_is_refused_before_allocating(form):
    """A parallel form at T = 10**6 would allocate T x T score matrices (8e12 bytes): a named error."""
    rule = RULES["gated_delta"] if "gated" in form.__name__ else RULES["delta"] if "delta" in form.__name__ else RULES["linear_decay"]
    x = make_inputs(rule, 1, 10**6, 1, 1, 1)
    kwargs = dict(chunk_size=10**6) if form is ops.chunk_delta_rule else {}
    with pytest.raises(ValueError, match=rf"^{form.__name__}: .*T=1000000.* bytes"):
        form(**x, **kwargs)
