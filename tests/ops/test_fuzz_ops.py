"""Property-based tests of every linear/delta op: random shapes (0 and 1 included),
dtypes, options, packed sequences, bad values. Every case either equals the float64 recurrence
written out below (independent of the library's front end) or raises the named error the
case calls for.

Two profiles: ``test_ops_fuzz_fast`` in the default run (a few hundred cases, derandomized so
every run draws the same ones) and ``test_ops_fuzz_long`` (marked slow, thousands of cases).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis", reason="the property-based suite needs hypothesis (the dev extra)")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastweights import ops
from helpers import chunk_option

FAST_CASES, LONG_CASES = 300, 3000
FORMS = {
    "linear": (ops.recurrent_linear_attn, ops.parallel_linear_attn, ops.chunk_linear_attn),
    "delta": (ops.recurrent_delta_rule, ops.parallel_delta_rule, ops.chunk_delta_rule),
    "gated_delta": (ops.recurrent_gated_delta_rule, ops.parallel_gated_delta_rule, ops.chunk_gated_delta_rule),
}
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-4, torch.bfloat16: 3e-2}
COUNTS = {"cases": 0, "equal": 0, "refused": 0}  # read by a session that wants the totals


def reference(rule, q, k, v, beta, g, h0, scale, normalize, eps=1e-6):
    """The recurrences of docs/design.md, token by token in float64 (one sequence batch ``[B, T, H, ·]``)."""
    q, k, v = q.double(), k.double(), v.double()
    if normalize:  # elu+1 features, and the normalizer carried as a value column of ones
        q, k = (torch.where(x > 0, x + 1.0, torch.exp(torch.clamp(x, max=0.0))) for x in (q, k))
        v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    B, T, H, K = q.shape
    h = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64) if h0 is None else h0.double().clone()
    outputs = []
    for t in range(T):
        if g is not None:
            h = h * torch.exp(g[:, t].double())[..., None, None]
        k_t, v_t = k[:, t], v[:, t]
        if beta is not None:  # the delta rule writes the correction v − hᵀk, scaled by β
            v_t = beta[:, t].double()[..., None] * (v_t - torch.einsum("bhkv,bhk->bhv", h, k_t))
        h = h + k_t[..., :, None] * v_t[..., None, :]
        outputs.append(scale * torch.einsum("bhkv,bhk->bhv", h, q[:, t]))
    o = torch.stack(outputs, dim=1) if outputs else v.new_zeros(B, 0, H, v.shape[-1])
    if normalize:
        o = o[..., :-1] / (o[..., -1:] + eps)
    return o, h


@st.composite
def cases(draw):
    """One call: the rule, the form, the inputs, and at most one deliberate fault."""
    rule = draw(st.sampled_from(sorted(FORMS)))
    form = draw(st.sampled_from(FORMS[rule]))
    dtype = draw(st.sampled_from([torch.float64, torch.float64, torch.float32, torch.bfloat16]))
    packed = draw(st.booleans()) and draw(st.booleans())
    B = 1 if packed else draw(st.integers(1, 3))
    T = draw(st.integers(1 if packed else 0, 40))
    H, K, V = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    case = dict(rule=rule, form=form, dtype=dtype, B=B, T=T, H=H, K=K, V=V, seed=draw(st.integers(0, 2**31 - 1)),
                decay=rule == "gated_delta" or (rule == "linear" and draw(st.booleans())),
                normalize=rule == "linear" and draw(st.booleans()),
                initial_state=draw(st.booleans()), chunk_size=draw(st.sampled_from([1, 2, 3, 7, 16, 64, 100])),
                scale=draw(st.sampled_from([None, None, 0.3, 1.0])), neg_eigval=rule != "linear" and draw(st.booleans()),
                cu_seqlens=None, fault=None)
    if packed:
        cuts = sorted(draw(st.sets(st.integers(1, T - 1), max_size=min(4, T - 1)))) if T > 1 else []
        case["cu_seqlens"] = [0, *cuts, T]
    faults = [None] * 16 + ["chunk-none", "chunk-zero", "chunk-float", "scale-nan", "scale-negative", "size-zero",
                           "v-size-zero", "nan"]
    if rule != "linear":
        faults += ["beta-range"]
    if case["decay"]:
        faults += ["g-positive"]
    if not packed:
        faults += ["packed-batch"] if B > 1 else []
    case["fault"] = draw(st.sampled_from(faults))
    if case["fault"] == "size-zero":
        case[draw(st.sampled_from(["B", "H", "K"]))] = 0
        case["cu_seqlens"] = None
    if case["fault"] == "v-size-zero":
        case["V"] = 0
    if case["fault"] == "nan" and T == 0:
        case["fault"] = None
    return case


def build(case):
    """The op's keyword arguments and the error the case must raise (``None``: it must be exact)."""
    gen = torch.Generator().manual_seed(case["seed"])
    B, T, H, K, V, dtype = (case[n] for n in ("B", "T", "H", "K", "V", "dtype"))

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    kwargs = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V))
    if case["rule"] != "linear":
        kwargs["beta"] = torch.rand(B, T, H, generator=gen, dtype=torch.float64) * (2.0 if case["neg_eigval"] else 1.0)
        if case["neg_eigval"]:
            kwargs["allow_neg_eigval"] = True
    if case["decay"]:
        kwargs["g"] = F.logsigmoid(rand(B, T, H) + 2.0)
    if case["normalize"]:
        kwargs.update(feature_map="elu", normalize=True)
    n = B if case["cu_seqlens"] is None else len(case["cu_seqlens"]) - 1
    if case["initial_state"]:
        h0 = rand(n, H, K, V + int(case["normalize"]))
        if case["normalize"]:
            h0[..., -1] = h0[..., -1].abs() + 1.0  # a normalizer made of positive features
        kwargs["initial_state"] = h0
    for name in ("q", "k", "v", "beta", "g"):
        if name in kwargs:
            kwargs[name] = kwargs[name].to(dtype)
    if "initial_state" in kwargs and dtype != torch.float64:
        kwargs["initial_state"] = kwargs["initial_state"].float()
    if case["cu_seqlens"] is not None:
        kwargs["cu_seqlens"] = torch.tensor(case["cu_seqlens"])
    kwargs.update(scale=case["scale"], output_final_state=True, **chunk_option(case["form"], case["chunk_size"]))

    fault, error = case["fault"], None
    if fault in ("chunk-none", "chunk-zero", "chunk-float") and "chunk_size" not in kwargs:
        fault = None  # the recurrent and parallel forms have no chunk length to spoil
    if fault == "chunk-none":
        kwargs["chunk_size"] = None  # valid: the chunk-length policy (default_chunk_size) decides
    elif fault == "chunk-zero":
        kwargs["chunk_size"], error = 0, (ValueError, r"`chunk_size` must be positive, got 0")
    elif fault == "chunk-float":
        kwargs["chunk_size"], error = 16.0, (TypeError, r"`chunk_size` must be a positive int, got 16.0")
    elif fault == "scale-nan":
        kwargs["scale"], error = math.nan, (ValueError, r"`scale` must be a finite number > 0, got nan")
    elif fault == "scale-negative":
        kwargs["scale"], error = -0.5, (ValueError, r"`scale` must be a finite number > 0, got -0.5")
    elif fault == "size-zero":
        error = (ValueError, r"`q` must have sizes B, H, K > 0 \(only T may be 0\)")
    elif fault == "v-size-zero":
        error = (ValueError, r"`v` must have size V > 0")
    elif fault == "nan" and T > 0 and B * H * V > 0:
        kwargs["v"] = kwargs["v"].clone()
        kwargs["v"][0, T // 2, 0, 0] = math.nan
        error = (ValueError, r"`v` contains 1 non-finite value\(s\)")
    elif fault == "beta-range" and T > 0 and B * H > 0:
        kwargs["beta"] = kwargs["beta"].clone()
        kwargs["beta"][0, T - 1, 0] = 2.5 if case["neg_eigval"] else 1.5
        error = (ValueError, r"`beta` must lie in \[0, [12]\]")
    elif fault == "g-positive" and T > 0 and B * H > 0:
        kwargs["g"] = kwargs["g"].clone()
        kwargs["g"][0, 0, 0] = 0.25
        error = (ValueError, r"`g` \(the log decay\) must be <= 0")
    elif fault == "packed-batch" and T > 1:
        kwargs["cu_seqlens"], kwargs["initial_state"] = torch.tensor([0, 1, T]), None
        error = (ValueError, r"`cu_seqlens` requires batch size 1")
    return kwargs, error


def check(case):
    form = case["form"]
    kwargs, error = build(case)
    COUNTS["cases"] += 1
    if error is not None:
        with pytest.raises(error[0], match=rf"^{form.__name__}: .*{error[1]}"):
            form(**kwargs)
        COUNTS["refused"] += 1
        return
    o, h = form(**kwargs)
    K, T = case["K"], case["T"]
    scale = K ** -0.5 if case["scale"] is None else case["scale"]
    cu = case["cu_seqlens"] or [0, T]
    h0 = kwargs.get("initial_state")
    pieces_o, pieces_h = [], []
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):  # packed sequences: each one on its own
        rows = slice(None) if case["cu_seqlens"] is None else slice(0, 1)
        take = lambda x: None if x is None else x[rows, a:b]
        o_ref, h_ref = reference(case["rule"], take(kwargs["q"]), take(kwargs["k"]), take(kwargs["v"]),
                                 take(kwargs.get("beta")), take(kwargs.get("g")),
                                 None if h0 is None else (h0 if case["cu_seqlens"] is None else h0[i:i + 1]),
                                 scale, case["normalize"])
        pieces_o.append(o_ref)
        pieces_h.append(h_ref)
    o_ref, h_ref = torch.cat(pieces_o, dim=1), torch.cat(pieces_h, dim=0)
    assert o.shape == o_ref.shape and o.dtype == case["dtype"]
    assert h.shape == h_ref.shape and h.dtype == (torch.float64 if case["dtype"] == torch.float64 else torch.float32)
    if h0 is not None:
        assert h.data_ptr() != h0.data_ptr(), "the final state must never be the caller's tensor"
    tol = TOLERANCE[case["dtype"]]
    for name, got, want in (("o", o, o_ref), ("h", h, h_ref)):
        err = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item() if want.numel() else 0.0
        assert err <= tol or (got.double() - want).abs().max().item() <= tol, \
            f"{form.__name__} {name}: relative error {err:.2e} > {tol:.0e} for {case}"
    COUNTS["equal"] += 1


COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=FAST_CASES, **COMMON)
@given(cases())
def test_ops_fuzz_fast(case):
    check(case)


@pytest.mark.slow
@settings(max_examples=LONG_CASES, **COMMON)
@given(cases())
def test_ops_fuzz_long(case):
    check(case)



# -- compiled ops: the same cases through torch.compile ------------------------------------------

COMPILED_FAST, COMPILED_LONG = 4, 200
VALUE_FAULTS = {"nan": "v", "beta-range": "beta", "g-positive": "g"}  # checked by asserts the compiler keeps


@st.composite
def compiled_cases(draw):
    case = draw(cases())
    case["form"] = draw(st.sampled_from([f for f in FORMS[case["rule"]] if not f.__name__.startswith("parallel")]))
    if case["T"] > 12:  # the recurrent forms are unrolled when traced: keep T small
        case["T"], case["cu_seqlens"] = case["T"] % 12 + 1, None
        case["B"] = max(case["B"], 1)
        if case["fault"] == "packed-batch" and case["B"] == 1:
            case["fault"] = None
    return case


def check_compiled(case):
    """The op compiled (AOTAutograd, no code generation) equals the reference; a bad value fails
    as a RuntimeError naming the op and the argument, other faults as in eager mode."""
    import torch._dynamo

    form = case["form"]
    kwargs, error = build(case)
    torch._dynamo.reset()
    compiled = torch.compile(form, backend="aot_eager")
    if error is not None:
        if case["fault"] in VALUE_FAULTS:
            error = (RuntimeError, rf"`{VALUE_FAULTS[case['fault']]}`")
        with pytest.raises(error[0], match=rf"{form.__name__}.*{error[1]}"):
            compiled(**kwargs)
        return
    o, h = compiled(**kwargs)
    o_e, h_e = form(**kwargs)
    tol = TOLERANCE[case["dtype"]]
    for got, want in ((o, o_e), (h, h_e)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert (got.double() - want.double()).abs().max().item() <= tol if got.numel() else True
    check(case)  # and the eager op against the float64 recurrence


@settings(max_examples=COMPILED_FAST, **COMMON)
@given(compiled_cases())
def test_compiled_ops_fuzz_fast(case):
    check_compiled(case)


@pytest.mark.slow
@settings(max_examples=COMPILED_LONG, **COMMON)
@given(compiled_cases())
def test_compiled_ops_fuzz_long(case):
    check_compiled(case)


# -- keyword arguments: unknown names refused, pass-through names inert --------------------------

KWARG_OPS = FORMS["delta"] + FORMS["gated_delta"]


def _mutations(name: str):
    """Typos of ``name``: a letter dropped, doubled, or two neighbours swapped."""
    out = {name[:i] + name[i + 1:] for i in range(len(name))} | {name[:i] + name[i] + name[i:] for i in range(len(name))}
    out |= {name[:i] + name[i + 1] + name[i] + name[i + 2:] for i in range(len(name) - 1)}
    return sorted(out - {name})


@st.composite
def kwarg_cases(draw):
    import inspect

    from fastweights.ops._fla_compat import PASS_THROUGH

    form = draw(st.sampled_from(KWARG_OPS))
    real = [p for p in inspect.signature(inspect.unwrap(form)).parameters if p not in ("extra", "kwargs")]
    kind = draw(st.sampled_from(["typo", "pass-through", "random"]))
    if kind == "typo":
        name = draw(st.sampled_from(_mutations(draw(st.sampled_from([r for r in real if len(r) > 4])))))
    elif kind == "pass-through":
        name = draw(st.sampled_from(sorted(PASS_THROUGH)))
    else:
        name = draw(st.from_regex(r"[a-z][a-z_]{2,15}", fullmatch=True))
    return form, name, real


def check_kwarg(form, name, real):
    import difflib

    from fastweights.ops._fla_compat import _PENDING, _REFUSED, PASS_THROUGH

    gen = torch.Generator().manual_seed(0)
    q, v = torch.randn(1, 6, 2, 4, generator=gen, dtype=torch.float64), torch.randn(1, 6, 2, 3, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(1, 6, 2, 4, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(1, 6, 2, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, 6, 2, generator=gen, dtype=torch.float64)
    args = (q, k, v, g, beta) if "gated" in form.__name__ else (q, k, v, beta)
    if name in real or name in _REFUSED or name in _PENDING or name.startswith("state_v") \
            or name == "transpose_state_layout":
        return  # a real, refused-when-on or pending argument: another test's business
    if name in PASS_THROUGH:
        assert torch.equal(form(*args, **{name: 1})[0], form(*args)[0])
        return
    with pytest.raises(TypeError, match=rf"unexpected keyword argument `{name}`") as e:
        form(*args, **{name: 1})
    close = difflib.get_close_matches(name, real, n=1, cutoff=0.75)
    if close:
        assert f"did you mean `{close[0]}`" in str(e.value)


@settings(max_examples=60, **COMMON)
@given(kwarg_cases())
def test_keyword_arguments_fuzz(case):
    check_kwarg(*case)
