"""The op room's layout: each op declared once, one way down, one owner per parameter.

- No op module reads an op's name string (``op.split("_")``, ``op.endswith(...)``, ``"x" in op``)
  or reads a flag off a function (``getattr(core, "takes_low_products", False)``), and no module
  sets attributes on its functions: what an op is lives in its ``OpSpec`` (``fastweights/ops/_spec.py``).
- Each parameter of the public ops has at most one function that resolves it (turns ``None`` into
  a value), and ``chunk_size`` exactly one in the whole package: ``resolve_chunk_size``.
- Every public op of a rule is declared by one spec, and ``backend="torch"`` runs no compiled
  kernel while ``"cpu"`` does, with the same numbers (float64, awkward shapes, forward and backward).

Each AST check is run once on a snippet that breaks it, so that a parser that finds nothing
cannot pass for a clean package.
"""

import ast
import collections
import functools
import importlib
import inspect
import pathlib
import pkgutil

import pytest
import torch

import fastweights
from fastweights import ops
from fastweights.ops._spec import Form, OpSpec

PACKAGE = pathlib.Path(fastweights.__file__).resolve().parent
OPS = PACKAGE / "ops"


def _sources(root: pathlib.Path):
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


# -- (a) nothing reads an op's name string, nothing reads flags off functions -----------------------


def _is_name_string(node: ast.AST) -> bool:
    """``op`` or ``spec.name``: the names of ops, for messages only."""
    return ((isinstance(node, ast.Name) and node.id == "op")
            or (isinstance(node, ast.Attribute) and node.attr == "name" and isinstance(node.value, ast.Name)
                and node.value.id == "spec"))


def name_string_reads(tree: ast.AST) -> list:
    """Where an op's name is parsed: a method or attribute of it, an index into it, a comparison with it."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_name_string(node.value):
            found.append((node.lineno, f".{node.attr} of an op name"))
        elif isinstance(node, ast.Subscript) and _is_name_string(node.value):
            found.append((node.lineno, "an index into an op name"))
        elif isinstance(node, ast.Compare) and any(_is_name_string(x) for x in [node.left, *node.comparators]):
            found.append((node.lineno, "a comparison with an op name"))
    return found


def function_flags(tree: ast.Module) -> list:
    """Attributes set on a module's functions, and ``getattr(f, "flag", ...)`` on a function ``f``
    (a module-level one, or a parameter the function calls)."""
    found = []
    defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in defs:
                    found.append((node.lineno, f"{target.value.id}.{target.attr} set on a function"))
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        called = {c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        callables = defs | (called & {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs})
        for c in ast.walk(fn):
            if (isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in ("getattr", "hasattr")
                    and len(c.args) >= 2 and isinstance(c.args[0], ast.Name) and c.args[0].id in callables
                    and isinstance(c.args[1], ast.Constant) and not str(c.args[1].value).startswith("__")):
                found.append((c.lineno, f"{c.func.id}({c.args[0].id}, {c.args[1].value!r}) reads a flag off a function"))
    return found


def test_the_checkers_find_name_reads_and_function_flags():
    bad = ast.parse(
        "def run(op, core, spec):\n"
        "    form = op.split('_', 1)[0]\n"
        "    if op.endswith('linear_attn') or 'chunk' in spec.name:\n"
        "        pass\n"
        "    low = getattr(core, 'takes_low_products', False)\n"
        "    return core(form, low)\n"
        "def solver():\n"
        "    pass\n"
        "solver.single_backward = True\n"
    )
    assert len(name_string_reads(bad)) == 3  # .split, .endswith, "chunk" in spec.name
    assert [why for _, why in function_flags(bad)] == [
        "solver.single_backward set on a function", "getattr(core, 'takes_low_products') reads a flag off a function"]
    good = ast.parse("def run(spec, solver):\n    raise ValueError(f'{spec.name}: bad')\n    return solver(spec.form)\n")
    assert name_string_reads(good) == [] and function_flags(good) == []


def test_no_op_module_reads_an_op_name_or_a_flag_off_a_function():
    problems = []
    for path, tree in _sources(OPS):
        for line, why in name_string_reads(tree) + function_flags(tree):
            problems.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {why}")
    print("\n".join(problems) or "clean")
    assert problems == []


# -- (b) one resolving function per parameter -------------------------------------------------------


def _none_test(test: ast.AST, name: str):
    """``name is None`` -> True, ``name is not None`` -> False (also as one term of an ``and``),
    anything else -> None."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        terms = [_none_test(t, name) for t in test.values]
        return next((t for t in terms if t is not None), None)
    if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == name
            and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Is, ast.IsNot))
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None):
        return isinstance(test.ops[0], ast.Is)
    return None


