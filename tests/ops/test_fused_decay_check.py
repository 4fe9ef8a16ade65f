"""The input checks made inside KDA's compiled chunk kernel (``chunk_kda.cpp``), which GDN-2 shares.

``chunk_kda`` and ``chunk_gdn2`` leave the checks of the per-channel log decay g (finite, <= 0) to
their CPU solver (``OpSpec.fused_decay_check``), and ``chunk_kda`` also the finite check of q, k, v
(``OpSpec.fused_finite_check``): the kernel counts what it needs on the rows it gathers anyway, and
the same ValueError as the front end's check is raised. Each case is run against the PyTorch path's
message (``backend="torch"``: the front end's checks), with a record of which inputs the front end
checked itself, so a test that silently ran the front end's check fails.
"""

import pytest
import torch
import torch.nn.functional as F

from fastweights import ops
from fastweights.ops import _checks
from fastweights.ops import cpu as cpu_kernels

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="the compiled CPU kernels are not built here")
pytestmark = [needs_kernels, pytest.mark.usefixtures("one_thread")]


@pytest.fixture
def front_end_checked(monkeypatch):
    """The names of the inputs the front end's finite and range checks looked at."""
    names = []
    finite, in_range, both = _checks._check_finite, _checks._check_range, _checks._check_finite_in_range

    def record_finite(op, name, t):
        names.append(name)
        return finite(op, name, t)

    def record_range(op, t, low, high, rule, hint=""):
        names.append(rule.split("`")[1])
        return in_range(op, t, low, high, rule, hint)

    def record_both(op, name, t, *args):
        names.append(name)
        return both(op, name, t, *args)

    monkeypatch.setattr(_checks, "_check_finite", record_finite)
    monkeypatch.setattr(_checks, "_check_finite_in_range", record_both)
    monkeypatch.setattr(_checks, "_check_range", record_range)
    return names


def inputs(family, T=50, H=2, K=12, V=10, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=rand(1, T, H, K), k=F.normalize(rand(1, T, H, K), dim=-1), v=rand(1, T, H, V),
             g=-torch.rand(1, T, H, K, generator=gen, dtype=torch.float64))
    if family == "kda":
        x["beta"] = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    else:
        x.update(b=2 * torch.rand(1, T, H, K, generator=gen, dtype=torch.float64),
                 w=torch.rand(1, T, H, V, generator=gen, dtype=torch.float64))
    return {n: t.to(dtype) for n, t in x.items()}


def spoil(x, name, where, value):
    x = dict(x)
    x[name] = x[name].clone()
    for idx in where:
        x[name][idx] = value
    return x


OPS = {"kda": ops.chunk_kda, "gdn2": ops.chunk_gdn2}


def message(family, x, backend, grad=False, **kw):
    leaves = {n: t.clone().requires_grad_(grad) for n, t in x.items()}
    with pytest.raises(ValueError) as info:
        OPS[family](**leaves, chunk_size=16, backend=backend, **kw)
    return str(info.value)


BAD_G = {  # entries, value
    "nan": ([(0, 3, 1, 5), (0, 49, 0, 0)], float("nan")),
    "inf": ([(0, 17, 1, 2)], float("inf")),
    "neg-inf": ([(0, 0, 0, 0), (0, 31, 1, 9), (0, 32, 1, 9)], float("-inf")),
    "positive": ([(0, 20, 1, 3), (0, 40, 0, 7)], 0.25),
}


@pytest.mark.parametrize("family", ["kda", "gdn2"])
@pytest.mark.parametrize("case", sorted(BAD_G))
@pytest.mark.parametrize("dtype,grad", [(torch.float32, False), (torch.float32, True), (torch.float64, False),
                                        (torch.float64, True)], ids=["fp32", "fp32-grad", "fp64", "fp64-grad"])
def test_the_kernel_raises_the_front_ends_error_for_g(family, case, dtype, grad, front_end_checked):
    where, value = BAD_G[case]
    x = spoil(inputs(family, dtype=dtype), "g", where, value)
    want = message(family, x, "torch", grad)
    assert "g" in front_end_checked
    front_end_checked.clear()
    got = message(family, x, "cpu", grad)
    print(got)
    assert got == want
    assert "g" not in front_end_checked  # the kernel's counts made it
    if case == "positive":
        assert "`g` (a per-key-channel log decay) must be <= 0, got values up to 0.25" in got
    else:
        assert f"`g` contains {len(where)} non-finite value(s)" in got


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("dtype,grad", [(torch.float32, False), (torch.float64, True)], ids=["fp32", "fp64-grad"])
def test_kda_kernel_raises_the_front_ends_error_for_q_k_v(name, dtype, grad, front_end_checked):
    x = spoil(inputs("kda", dtype=dtype), name, [(0, 5, 0, 1), (0, 44, 1, 0)], float("nan"))
    want = message("kda", x, "torch", grad)
    front_end_checked.clear()
    got = message("kda", x, "cpu", grad)
    assert f"`{name}` contains 2 non-finite value(s)" in want and got == want
    assert not {"q", "k", "v", "g"} & set(front_end_checked)


