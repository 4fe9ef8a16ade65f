"""torch.compile runs the compiled CPU kernels (``fastweights/ops/cpu/library.py``): each kernel
is a ``torch.library`` custom op whose fake gives the real outputs' shapes, dtypes and strides
(``torch.library.opcheck``), the differentiable ones with a registered backward (gradcheck in
float64); compiled with ``fullgraph=True``, the chunk ops, the decode steps, the DeltaNet and
Gated DeltaNet layers and the LM call the same kernels as eager -- counted through a wrapper
around each extension function, and seen in the traced graph -- and give BITWISE the same
outputs and gradients (fp32: any other code would round differently). With the kernels off
the compiled graph runs the PyTorch path and no kernel.

``backend="aot_eager"`` (AOTAutograd's forward and backward graphs, no code generation): the
tracing is what is under test, and compile time on 2 cores stays small (tiny shapes).
"""

from __future__ import annotations


import pytest
import torch
import torch._dynamo

from fastweights import ops
from fastweights.layers import DeltaNet, GatedDeltaNet
from fastweights.models import LM, LMConfig
from fastweights.ops import cpu as cpu_kernels
from fastweights.ops.cpu import library
from fastweights.ops.delta_rule.chunk import UT_BLOCKS
from fastweights.ops.delta_rule.wy import row_blocks
from helpers import HAS_COMPILER, RULES, make_inputs, rel_err

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: no compiled kernels to see (the PyTorch path compiles: test_compile.py)"),
]


@pytest.fixture(scope="module")
def ext():
    assert cpu_kernels.available(), cpu_kernels.status()
    return cpu_kernels.kernels()


@pytest.fixture
def calls(ext, monkeypatch):
    """Counts every call of each extension function (the real implementation of every op, and
    the eager path, look them up by name on the extension at call time)."""
    counts = {}

    def counting(name, fn):
        def counted(*args):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args)
        return counted

    for name in ("chunk_delta_fwd", "chunk_delta_fwd_bf16", "chunk_delta_bwd", "delta_step", "chunk_linear_attn_fwd",
                 "chunk_kda_fwd", "chunk_kda_fwd_bf16",
                 "short_conv_fwd", "short_conv_bwd", "l2norm_fwd", "l2norm_bwd"):
        monkeypatch.setattr(ext, name, counting(name, getattr(ext, name)))
    torch._dynamo.reset()
    yield counts
    torch._dynamo.reset()


class Graphs:
    """A torch.compile backend: records each traced graph's call targets (an autograd.Function's
    forward and backward are subgraphs, hence every submodule), then runs aot_eager."""

    def __init__(self):
        self.targets, self.count = [], 0

    def __call__(self, gm, example_inputs):
        self.count += 1  # one graph per break plus one
        for module in gm.modules():
            if isinstance(module, torch.fx.GraphModule):
                self.targets += [str(n.target) for n in module.graph.nodes if n.op == "call_function"]
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    def has(self, op: str) -> bool:
        return any(t.startswith(f"fastweights.{op}.") for t in self.targets)


def _fp32(x):
    return {n: t.float() for n, t in x.items()}


def _loss_grads(out, leaves, seed=3):
    """Backward of Σ out_i · r_i (fixed random cotangents); the leaves' gradients."""
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in out)
    loss.backward()
    return [t.grad for t in leaves]


def _equal(compiled, eager):
    same = [torch.equal(c, e) for c, e in zip(compiled, eager)]
    worst = max(rel_err(c, e) for c, e in zip(compiled, eager))
    return all(same), worst


# -- each op on its own: exact fakes, schemas, autograd --------------------------------------