def _is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def resolutions(tree: ast.AST) -> dict:
    """``{parameter: {function, ...}}``: the functions that give a parameter of their own a value in
    place of ``None`` (``if p is None: p = ...``, ``p = x if p is None else p``, ``p = p or x``,
    ``return x if p is None else ...``). Keeping None (``p = None if p is None else p.to(dt)``) is not
    a resolution."""
    found = collections.defaultdict(set)
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
        for node in ast.walk(fn):
            if isinstance(node, ast.If):
                for p in params:
                    is_none = _none_test(node.test, p)
                    branch = node.body if is_none else node.orelse
                    if is_none is not None and any(
                            isinstance(s, ast.Assign) and any(isinstance(t, ast.Name) and t.id == p for t in s.targets)
                            and not _is_none(s.value) for s in branch):
                        found[p].add(fn.name)
            value, target = None, None
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value, target = node.value, node.targets[0].id
            elif isinstance(node, ast.Return):
                value = node.value
            if isinstance(value, ast.IfExp):
                for p in params:
                    is_none = _none_test(value.test, p)
                    if is_none is not None and (target in (None, p)) and not _is_none(value.body if is_none else value.orelse):
                        found[p].add(fn.name)
            if (isinstance(value, ast.BoolOp) and isinstance(value.op, ast.Or) and isinstance(value.values[0], ast.Name)
                    and value.values[0].id in params and target == value.values[0].id):
                found[target].add(fn.name)
    return found


def _package_resolutions(root: pathlib.Path) -> dict:
    found = collections.defaultdict(set)
    for path, tree in _sources(root):
        for name, fns in resolutions(tree).items():
            found[name] |= {f"{path.relative_to(PACKAGE.parent)}:{fn}" for fn in fns}
    return found


def _public_op_parameters() -> set:
    names = set()
    for public in ops.__all__:
        fn = getattr(ops, public)
        if inspect.isfunction(fn):
            names |= set(inspect.signature(fn).parameters)
    return names - {"kwargs", "extra"}


def test_the_resolver_finder_finds_each_pattern():
    found = resolutions(ast.parse(
        "def a(chunk_size, scale, g):\n"
        "    if chunk_size is None:\n        chunk_size = 64\n"
        "    scale = 0.5 if scale is None else float(scale)\n"
        "    g = None if g is None else g.float()\n"  # a cast, not a resolution
        "def b(chunk_size):\n    chunk_size = chunk_size or 32\n"
        "def c(scale, k):\n    return k ** -0.5 if scale is None else scale\n"
        "def d(chunk_size, k):\n    if chunk_size is None and k is not None:\n        chunk_size = k\n"
    ))
    assert {p: sorted(f) for p, f in found.items()} == {"chunk_size": ["a", "b", "d"], "scale": ["a", "c"]}


def test_chunk_size_has_one_resolving_function_in_the_package():
    found = _package_resolutions(PACKAGE)
    print(sorted(found["chunk_size"]))
    assert found["chunk_size"] == {"fastweights/ops/_chunk.py:resolve_chunk_size"}


def test_each_parameter_of_the_public_ops_has_at_most_one_resolving_function():
    found = _package_resolutions(OPS)
    public = _public_op_parameters()
    assert {"chunk_size", "scale", "backend", "initial_state", "cu_seqlens"} <= public
    shared = {p: sorted(fns) for p, fns in found.items() if p in public and len(fns) > 1}
    print({p: sorted(fns) for p, fns in found.items() if p in public})
    assert shared == {}
    assert found["scale"] == {"fastweights/ops/_checks.py:resolve_scale"}


def test_one_number_for_the_long_chunk():
    """64 is written once: the Triton kernels' length and the cap's floor are the long default chunk."""
    from fastweights.ops import _backend, _chunk, _checks

    assert _backend.CHUNK_SIZE == _chunk.LONG_CHUNK == 64
    assert not hasattr(_checks, "MIN_CAPPED_CHUNK")
    assert _checks.effective_chunk_size(64, 5) == 64 and _checks.effective_chunk_size(128, 5) == _chunk.LONG_CHUNK


