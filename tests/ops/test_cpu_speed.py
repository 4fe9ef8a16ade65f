"""The CPU fast paths' promises: bf16 products within 2× of the same-precision recurrence,
bitwise determinism, and batch invariance (a sequence's result does not depend on what
it is batched or packed with).

Small shapes only: the speed targets live in ``fastweights bench`` (BENCHMARKS.md).
"""

import pytest
import torch

from fastweights import ops
from helpers import RULES, bf16_op_inputs, call, make_inputs, rel_err

DELTA_RULES = ["delta", "gated_delta"]
# the mode's bf16 kernels on every ISA path, also one with no bf16 unit (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("bf16_kernels")


def _low(x, dtype):
    return {n: (t.to(dtype) if n != "initial_state" else t.float()) for n, t in x.items()}


@pytest.mark.parametrize("rule_name", DELTA_RULES)
@pytest.mark.parametrize("T,K,V,h0", [(1, 32, 40, True), (63, 32, 40, False), (100, 60, 32, True), (1000, 16, 24, True)])
def test_bf16_products_within_2x_of_the_recurrence(rule_name, T, K, V, h0, one_thread):
    """Under ``ops.bf16_products()`` both forms feed their products bf16 operands; against the
    float64 recurrence on the same bf16 inputs the chunk form's error (output and fp32 final
    state) is at most 2× the recurrent form's. Without the mode the same call is the fp32 path."""
    rule = RULES[rule_name]
    x = _low(make_inputs(rule, 2, T, 2, K, V, initial_state=h0, seed=T), torch.bfloat16)
    exact = {n: t.double() for n, t in x.items()}
    o_ref, h_ref = call(rule.reference, rule, exact, output_final_state=True)
    with torch.no_grad():
        o32, h32 = call(rule.forms[2], rule, x, output_final_state=True, chunk_size=32)
        with ops.bf16_products():
            assert ops.bf16_products_enabled()
            o, h = call(rule.forms[2], rule, x, output_final_state=True, chunk_size=32)
            o_rec, h_rec = call(rule.reference, rule, x, output_final_state=True)
    assert not ops.bf16_products_enabled()
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32
    for name, fast, rec, ref in (("o", o, o_rec, o_ref), ("h_T", h, h_rec, h_ref)):
        e_fast, e_rec = rel_err(fast, ref), rel_err(rec, ref)
        print(f"{name}: chunk {e_fast:.2e}, recurrent {e_rec:.2e} (bf16 products), fp32 chunk {rel_err(o32 if name == 'o' else h32, ref):.2e}")
        assert e_fast <= 2.0 * e_rec, f"{name}: chunk {e_fast:.2e} > 2 x recurrent {e_rec:.2e}"
    if T > 1:  # the mode really changes the arithmetic: the state is no longer fp32-accurate
        assert rel_err(h, h_ref) > 10 * rel_err(h32, h_ref)


@pytest.mark.parametrize("per_token", [[0.05, 3.0], [1.8, 0.01], [0.0, 1.95]], ids=["weak-strong", "edge-weak", "none-over"])
def test_bf16_products_gate_factored_and_direct_chunks(per_token, one_thread):
    """The bf16 forward factors the gate out of its products (e^{±b} applied to rows) in a chunk
    whose cumulative log decay stays within ±60, and applies it directly elsewhere; chunks of both
    kinds in one sequence (the state's deferred decay handed across), decays next to the bound
    (|b| up to 57.6 and 62.4 in a chunk of 32), and no decay at all: within 2× of the recurrence."""
    rule = RULES["gated_delta"]
    x = _low(make_inputs(rule, 2, 200, 2, 32, 40, initial_state=True, seed=7), torch.bfloat16)
    chunk = torch.arange(200) // 32
    rate = torch.tensor(per_token)[chunk % 2]  # alternate chunks: the two regimes
    x["g"] = -(rate[None, :, None] * (0.9 + 0.2 * torch.rand(2, 200, 2))).to(x["g"].dtype)
    exact = {n: t.double() for n, t in x.items()}
    o_ref, h_ref = call(rule.reference, rule, exact, output_final_state=True)
    with torch.no_grad(), ops.bf16_products():
        o, h = call(rule.forms[2], rule, x, output_final_state=True, chunk_size=32)
        o_rec, h_rec = call(rule.reference, rule, x, output_final_state=True)
    for name, fast, rec, ref in (("o", o, o_rec, o_ref), ("h_T", h, h_rec, h_ref)):
        e_fast, e_rec = rel_err(fast, ref), rel_err(rec, ref)
        print(f"{name}: chunk {e_fast:.2e}, recurrent {e_rec:.2e}")
        assert torch.isfinite(fast).all()
        assert e_fast <= 2.0 * e_rec, f"{name}: chunk {e_fast:.2e} > 2 x recurrent {e_rec:.2e}"