def _op_samples():
    gen = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype)

    n, h, t, dk, dv, c = 2, 3, 10, 5, 4, 4  # T not a multiple of C, K != V
    q, k, v = rand(n, h, t, dk), torch.nn.functional.normalize(rand(n, h, t, dk), dim=-1), rand(n, h, t, dv)
    beta, g, h0 = torch.rand(n, h, t, generator=gen), -torch.rand(n, h, t, generator=gen), rand(n * h, dk, dv)
    nb = row_blocks(c, UT_BLOCKS)
    fwd = tuple(library.chunk_delta_fwd(q, k, v, beta, g, h0, 0.5, c, nb, True))
    state = rand(n, h, dk, dv)
    step = (rand(n, h, dk), torch.nn.functional.normalize(rand(n, h, dk), dim=-1), rand(n, h, dv),
            torch.rand(n, h, generator=gen), -torch.rand(n, h, generator=gen))
    x, cstate, taps = rand(2, 7, 6), rand(2, 3, 6), rand(4, 6)
    y, r = library.l2norm_fwd(rand(3, 4, dk), 1e-6)
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    return {
        "chunk_delta_fwd": [(q, k, v, beta, g, h0, 0.5, c, nb, True), (q, k, v, beta, None, None, 0.5, c, nb, False)],
        "chunk_delta_fwd_bf16": [(*bf, beta, g, h0, 0.5, c), (*bf, beta, None, None, 0.5, c)],
        "chunk_kda_fwd_bf16": [(*bf, beta, -torch.rand(n, h, t, dk, generator=gen), h0, 0.5, c, "op", True),
                               (*bf, beta, -torch.rand(n, h, t, dk, generator=gen), None, 0.5, c)],
        "chunk_delta_bwd": [(*fwd[3:6], fwd[2], beta, g, rand(n, h, t, dv), rand(n * h, dk, dv), 0.5, c)],
        "delta_step_out": [(*step, state, 0.3), (*step[:4], None, state.double(), 0.3)],
        "delta_step_inplace": [(*step, state.clone(), 0.3)],
        "delta_step_pool": [(*step, rand(5, h, dk, dv), torch.tensor([3, -1]), None, 0.3),
                            (*step, rand(5, h, dk, dv), torch.tensor([0, 4]), torch.tensor([True, False]), 0.3)],
        "short_conv_fwd": [(x.requires_grad_(), cstate.requires_grad_(), taps.requires_grad_())],
        "short_conv_bwd": [(rand(2, 7, 6), x.detach(), cstate.detach(), taps.detach())],
        "l2norm_fwd": [(rand(3, 4, dk).requires_grad_(), 1e-6)],
        "l2norm_bwd": [(rand(3, 4, dk), y, r)],
    }


def test_every_kernel_is_registered_once():
    assert sorted(library.OPS) == sorted(_op_samples()), "a kernel without an opcheck sample (add one)"
    for name in library.OPS:
        assert hasattr(torch.ops.fastweights, name)


FAST_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("checks", [FAST_CHECKS, pytest.param(("test_aot_dispatch_dynamic",), marks=pytest.mark.slow)],
                         ids=["fake_schema_autograd", "dynamic_shapes"])
@pytest.mark.parametrize("name", sorted(library.OPS))
def test_opcheck(name, checks, ext):
    """opcheck: the fake's outputs match the real ones (shapes, dtypes, strides), the schema's
    mutation annotations are true, and autograd is registered where an input needs a gradient;
    slow: AOTAutograd traces the op with dynamic shapes to the real op's results."""
    op = library.OPS[name]
    for args in _op_samples()[name]:
        result = torch.library.opcheck(op, args, test_utils=checks)
        print(f"{name}: {result}")
        assert all(outcome == "SUCCESS" for outcome in result.values()), result


@pytest.mark.parametrize("name", ["short_conv_fwd", "l2norm_fwd"])
def test_differentiable_ops_gradcheck(name, ext):
    """The registered backward (the ``_bwd`` kernel) against finite differences, float64."""
    gen = torch.Generator().manual_seed(1)
    if name == "short_conv_fwd":
        args = [torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True) for shape in ((2, 5, 3), (2, 3, 3), (4, 3))]
        fn = library.OPS[name]
    else:
        args = [torch.randn(3, 2, 6, generator=gen, dtype=torch.float64, requires_grad=True)]

        def fn(x):
            return library.OPS[name](x, 1e-6)[0]
    assert torch.autograd.gradcheck(fn, args)


# -- the ops, the steps, the layers and the LM under torch.compile ----------------------------


def _compiled_equals_eager(name, run, fn, calls, kernels):
    """``run(fn)`` compiled (fullgraph; its graphs recorded), then eager: each of ``kernels`` ran,
    as often both ways, and every tensor ``run`` returns is bitwise the same. Returns the graphs."""
    graphs = Graphs()
    compiled = run(torch.compile(fn, backend=graphs, fullgraph=True))
    compiled_calls = dict(calls)
    calls.clear()
    eager = run(fn)
    same, worst = _equal(compiled, eager)
    print(f"{name}: kernel calls compiled {compiled_calls}, eager {calls}; bitwise {same} (worst {worst:.1e})")
    for kernel in kernels:
        assert compiled_calls.get(kernel, 0) >= 1 and compiled_calls.get(kernel) == calls.get(kernel), kernel
    assert same, worst
    return graphs


