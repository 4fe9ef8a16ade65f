"""torch.compile: every chunk and recurrent op (and softmax attention) compiles with
``fullgraph=True`` -- no graph break -- forward and backward, with and without packed
``cu_seqlens`` (given ``max_seqlen``), and equals the eager op; the LM traces with 0
graph breaks; ``max_seqlen`` below a sequence's length is refused in eager mode.

The default run uses ``backend="aot_eager"`` (AOTAutograd's forward and backward
graphs, no code generation: the tracing is what can fail) on tiny float64 inputs, so
compiled and eager agree to ~1e-12. The inductor case (a tiny LM's training step) is
marked slow (with the fp16 autocast case). The chunk ops are torch.library custom ops (opaque to the compiler); the
recurrent forms are traced op by op, so their T is kept small.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from fastweights import ops
from fastweights.models import LM, LMConfig

from helpers import RULES, make_inputs, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

CU_SEQLENS = [0, 5, 17, 20]  # three packed sequences of 5, 12 and 3 tokens
MAX_SEQLEN = 12

OPS = {  # op -> rule of helpers.RULES (its inputs and options)
    "chunk_delta_rule": "delta_l2",
    "chunk_gated_delta_rule": "gated_delta",
    "chunk_linear_attn": "linear_elu_normalized",
    "recurrent_delta_rule": "delta_l2",
    "recurrent_gated_delta_rule": "gated_delta",
    "recurrent_linear_attn": "linear_elu_normalized",
    "softmax_attn": None,
}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (no cached graph or recompile limit carried over)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# The recurrent forms are unrolled token by token when traced: their compile time grows with T.
SHORT_CU_SEQLENS, SHORT_MAX_SEQLEN = [0, 2, 7, 8], 5


def _inputs(op_name, packed, seed):
    rule = RULES[OPS[op_name]] if OPS[op_name] else RULES["linear"]
    short = op_name.startswith("recurrent")
    cu, max_seqlen = (SHORT_CU_SEQLENS, SHORT_MAX_SEQLEN) if short else (CU_SEQLENS, MAX_SEQLEN)
    B, T = (1, cu[-1]) if packed else (2, 5 if short else 11)
    x = make_inputs(rule, B, T, 2, 4, 3, initial_state=not packed and OPS[op_name] is not None, seed=seed)
    options = dict(rule.options) if OPS[op_name] else {}
    if op_name.startswith("chunk"):
        options["chunk_size"] = 4  # T = 11 and the packed lengths are not multiples of 4
    if packed:
        options.update(cu_seqlens=torch.tensor(cu), max_seqlen=max_seqlen)
    return x, options


def _run(fn, x, options):
    """Forward and backward of ``(o·do).sum() + (h_T·dh).sum()``; returns (o, h_T, grads)."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in x.items()}
    o, h = fn(leaves, options)
    if isinstance(h, ops.KVCache):
        h = h.keys
    gen = torch.Generator().manual_seed(11)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (h * torch.randn(h.shape, generator=gen, dtype=h.dtype)).sum()
    loss.backward()
    return o, h, {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("packed", [False, True], ids=["batch", "cu_seqlens"])
@pytest.mark.parametrize("op_name", list(OPS))
def test_compiled_op_equals_eager_without_graph_breaks(op_name, packed):
    op = getattr(ops, op_name)
    x, options = _inputs(op_name, packed, seed=1)

    def call(inputs, options):
        return op(**inputs, **options, output_final_state=True)

    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)  # a graph break raises
    o_c, h_c, g_c = _run(compiled, x, options)
    o_e, h_e, g_e = _run(call, x, options)
    errors = {"o": rel_err(o_c, o_e), "h_T": rel_err(h_c, h_e)}
    errors.update({f"d{n}": rel_err(g_c[n], g_e[n]) for n in g_e})
    print(f"{op_name} ({'packed' if packed else 'batch'}): compiled vs eager, " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))
    assert all(e <= 1e-12 for e in errors.values()), errors


def _explain_breaks(fn, *args):
    explanation = torch._dynamo.explain(fn)(*args)
    reasons = [str(r.reason).splitlines()[0] for r in explanation.break_reasons]
    return explanation.graph_break_count, reasons


def test_cu_seqlens_without_max_seqlen_is_the_only_break():
    """Without the ``max_seqlen`` hint the padded length must be read from ``cu_seqlens``
    (documented: a graph break); with it there is none."""
    x, options = _inputs("chunk_delta_rule", packed=True, seed=2)
    no_hint = {n: v for n, v in options.items() if n != "max_seqlen"}
    counts = {}
    for name, opts in (("with max_seqlen", options), ("without", no_hint)):
        counts[name], reasons = _explain_breaks(lambda x: ops.chunk_delta_rule(**x, **opts)[0], x)
        print(f"chunk_delta_rule, cu_seqlens {name}: {counts[name]} graph break(s) {reasons}")
        torch._dynamo.reset()
    assert counts["with max_seqlen"] == 0 and counts["without"] >= 1