@pytest.mark.parametrize("rule_name", DELTA_RULES)
def test_bf16_products_leave_training_and_fp32_alone(rule_name, one_thread):
    """A forward that a backward may follow, and fp32 inputs, compute in fp32 under the mode."""
    rule = RULES[rule_name]
    x = make_inputs(rule, 1, 70, 2, 16, 24, initial_state=True, seed=1)
    for dtype in (torch.bfloat16, torch.float32):
        leaves = {n: t.detach().clone().requires_grad_(True) for n, t in _low(x, dtype).items()}
        o_plain, h_plain = call(rule.forms[2], rule, leaves, output_final_state=True)
        with ops.bf16_products():
            o_mode, h_mode = call(rule.forms[2], rule, leaves, output_final_state=True)
        assert torch.equal(o_plain, o_mode) and torch.equal(h_plain, h_mode)
    with ops.bf16_products(), torch.no_grad():
        o_mode, _ = call(rule.forms[2], rule, _low(x, torch.float32), output_final_state=True)
    assert torch.equal(o_mode, call(rule.forms[2], rule, _low(x, torch.float32))[0].detach())


def test_bf16_products_switch_checks_its_argument():
    with pytest.raises(TypeError, match="enabled"):
        ops.set_bf16_products("yes")
    ops.set_bf16_products(True)
    try:
        assert ops.bf16_products_enabled()
    finally:
        ops.set_bf16_products(False)


def _forward_and_grads(rule, x, **kwargs):
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, h = call(rule.forms[2], rule, leaves, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(9)
    (o.float() * torch.randn(o.shape, generator=gen)).sum().add(h.sum()).backward()
    return [o, h] + [leaves[n].grad for n in sorted(leaves)]


@pytest.mark.parametrize("rule_name", DELTA_RULES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_runs_are_bitwise_equal(rule_name, dtype, one_thread):
    rule = RULES[rule_name]
    x = _low(make_inputs(rule, 2, 100, 2, 32, 40, initial_state=True, seed=4), dtype)
    first, second = _forward_and_grads(rule, x), _forward_and_grads(rule, x)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    if dtype == torch.bfloat16:
        with torch.no_grad(), ops.bf16_products():
            runs = [call(rule.forms[2], rule, x, output_final_state=True) for _ in range(2)]
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("rule_name", DELTA_RULES)
@pytest.mark.parametrize("mode", ["fp32", "bf16", "bf16_products"])
def test_a_sequence_alone_in_a_batch_and_packed_is_bitwise_the_same(rule_name, mode):
    """Sequence 0 (T = 20) alone, in a batch of 8 (same length, other contents), and packed with
    7 others of uneven lengths (3 ... 150) through cu_seqlens: the same output and final state, bit for bit."""
    rule = RULES[rule_name]
    dtype = torch.float32 if mode == "fp32" else torch.bfloat16
    T, H, K, V = 20, 2, 32, 40
    batch = _low(make_inputs(rule, 8, T, H, K, V, initial_state=True, seed=11), dtype)
    lengths = [T, 3, 150, 64, 65, 1, 90, 20]
    packed_parts = [make_inputs(rule, 1, n, H, K, V, initial_state=True, seed=20 + i) for i, n in enumerate(lengths)]
    packed_parts = [_low(p, dtype) for p in packed_parts]
    for name in batch:  # sequence 0 of the packed batch is sequence 0 of the batch
        packed_parts[0][name] = batch[name][:1]
    packed = {n: torch.cat([p[n] for p in packed_parts], dim=0 if n == "initial_state" else 1) for n in batch}
    cu = torch.tensor([0] + lengths).cumsum(0)
    alone = {n: t[:1] for n, t in batch.items()}
    with torch.no_grad(), ops.bf16_products(mode == "bf16_products"):
        o1, h1 = call(rule.forms[2], rule, alone, output_final_state=True)
        o8, h8 = call(rule.forms[2], rule, batch, output_final_state=True)
        op, hp = call(rule.forms[2], rule, packed, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(o1, o8[:1]) and torch.equal(h1, h8[:1]), "alone vs batch of 8"
    assert torch.equal(o1, op[:, :T]) and torch.equal(h1, hp[:1]), "alone vs packed"


@pytest.mark.parametrize("op_name", ["chunk_gated_delta_rule", "chunk_kda"])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_the_mode_is_leave_where_bf16_products_do_not_pay(op_name, backend, monkeypatch, one_thread):
    """On a CPU where bf16 products do not pay (``cpu.bf16_unit()`` False: no bf16 unit, so a bf16
    product is a rounded fp32 one, slower and less accurate), a chunk op under ``bf16_products()``
    gives bitwise its result without the mode, on the PyTorch path and the compiled one; where
    they pay, bf16 products (another output; KDA's PyTorch path computes the mode in fp32 anyway)."""
    from fastweights.ops import cpu as cpu_kernels

    x = bf16_op_inputs(op_name)
    op = getattr(ops, op_name)
    for pays in (False, True):
        monkeypatch.setattr(cpu_kernels, "bf16_unit", lambda: pays)
        with torch.no_grad():
            o, h = op(**x, output_final_state=True, backend=backend)
            with ops.bf16_products():
                o_mode, h_mode = op(**x, output_final_state=True, backend=backend)
        print(f"pays {pays}: o equal {torch.equal(o_mode, o)}, h_T rel. diff {rel_err(h_mode, h):.1e}")
        if pays and not (op_name == "chunk_kda" and backend == "torch"):  # KDA's PyTorch path has no bf16 products
            assert not torch.equal(o_mode, o) and rel_err(h_mode, h) > 1e-5
        else:
            assert torch.equal(o_mode, o) and torch.equal(h_mode, h)