CHUNK_CASES = {  # op -> (rule, options)
    "chunk_delta_rule": ("delta", dict(use_qk_l2norm_in_kernel=True)),
    "chunk_gated_delta_rule": ("gated_delta", dict(use_qk_l2norm_in_kernel=True)),
}


@pytest.mark.parametrize("op_name", list(CHUNK_CASES))
def test_compiled_chunk_op_calls_the_kernels_bitwise(op_name, calls):
    """fp32, T = 37 with C = 16 (a partial last chunk), K = 8 != V = 6, an initial state, the
    q/k L2 norm: forward and backward through the kernels both ways, bitwise equal."""
    rule_name, options = CHUNK_CASES[op_name]
    x = _fp32(make_inputs(RULES[rule_name], 2, 37, 2, 8, 6, initial_state=True, seed=4))
    op = getattr(ops, op_name)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in x.values()]
        o, h = fn(*leaves)
        return [o, h] + _loss_grads([o, h], leaves)

    def call(*leaves):
        return op(**dict(zip(x, leaves)), **options, chunk_size=16, output_final_state=True)

    graphs = _compiled_equals_eager(op_name, run, call, calls, ("chunk_delta_fwd", "chunk_delta_bwd", "l2norm_fwd", "l2norm_bwd"))
    assert graphs.has("l2norm_fwd") and graphs.has("chunk_delta_rule_fwd")


INFERENCE_CASES = {  # op -> (rule, q/k/v dtype, bf16 products, the kernel, the custom op in the graph)
    "chunk_gated_delta_rule": ("gated_delta", torch.bfloat16, True, "chunk_delta_fwd_bf16", "chunk_delta_rule_infer"),
    "chunk_linear_attn": ("linear_decay", torch.float32, False, "chunk_linear_attn_fwd", "chunk_linear_attn_infer"),
    "chunk_kda": ("kda", torch.bfloat16, True, "chunk_kda_fwd_bf16", "chunk_kda_infer"),
}


@pytest.mark.parametrize("op_name", list(INFERENCE_CASES))
def test_compiled_inference_calls_the_kernels_bitwise(op_name, calls):
    """Inference (no grad): eager calls the forward's implementation without the custom op's
    dispatch, a compiled graph goes through the op; both run the same kernel, bitwise (under
    bf16_products(), the bf16 kernel where the ISA path has a bf16 unit, else the fp32 one)."""
    rule_name, dtype, products, kernel, in_graph = INFERENCE_CASES[op_name]
    if rule_name == "kda":  # per-channel log decay g [B, T, H, K]
        x = make_inputs(RULES["gated_delta"], 2, 37, 2, 8, 6, initial_state=True, seed=5)
        x["g"] = -0.3 * torch.rand(2, 37, 2, 8, generator=torch.Generator().manual_seed(5))
    else:
        x = make_inputs(RULES[rule_name], 2, 37, 2, 8, 6, initial_state=True, seed=5)
    x = {n: t.to(dtype) if n in ("q", "k", "v") else t.float() for n, t in x.items()}
    op = getattr(ops, op_name)

    def call(*args):
        return op(**dict(zip(x, args)), chunk_size=16, output_final_state=True)

    def run(fn):
        with torch.no_grad(), ops.bf16_products(products):
            return list(fn(*x.values()))

    if products and not cpu_kernels.bf16_unit():  # no bf16 unit on this path: the fp32 kernel reads the bf16 rows
        kernel = kernel.replace("_bf16", "")
    graphs = _compiled_equals_eager(op_name, run, call, calls, (kernel,))
    assert graphs.has(in_graph)


@pytest.mark.parametrize("inplace", [False, True], ids=["new_state", "inplace"])
@pytest.mark.parametrize("gated", [False, True], ids=["delta", "gated"])
def test_compiled_step_calls_the_kernel_bitwise(gated, inplace, calls):
    gen = torch.Generator().manual_seed(6)
    n, h, dk, dv = 3, 2, 8, 6
    q, v = torch.randn(n, h, dk, generator=gen), torch.randn(n, h, dv, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(n, h, dk, generator=gen), dim=-1)
    beta, g = torch.rand(n, h, generator=gen), -torch.rand(n, h, generator=gen)
    state = torch.randn(n, h, dk, dv, generator=gen)

    def step(q, k, v, beta, g, state):
        if gated:
            return ops.gated_delta_rule_step(q, k, v, beta, g, state, inplace=inplace)
        return ops.delta_rule_step(q, k, v, beta, state, inplace=inplace)

    graphs = Graphs()
    s_c, s_e = state.clone(), state.clone()
    o_c, h_c = torch.compile(step, backend=graphs, fullgraph=True)(q, k, v, beta, g, s_c)
    compiled_calls = dict(calls)
    o_e, h_e = step(q, k, v, beta, g, s_e)
    op = "delta_step_inplace" if inplace else "delta_step_out"
    print(f"step (gated {gated}, inplace {inplace}): graph has {op} {graphs.has(op)}, kernel calls {compiled_calls}")
    assert graphs.has(op) and compiled_calls == {"delta_step": 1} and calls == {"delta_step": 2}
    assert torch.equal(o_c, o_e) and torch.equal(h_c, h_e)
    assert torch.equal(s_c, s_e) and torch.equal(s_c, state) != inplace  # the state changed iff in place
    if inplace:
        assert h_c is s_c