def test_every_chunk_op_and_layer_defaults_chunk_size_to_none():
    from fastweights import layers

    chunk_ops = [getattr(ops, n) for n in ops.__all__ if n.startswith("chunk_") and inspect.isfunction(getattr(ops, n))]
    assert len(chunk_ops) >= 7
    for fn in chunk_ops:
        assert inspect.signature(fn).parameters["chunk_size"].default is None, fn.__name__
    assert inspect.signature(layers.FastWeightMixer).parameters["chunk_size"].default is None
    for name in ("DeltaNet", "GatedDeltaNet", "LinearAttention", "KimiDeltaAttention", "GatedDeltaNet2", "DeltaProduct"):
        assert getattr(layers, name)(32, 2).chunk_size is None, name


# -- each op declared once ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _specs() -> dict:
    found = collections.defaultdict(list)
    for info in pkgutil.walk_packages(ops.__path__, "fastweights.ops."):
        if ".triton" in info.name or info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, OpSpec) and value not in found[value.name]:
                found[value.name].append(value)
    return dict(found)


def test_every_form_of_every_rule_is_declared_by_one_spec():
    specs = _specs()
    fla_aliases = {"chunk_rwkv7"}  # fla's name for chunk_dplr_delta_rule, with fla's signature
    forms = [n for n in ops.__all__ if n.split("_", 1)[0] in ("recurrent", "parallel", "chunk") and n not in fla_aliases]
    assert len(forms) >= 21
    for name in forms:
        assert len(specs.get(name, [])) == 1, f"{name}: {len(specs.get(name, []))} specs"
        spec = specs[name][0]
        assert spec.form is Form(name.split("_", 1)[0]), name
        assert spec.cpu is None or spec.form is Form.CHUNK, name
    print(sorted(f"{n}: {s[0].backends()}" for n, s in specs.items()))


# -- backend="torch" is the PyTorch code, "cpu" the compiled kernels ------------------------------------


KERNEL_USERS = ("fastweights.ops.delta_rule.chunk", "fastweights.ops.linear_attn.chunk", "fastweights.ops.kda.chunk",
                "fastweights.ops.step", "fastweights.ops.feature_maps")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every ask for the compiled CPU kernels (``kernels_for``) by the op modules, recorded."""
    calls = []
    for name in KERNEL_USERS:
        module = importlib.import_module(name)
        real = module.kernels_for
        monkeypatch.setattr(module, "kernels_for", lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    return calls


def _inputs(op, packed: bool, seed=0):
    """Awkward shapes: T not a multiple of C, K != V, head size 60, an initial state; B = 2, or three
    sequences of uneven lengths packed in one row."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K, V = (1 if packed else 2), 63, 2, 60, 20
    N = 3 if packed else B

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    h0 = r(N, H, K, V)
    packing = dict(cu_seqlens=torch.tensor([0, 20, 23, 63])) if packed else {}
    if op is ops.chunk_delta_rule:
        return dict(q=q, k=k, v=v, beta=beta, initial_state=h0, qk_norm="l2", **packing)
    if op is ops.chunk_gated_delta_rule:
        return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, qk_norm="l2", **packing)
    if op is ops.chunk_linear_attn:
        return dict(q=q, k=k, v=v, g=g, initial_state=h0, qk_norm="l2", **packing)
    gk = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    return dict(q=q, k=k, v=v, g=gk, beta=beta, initial_state=h0, use_qk_l2norm_in_kernel=True, **packing)