def test_with_qk_norm_the_front_end_checks_q_k_v_and_the_kernel_g(front_end_checked):
    """q and k are normalised before the solver sees them: their check stays in the front end; g's does not."""
    x = spoil(inputs("kda"), "g", [(0, 9, 0, 0)], float("nan"))
    got = message("kda", x, "cpu", use_qk_l2norm_in_kernel=True)
    assert "`g` contains 1 non-finite value(s)" in got
    assert {"q", "k", "v"} <= set(front_end_checked) and "g" not in front_end_checked


@pytest.mark.parametrize("family", ["kda", "gdn2"])
def test_packed_sequences_count_every_bad_entry_once(family):
    """Three packed sequences (one of length 1), padded inside the solver: the padding adds nothing."""
    x = spoil(inputs(family, T=61), "g", [(0, 0, 0, 1), (0, 60, 1, 0), (0, 7, 1, 11)], float("inf"))
    cu = torch.tensor([0, 1, 20, 61])
    want, got = message(family, x, "torch", cu_seqlens=cu), message(family, x, "cpu", cu_seqlens=cu)
    assert "`g` contains 3 non-finite value(s)" in want and got == want


@pytest.mark.parametrize("family", ["kda", "gdn2"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_switches(family, backend):
    """finite_checks(False): NaN and ±Inf in g pass (a +Inf still breaks the range rule, as amax sees
    it); value_checks(False): positive entries pass; NaN among positive entries with only the range
    check on: no error, as ``amax`` (NaN) compares."""
    clean = inputs(family)
    nan = spoil(clean, "g", [(0, 30, 0, 0)], float("nan"))
    with ops.finite_checks(False), torch.no_grad():
        OPS[family](**spoil(nan, "g", [(0, 31, 0, 0)], float("-inf")), chunk_size=16, backend=backend)
        OPS[family](**spoil(nan, "g", [(0, 12, 1, 1)], 0.5), chunk_size=16, backend=backend)
        with pytest.raises(ValueError, match="must be <= 0, got values up to inf"):
            OPS[family](**spoil(clean, "g", [(0, 12, 1, 1)], float("inf")), chunk_size=16, backend=backend)
    with ops.value_checks(False), torch.no_grad():
        OPS[family](**spoil(clean, "g", [(0, 12, 1, 1)], 0.5), chunk_size=16, backend=backend)
        with pytest.raises(ValueError, match="`g` contains 1 non-finite"):
            OPS[family](**nan, chunk_size=16, backend=backend)


@pytest.mark.parametrize("family", ["kda", "gdn2"])
def test_g_of_another_dtype_keeps_the_front_ends_check(family, front_end_checked):
    """A float64 g with fp32 q is cast before the solver (1e-50 would round to 0): the front end checks it."""
    x = inputs(family)
    x["g"] = spoil({"g": x["g"].double()}, "g", [(0, 3, 0, 0)], 1e-50)["g"]
    want = message(family, x, "torch")
    got = message(family, x, "cpu")
    assert "got values up to 1e-50" in want and got == want and "g" in front_end_checked


@pytest.mark.parametrize("family", ["kda", "gdn2"])
def test_intermediate_states_keep_the_front_ends_check(family, front_end_checked):
    """With the states of every chunk asked for, the solver runs block by block: the front end checks g once."""
    x = spoil(inputs(family), "g", [(0, 3, 0, 0), (0, 45, 1, 1)], float("nan"))
    got = message(family, x, "cpu", return_intermediate_states=True)
    assert "`g` contains 2 non-finite value(s)" in got and "g" in front_end_checked


@pytest.mark.parametrize("family", ["kda", "gdn2"])
@pytest.mark.parametrize("grad", [False, True])
def test_clean_inputs_give_the_same_output_with_the_checks_in_the_kernel(family, grad):
    x = inputs(family, T=70)
    on = OPS[family](**{n: t.clone().requires_grad_(grad) for n, t in x.items()}, chunk_size=16, output_final_state=True)
    with ops.finite_checks(False), ops.value_checks(False):
        off = OPS[family](**{n: t.clone().requires_grad_(grad) for n, t in x.items()}, chunk_size=16,
                          output_final_state=True)
    assert all(torch.equal(a, b) for a, b in zip(on, off))