def _layer_case(layer_cls):
    torch.manual_seed(2)
    layer = layer_cls(24, 2, chunk_size=16)
    x = torch.randn(2, 37, 24)
    return layer, x


@pytest.mark.parametrize("layer_cls", [pytest.param(DeltaNet, marks=pytest.mark.slow), GatedDeltaNet], ids=lambda c: c.__name__)
def test_compiled_layer_calls_the_kernels_bitwise(layer_cls, calls):
    """Prefill forward and backward of a layer: the short convolution, the q/k norm and the chunk
    op through the kernels, compiled and eager bitwise equal (outputs, input and weight gradients).
    (DeltaNet's case is slow-marked: the LM below compiles a DeltaNet layer in the default run.)"""
    layer, x = _layer_case(layer_cls)

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y, _ = fn(xx)
        grads = _loss_grads([y], [xx])
        return [y] + grads + [p.grad for p in layer.parameters()]

    kernels = ("short_conv_fwd", "short_conv_bwd", "l2norm_fwd", "l2norm_bwd", "chunk_delta_fwd", "chunk_delta_bwd")
    graphs = _compiled_equals_eager(layer_cls.__name__, run, layer, calls, kernels)
    assert graphs.has("short_conv_fwd") and graphs.has("l2norm_fwd")


def test_compiled_lm_has_no_graph_breaks_and_calls_the_kernels_bitwise(calls):
    """A DeltaNet + Gated DeltaNet LM: one graph (0 breaks; ``test_compile.py`` counts them with
    ``torch._dynamo.explain`` too), and the compiled logits and gradients are the eager ones
    bitwise, through the same kernels."""
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=31, d_model=16, n_layers=2, n_heads=2, mixer=["deltanet", "gated_deltanet"], chunk_size=8))
    ids = torch.randint(0, 31, (2, 19))

    def logits(ids):
        return model(ids, return_cache=False)[0]


    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn(ids)
        _loss_grads([out], [])
        return [out] + [p.grad for p in model.parameters()]

    kernels = ("short_conv_fwd", "short_conv_bwd", "l2norm_fwd", "l2norm_bwd", "chunk_delta_fwd", "chunk_delta_bwd")
    graphs = _compiled_equals_eager("LM", run, logits, calls, kernels)
    assert graphs.count == 1 and graphs.has("short_conv_fwd") and graphs.has("l2norm_fwd")


def test_kernels_off_compiles_the_pytorch_path(calls):
    """With the kernels turned off when the graph is traced, it holds no kernel op and none runs."""
    layer, x = _layer_case(GatedDeltaNet)
    cpu_kernels.set_enabled(False)
    try:
        graphs = Graphs()
        y, _ = torch.compile(layer, backend=graphs, fullgraph=True)(x)
        y_eager, _ = layer(x)
    finally:
        cpu_kernels.set_enabled(None)
    err = rel_err(y, y_eager)
    print(f"kernels off: graph ops {sorted(t for t in set(graphs.targets) if 'fastweights' in t)}, calls {calls}, vs eager {err:.1e}")
    assert calls == {} and not any(graphs.has(name) for name in library.OPS)
    assert err <= 1e-6


def test_a_kernel_without_an_entry_runs_in_eager_and_is_refused_when_traced(ext):
    """An extension function not registered in library.py (here a test entry point) still runs in
    eager; tracing it fails with a message that says where to register it."""
    x = torch.randn(3, 5)
    assert torch.equal(library.to_bf16_check(x), ext.to_bf16_check(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="has no custom op: add an entry for it in fastweights/ops/cpu/library.py") as caught:
        torch.compile(lambda x: library.to_bf16_check(x), backend="aot_eager", fullgraph=True)(x)
    print(f"traced: {type(caught.value).__name__}")
    torch._dynamo.reset()
