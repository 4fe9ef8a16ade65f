"""torch.compile: every chunk and recurrent op (and softmax attention) compiles with
``fullgraph=True`` -- no graph break -- forward and backward, with and without packed
``cu_seqlens`` (given ``max_seqlen``), and equals the eager op; the LM traces with 0
graph breaks, also with ``attention_mask`` (left padding) and with model-level
``cu_seqlens`` plus ``max_seqlen`` (without the hint: exactly one break, the read of the
offsets), and equals the eager LM there; ``max_seqlen`` below a sequence's length is
refused in eager mode. Break counts come from ``torch._dynamo.explain``:
``fullgraph=True`` alone traces some data-dependent shapes without reporting a break.

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




# -- the LM's padded and packed paths ---------------------------------------------------------
#
# A mask's packed token count depends on its values, so under compile (with return_cache=False)
# the LM moves each row's real tokens to its front instead (static shapes); model-level
# cu_seqlens with max_seqlen reach the ops without any read of the offsets.

HYBRID = ["deltanet", "gated_deltanet", "linear", "softmax"]
PADDED_MASK = [[0] * 5 + [1] * 14, [1] * 19, [0] * 11 + [1] * 8]  # left padding; one row without any
LM_PATHS = {
    "attention_mask": lambda: (torch.randint(0, 31, (3, 19)), dict(attention_mask=torch.tensor(PADDED_MASK))),
    "cu_seqlens+max_seqlen": lambda: (torch.randint(0, 31, (1, 20)), dict(cu_seqlens=torch.tensor(CU_SEQLENS), max_seqlen=MAX_SEQLEN)),
}


def _hybrid_lm():
    torch.manual_seed(0)
    return LM(LMConfig(vocab_size=31, d_model=16, n_layers=4, n_heads=2, mixer=HYBRID, chunk_size=8)).double()


def _logits(model, ids, kwargs):
    return model(ids, return_cache=False, **kwargs)[0]


@pytest.mark.parametrize("path", list(LM_PATHS))
def test_lm_padded_and_packed_paths_compile_without_graph_breaks_and_equal_eager(path):
    model = _hybrid_lm()
    ids, kwargs = LM_PATHS[path]()
    count, reasons = _explain_breaks(lambda i: _logits(model, i, kwargs), ids)
    print(f"LM with {path}: {count} graph break(s) {reasons}")
    assert count == 0, reasons
    torch._dynamo.reset()
    results = {}
    for name, fn in (("eager", _logits), ("compiled", torch.compile(_logits, backend="aot_eager", fullgraph=True))):
        model.zero_grad(set_to_none=True)
        logits = fn(model, ids, kwargs)
        cotangent = torch.randn(logits.shape, generator=torch.Generator().manual_seed(5), dtype=logits.dtype)
        (logits * cotangent).sum().backward()
        results[name] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (lc, gc), (le, ge) = results["compiled"], results["eager"]
    worst = max(ge, key=lambda n: rel_err(gc[n], ge[n]))
    print(f"LM with {path}: compiled vs eager logits {rel_err(lc, le):.1e}, worst gradient {worst} {rel_err(gc[worst], ge[worst]):.1e}")
    assert rel_err(lc, le) <= 1e-12 and rel_err(gc[worst], ge[worst]) <= 1e-12
    if "attention_mask" in kwargs:  # logits at the pads are 0 in both
        pads = kwargs["attention_mask"] == 0
        assert bool((lc[pads] == 0).all()) and bool((le[pads] == 0).all())


def test_lm_cu_seqlens_without_max_seqlen_breaks_once():
    """Without the hint the LM reads the longest length from the offsets once (not once per layer)."""
    model = _hybrid_lm()
    ids, kwargs = LM_PATHS["cu_seqlens+max_seqlen"]()
    del kwargs["max_seqlen"]
    count, reasons = _explain_breaks(lambda i: _logits(model, i, kwargs), ids)
    print(f"LM with cu_seqlens, no max_seqlen: {count} graph break(s) {reasons}")
    assert count == 1, reasons


def test_short_convolution_with_cu_seqlens_compiles_and_carries_each_state():
    """Packed sequences shorter and longer than W − 1, with an incoming state: the compiled
    convolution (fullgraph) gives each sequence's outputs and new state as run alone."""
    from fastweights.layers import ShortConvolution

    torch.manual_seed(3)
    conv = ShortConvolution(6, kernel_size=4).double()
    lengths = [1, 2, 6, 3]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    x = torch.randn(1, sum(lengths), 6, dtype=torch.float64)
    state = torch.randn(len(lengths), 3, 6, dtype=torch.float64)
    # explain, not fullgraph=True alone: fullgraph traces data-dependent shapes without reporting a break
    count, reasons = _explain_breaks(conv, x, state, cu)
    print(f"ShortConvolution with cu_seqlens: {count} graph break(s) {reasons}")
    assert count == 0, reasons
    torch._dynamo.reset()
    y, new_state = torch.compile(conv, backend="aot_eager", fullgraph=True)(x, state, cu)
    errors = []
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        y_own, state_own = conv(x[:, a:b], state[i:i + 1])
        errors += [rel_err(y[:, a:b], y_own), rel_err(new_state[i:i + 1], state_own)]
    print(f"compiled packed convolution vs each sequence alone: worst {max(errors):.1e}")
    assert max(errors) <= 1e-12


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


def test_lm_max_seqlen_is_checked():
    model = LM(LMConfig(vocab_size=31, d_model=16, n_layers=1, n_heads=2, mixer="deltanet", chunk_size=8))
    ids = torch.randint(0, 31, (1, 20))
    with pytest.raises(ValueError, match=r"LM: `max_seqlen`=11 is smaller than sequence 1 of `cu_seqlens` \(12 tokens\)"):
        model(ids, cu_seqlens=torch.tensor(CU_SEQLENS), max_seqlen=MAX_SEQLEN - 1)
    with pytest.raises(ValueError, match=r"LM: `max_seqlen`=12 describes packed sequences and needs `cu_seqlens`"):
        model(ids, max_seqlen=MAX_SEQLEN)
    with pytest.raises(TypeError, match=r"LM: `max_seqlen` must be a positive int"):
        model(ids, cu_seqlens=torch.tensor(CU_SEQLENS), max_seqlen=12.0)