def _run(op, backend, x):
    leaves = {n: (t.detach().clone().requires_grad_(True) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
              for n, t in x.items()}
    o, h = op(**leaves, output_final_state=True, chunk_size=16, backend=backend)
    gen = torch.Generator().manual_seed(9)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (h * torch.randn(h.shape, generator=gen, dtype=h.dtype)).sum()
    tensors = {n: t for n, t in leaves.items() if isinstance(t, torch.Tensor) and t.requires_grad}
    return (o, h, *torch.autograd.grad(loss, list(tensors.values())))


CPU_OPS = [ops.chunk_delta_rule, ops.chunk_gated_delta_rule, ops.chunk_linear_attn, ops.chunk_kda]


@pytest.mark.parametrize("packed", [False, True], ids=["B2", "packed-20-3-40"])
@pytest.mark.parametrize("op", CPU_OPS, ids=lambda f: f.__name__)
def test_backend_torch_runs_no_compiled_kernel_and_cpu_agrees_with_it(op, packed, kernel_calls):
    x = _inputs(op, packed)
    torch_out = _run(op, "torch", x)
    assert kernel_calls == [], f"backend='torch' asked for the compiled kernels: {kernel_calls}"
    cpu_out = _run(op, "cpu", x)
    assert kernel_calls, "backend='cpu' never asked for the compiled kernels"
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(cpu_out, torch_out))
    print(f"{op.__name__} {'packed' if packed else 'B=2'}: cpu against torch, worst relative difference over o, h_T and the gradients {worst:.2e}")
    assert worst < 1e-12


def test_backend_torch_steps_run_no_compiled_kernel(kernel_calls):
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 3, 8, generator=gen), torch.nn.functional.normalize(torch.randn(2, 3, 8, generator=gen), dim=-1)
    v, beta, state = torch.randn(2, 3, 5, generator=gen), torch.rand(2, 3, generator=gen), torch.randn(2, 3, 8, 5, generator=gen)
    o_torch, h_torch = ops.delta_rule_step(q, k, v, beta, state, backend="torch")
    assert kernel_calls == []
    o_cpu, h_cpu = ops.delta_rule_step(q, k, v, beta, state, backend="cpu")
    assert kernel_calls
    torch.testing.assert_close(o_cpu, o_torch, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h_cpu, h_torch, rtol=1e-5, atol=1e-6)
    kernel_calls.clear()
    gk = -torch.rand(2, 3, 8, generator=gen)
    o_torch, h_torch = ops.kda_step(q, k, v, beta, gk, state, 0.3, backend="torch")
    assert kernel_calls == []
    o_cpu, h_cpu = ops.kda_step(q, k, v, beta, gk, state, 0.3, backend="cpu")
    assert kernel_calls
    torch.testing.assert_close(o_cpu, o_torch, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h_cpu, h_torch, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("call, match", [
    (lambda q: ops.chunk_delta_rule(q, q, q, torch.rand(1, 4, 1), backend="gpu"), "unknown `backend`"),
    (lambda q: ops.recurrent_kda(q, q, q, -torch.rand(1, 4, 1, 8), torch.rand(1, 4, 1), backend="cpu"),
     "not one this op runs"),
    (lambda q: ops.chunk_linear_attn(q, q, q, backend="triton"), "not one this op runs"),
    (lambda q: ops.chunk_delta_rule(q.to("meta"), q.to("meta"), q.to("meta"), torch.rand(1, 4, 1, device="meta"),
                                    backend="cpu"), "runs the compiled CPU kernels on CPU tensors"),
], ids=["unknown", "recurrent-cpu", "linear-attn-triton", "cpu-on-meta"])
def test_a_backend_an_op_cannot_run_is_refused_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.randn(1, 4, 1, 8))


# -- one way down: the public functions in api.py, the forms' modules below them -----------------------


FAMILIES = ("delta_rule", "gated_delta_rule", "linear_attn", "kda", "gdn2", "delta_product", "dplr")
FORM_MODULES = ("recurrent", "parallel", "chunk", "textbook")
#: fla's names of a form, kept in alias modules with fla's signatures (not in api.py)
FLA_ALIAS_MODULES = {"fastweights.ops._fla_aliases", "fastweights.ops.dplr.fla_aliases"}


def _public_forms():
    """The public op functions of ``fastweights.ops`` (the forms, their fla names): ``[(name, function)]``."""
    return [(n, getattr(ops, n)) for n in ops.__all__
            if n.startswith(("recurrent_", "parallel_", "chunk_", "fused_recurrent_", "fused_chunk_"))
            and inspect.isfunction(getattr(ops, n))]