@pytest.mark.parametrize("mixer", ["deltanet", "hybrid"])
def test_lm_has_no_graph_breaks(mixer):
    mixers = ["deltanet", "gated_deltanet", "linear", "softmax"] if mixer == "hybrid" else "deltanet"
    config = LMConfig(vocab_size=31, d_model=16, n_layers=4 if mixer == "hybrid" else 2, n_heads=2,
                      mixer=mixers, chunk_size=8)
    model = LM(config)
    ids = torch.randint(0, 31, (2, 19))
    count, reasons = _explain_breaks(model, ids)
    print(f"LM ({mixer}): {count} graph break(s) {reasons}")
    assert count == 0, reasons


@pytest.mark.parametrize("op_name", ["chunk_delta_rule", "chunk_linear_attn", "softmax_attn"])
def test_max_seqlen_below_a_sequence_is_refused(op_name):
    op = getattr(ops, op_name)
    x, options = _inputs(op_name, packed=True, seed=3)
    options["max_seqlen"] = MAX_SEQLEN - 1
    with pytest.raises(ValueError, match=r"`max_seqlen`=11 is smaller than sequence 1 .*12 tokens"):
        op(**x, **options)


def test_cu_seqlens_cpu_is_checked_and_used():
    x, options = _inputs("chunk_gated_delta_rule", packed=True, seed=4)
    del options["max_seqlen"]
    o_ref, _ = ops.chunk_gated_delta_rule(**x, **options)
    o, _ = ops.chunk_gated_delta_rule(**x, **options, cu_seqlens_cpu=torch.tensor(CU_SEQLENS))
    assert rel_err(o, o_ref) == 0.0
    with pytest.raises(ValueError, match="`cu_seqlens_cpu` must be strictly increasing"):
        ops.chunk_gated_delta_rule(**x, **options, cu_seqlens_cpu=torch.tensor([0, 5, 5, 20]))
    with pytest.raises(ValueError, match="`max_seqlen` describes packed sequences and needs `cu_seqlens`"):
        ops.chunk_delta_rule(**make_inputs(RULES["delta"], 1, 8, 1, 4, 4), max_seqlen=8)


def _loss(model, ids):
    logits, _ = model(ids[:, :-1], return_cache=False)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=pytest.mark.slow)], ids=["bf16", "fp16"])
def test_compiled_lm_under_autocast_equals_eager(dtype):
    """Autocast and compile together: the traced graph keeps the ops' fp32 regions
    (autocast off inside them), so compiled and eager give the same loss and gradients."""
    config = LMConfig(vocab_size=31, d_model=16, n_layers=4, n_heads=2, mixer=["deltanet", "gated_deltanet", "linear", "softmax"],
                      chunk_size=8)
    model = LM(config)
    ids = torch.randint(0, 31, (2, 20))
    results = {}
    for name, fn in (("eager", _loss), ("compiled", torch.compile(_loss, backend="aot_eager", fullgraph=True))):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype):
            loss = fn(model, ids)
        loss.backward()
        results[name] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    worst = max(rel_err(g, results["eager"][1][n]) for n, g in results["compiled"][1].items())
    print(f"{dtype}: loss eager {results['eager'][0]:.6f}, compiled {results['compiled'][0]:.6f}; worst gradient {worst:.1e}")
    assert results["compiled"][0] == pytest.approx(results["eager"][0], rel=1e-6)
    assert worst <= 1e-5




@pytest.mark.slow
def test_inductor_training_step_of_a_tiny_lm():
    """One training step compiled by inductor (fullgraph) equals the eager step: loss and every gradient."""
    torch.manual_seed(0)
    config = LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mixer=["deltanet", "softmax"], chunk_size=16)
    eager, compiled_model = LM(config), LM(config)
    compiled_model.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 64, (2, 49))
    loss_c = torch.compile(_loss, backend="inductor", fullgraph=True)(compiled_model, ids)
    loss_e = _loss(eager, ids)
    loss_c.backward()
    loss_e.backward()
    grads = {n: rel_err(p.grad, dict(eager.named_parameters())[n].grad) for n, p in compiled_model.named_parameters()}
    worst = max(grads, key=grads.get)
    print(f"inductor vs eager: loss {loss_c.item():.6f} vs {loss_e.item():.6f}; worst gradient {worst} {grads[worst]:.1e}")
    assert abs(loss_c.item() - loss_e.item()) <= 1e-5
    assert grads[worst] <= 1e-4