def test_every_public_form_lives_in_its_familys_api_module():
    forms = _public_forms()
    assert len(forms) >= 28
    where = {name: fn.__module__ for name, fn in forms}
    print(where)
    for name, module in where.items():
        family = module.split(".")[2] if module.count(".") >= 3 else None
        assert module in FLA_ALIAS_MODULES or (family in FAMILIES and module == f"fastweights.ops.{family}.api"), (name, module)
    assert sum(m.endswith(".api") for m in where.values()) >= 21


def form_module_problems(tree: ast.Module, public: set) -> list:
    """What a forms' module (recurrent.py, parallel.py, chunk.py) must not hold: a top-level definition
    of a public op name, or an import of the dispatcher or of the fla mapping (a public wrapper's
    business)."""
    found = []
    for node in tree.body:
        names = []
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        found += [(node.lineno, f"defines the public op {n}") for n in names if n in public]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and node.module in ("_dispatch", "_fla_compat", "_forms"):
            found.append((node.lineno, f"imports {node.module}"))
    return found


def test_the_form_module_checker_finds_a_wrapper():
    bad = ast.parse("from .._dispatch import run\nfrom .._spec import OpSpec\n"
                    "def chunk_delta_rule(q, k, v):\n    return run(SPEC, q, k, v)\nrecurrent_kda = form(SPEC)\n")
    assert [why for _, why in form_module_problems(bad, {"chunk_delta_rule", "recurrent_kda"})] == [
        "defines the public op chunk_delta_rule", "defines the public op recurrent_kda", "imports _dispatch"]
    good = ast.parse("from .._spec import OpSpec\ndef delta_rule_chunk(q, k, v):\n    return q\n")
    assert form_module_problems(good, {"chunk_delta_rule"}) == []


def test_the_forms_modules_hold_no_public_op_wrapper():
    public = {n for n, _ in _public_forms()} | {"textbook_chunk_delta_rule", "recurrent_kda_as"}  # (a form's *_step is its maths)
    problems, seen = [], 0
    for family in FAMILIES:
        for name in FORM_MODULES:
            path = OPS / family / f"{name}.py"
            if not path.exists():
                continue
            seen += 1
            problems += [f"{path.relative_to(PACKAGE.parent)}:{line}: {why}"
                         for line, why in form_module_problems(ast.parse(path.read_text()), public)]
    assert seen == 22
    print("\n".join(problems) or "clean")
    assert problems == []


def test_the_old_paths_of_the_public_functions_warn_and_resolve():
    moved = {"delta_rule.chunk": "chunk_delta_rule", "delta_rule.recurrent": "recurrent_delta_rule",
             "delta_rule.textbook": "textbook_chunk_delta_rule", "gated_delta_rule.parallel": "parallel_gated_delta_rule",
             "linear_attn.chunk": "chunk_linear_attn", "kda.recurrent": "fused_recurrent_kda", "gdn2.chunk": "chunk_gdn2",
             "delta_product.parallel": "parallel_gated_delta_product", "dplr.recurrent": "recurrent_dplr_delta_rule"}
    for old, name in moved.items():
        module = importlib.import_module(f"fastweights.ops.{old}")
        family = old.split(".")[0]
        with pytest.warns(DeprecationWarning, match=rf"fastweights\.ops\.{old}\.{name} moved to fastweights\.ops\.{family}\.api\.{name}"):
            found = getattr(module, name)
        assert found is getattr(importlib.import_module(f"fastweights.ops.{family}.api"), name)
    with pytest.raises(AttributeError, match="has no attribute 'chunk_delta_rule_typo'"):
        _ = importlib.import_module("fastweights.ops.delta_rule.chunk").chunk_delta_rule_typo


# -- no recurrent or parallel op takes chunk_size -------------------------------------------------------


def test_only_chunk_forms_take_chunk_size():
    forms = _public_forms()
    without = [(n, fn) for n, fn in forms if not n.startswith(("chunk_", "fused_chunk_"))]
    assert len(without) >= 14
    for name, fn in forms:  # (fla's aliases keep fla's signatures: fused_chunk_linear_attn has none)
        takes = "chunk_size" in inspect.signature(fn).parameters
        assert takes == name.startswith("chunk_") or (not takes and fn.__module__ in FLA_ALIAS_MODULES), name
    for spec_list in _specs().values():
        spec = spec_list[0]
        for solver in (spec.torch, spec.cpu):
            if solver is not None:
                assert ("chunk_size" in inspect.signature(solver).parameters) == (spec.form is Form.CHUNK), spec.name


@pytest.mark.parametrize("name", ["recurrent_delta_rule", "parallel_gated_delta_rule", "recurrent_linear_attn",
                                  "parallel_kda", "recurrent_gdn2", "parallel_gated_delta_product",
                                  "recurrent_dplr_delta_rule", "fused_recurrent_kda"])
def test_a_recurrent_or_parallel_form_refuses_chunk_size_by_name(name):
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(TypeError, match=r"unexpected keyword argument .chunk_size."):
        getattr(ops, name)(q, q, q, chunk_size=16)


def test_positional_arguments_of_a_form_without_chunk_size_do_not_land_in_its_place():
    """DPLR's body has fla's positional ``chunk_size`` (``chunk_dplr_delta_rule``); its recurrent form
    takes positional arguments only up to that place."""
    params = list(inspect.signature(ops.recurrent_dplr_delta_rule).parameters.values())
    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional[-1] == "safe_gate" and "chunk_size" not in positional
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(TypeError, match=r"recurrent_dplr_delta_rule\(\) takes at most 12 positional arguments \(13 given\)"):
        ops.recurrent_dplr_delta_rule(q, q, q, q, q, q, None, None, False, None, None, False, 16)


# -- the descent: each module of a call's chain entered once, nothing below calling back up -----------


def callbacks_up(calls, chain) -> list:
    """``calls``: ``[(caller module, callee module)]`` in order. The calls that go from a module of
    ``chain`` to one earlier in it (a module below calling back up into one above)."""
    rank = {m: i for i, m in enumerate(chain)}
    return [(a, b) for a, b in calls if a in rank and b in rank and rank[b] < rank[a]]


def _trace(fn):
    """Run ``fn()``; return ``[(caller module, callee module)]`` of every Python call it makes."""
    import sys

    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_back is not None:
            calls.append((frame.f_back.f_globals.get("__name__"), frame.f_globals.get("__name__")))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_the_callback_finder_finds_a_call_back_up():
    chain = ["api", "dispatch", "frontend", "solver"]
    assert callbacks_up([("api", "dispatch"), ("dispatch", "frontend"), ("frontend", "solver"), ("solver", "leaf")], chain) == []
    assert callbacks_up([("api", "dispatch"), ("frontend", "solver"), ("solver", "frontend")], chain) == [("solver", "frontend")]


P = "fastweights.ops."
CHAINS = {
    "chunk_delta_rule": [P + "delta_rule.api", P + "_fla_compat", P + "_dispatch", P + "_frontend", P + "delta_rule.chunk",
                         P + "cpu.library"],
    "chunk_gated_delta_rule": [P + "_forms", P + "gated_delta_rule.api", P + "_fla_compat", P + "_dispatch", P + "_frontend",
                               P + "delta_rule.chunk", P + "cpu.library"],
    "chunk_linear_attn": [P + "linear_attn.api", P + "_dispatch", P + "_frontend", P + "linear_attn.chunk", P + "cpu.library"],
    "chunk_kda": [P + "_forms", P + "kda.fla", P + "_dispatch", P + "_frontend", P + "kda.chunk", P + "cpu.library"],
}


@pytest.mark.parametrize("name", list(CHAINS))
def test_a_chunk_call_descends_through_each_module_once(name):
    """The path of docs/design.md: every module of the chain is entered, in order, and no module below
    calls back into one above it (the helpers a step calls, _chunk, _checks, _backend, precision, ...,
    are leaves outside the chain)."""
    from fastweights.ops import cpu

    op = getattr(ops, name)
    x = _inputs(op, packed=False)
    x = {n: t.float() if isinstance(t, torch.Tensor) else t for n, t in x.items()}
    calls = _trace(lambda: op(**x, output_final_state=True, chunk_size=16))
    chain = CHAINS[name] if cpu.available() else CHAINS[name][:-1]
    entered = {callee for _, callee in calls}
    print(name, [m for m in chain if m in entered])
    assert set(chain) <= entered
    assert (chain[0], chain[1]) in calls or chain[0] == calls[0][1]
    assert all((a, b) in calls for a, b in zip(chain[1:4], chain[2:5]))  # api/mapping -> dispatcher -> front end
    assert callbacks_up(calls, chain) == []
