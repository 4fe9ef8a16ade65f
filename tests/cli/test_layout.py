"""The package's layout: rooms without import circles, one public way in to the ops, a small
top level, and the module paths from before the rooms still importing (with a warning)."""

import ast
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import fastweights

PACKAGE = Path(fastweights.__file__).resolve().parent


def _modules():
    """``{dotted name: (path, is_package)}`` of every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


MODULES = _modules()


def _imports(name, path, is_package):
    """``[(imported module or module.name, line)]`` of every import statement of a module:
    top level, inside functions and inside ``if`` blocks alike; relative imports resolved."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            out += [(f"{module}.{alias.name}", node.lineno) for alias in node.names]
            out.append((module, node.lineno))
    return out


def _graph():
    """Module -> the package's modules it imports (a ``from a import b`` counts b if b is a module, else a)."""
    edges = {m: set() for m in MODULES}
    for name, (path, is_package) in MODULES.items():
        for target, _ in _imports(name, path, is_package):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges[name].add(target)
    return edges


def _cycles(edges):
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_joins_the_packages_modules():
    edges = _graph()
    assert sum(len(e) for e in edges.values()) > 150, "the import graph looks empty: the parser is broken"
    assert _cycles(edges) == []


def test_the_cycle_finder_finds_a_circle():
    """The check above can fail: a circle through a function-level import is found."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    # relative imports resolve against the module's package, function-level ones count
    targets = {t for t, _ in _imports("fastweights.ops.step", PACKAGE / "ops" / "step.py", False)}
    assert {"fastweights.ops._backend", "fastweights.ops.triton.decode"} <= targets


def test_nothing_outside_ops_imports_a_private_name_of_ops():
    private = []
    for name, (path, is_package) in MODULES.items():
        if name == "fastweights.ops" or name.startswith("fastweights.ops."):
            continue
        for target, line in _imports(name, path, is_package):
            if target.startswith("fastweights.ops.") and any(p.startswith("_") for p in target.split(".")[2:]):
                private.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert private == []




OLD_PATHS = {
    "fastweights.train": ("TrainConfig", "fastweights.training.config"),
    "fastweights.checkpoint": ("load_model", "fastweights.io.checkpoint"),
    "fastweights.run_folder": ("RunLock", "fastweights.training.run_folder"),
    "fastweights.allocator": ("tune_cpu_allocator", "fastweights.training.allocator"),
    "fastweights.examples": ("all_examples", "fastweights.studies.worked_examples"),
    "fastweights.lm_bench": ("QUICK_TRAIN_SHAPES", "benchmarks.lm_speed"),
    "fastweights.bench": ("add_arguments", "benchmarks.chunk_speed"),
    "fastweights.training.checkpoint": ("save_checkpoint", "fastweights.io.checkpoint"),
    "fastweights.training.dcp_checkpoint": ("save_sharded", "fastweights.io.dcp_checkpoint"),
    "fastweights.training.sealing": ("write_manifest", "fastweights.io.sealing"),
    "fastweights.training.listing": ("resolve_checkpoint", "fastweights.io.listing"),
}
#: Where the warning of each old path says it moved (the module whose names it forwards).
MOVED_TO = {old: "fastweights.training" if old == "fastweights.train" else home for old, (_, home) in OLD_PATHS.items()}


#: Rooms a room may not import (function-level imports included): imports run one way
#: (docs/design.md, section 1). The checkpoint files (``io``) sit below both ``training`` and
#: ``hf``, so converting a checkpoint to transformers does not load the training room.
MAY_NOT_IMPORT = {
    "fastweights.io": ("fastweights.training", "fastweights.hf", "fastweights.tasks", "fastweights.studies",
                       "fastweights.bench", "fastweights.commands", "fastweights.cli", "fastweights.lab"),
    "fastweights.hf": ("fastweights.training", "fastweights.tasks", "fastweights.studies", "fastweights.bench",
                       "fastweights.commands", "fastweights.cli", "fastweights.lab"),
    "fastweights.models": ("fastweights.training", "fastweights.io", "fastweights.hf", "fastweights.tasks"),
}


def _in_room(module, room):
    return module == room or module.startswith(room + ".")


def _forbidden_imports(edges):
    return sorted(f"{name} imports {target}" for room, banned in MAY_NOT_IMPORT.items()
                  for name, targets in edges.items() if _in_room(name, room)
                  for target in targets if any(_in_room(target, b) for b in banned))


def test_imports_run_one_way_between_the_rooms():
    edges = _graph()
    assert any(_in_room(t, "fastweights.io") for t in edges["fastweights.hf.convert"]), "hf reads checkpoints through io"
    assert _forbidden_imports(edges) == []
    # the check can fail: an edge from hf into training is found
    assert _forbidden_imports({"fastweights.hf.convert": {"fastweights.training.loop"}}) == [
        "fastweights.hf.convert imports fastweights.training.loop"]


def test_the_top_level_holds_only_the_shared_modules_the_rooms_and_the_old_paths():
    files = sorted(p.name for p in PACKAGE.iterdir() if p.is_file() and not p.name.endswith(".pyc"))
    old_top_level = [old.split(".")[1] + ".py" for old in OLD_PATHS if old.count(".") == 1]
    assert files == sorted(["__init__.py", "cli.py", "config.py", "py.typed"] + old_top_level)
    rooms = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms == ["commands", "hf", "io", "lab", "layers", "models", "ops", "studies", "tasks", "training"]


def test_an_old_path_is_a_small_module_that_warns_and_forwards():
    """One compatibility mechanism: each old path is a module of its own (a docstring, one
    DeprecationWarning naming the new path, imports from there); nothing hooks the import system."""
    for old in OLD_PATHS:
        path, _ = MODULES[old]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant) else tree.body
        kinds = [type(node).__name__ for node in body]
        assert set(kinds) <= {"Import", "ImportFrom", "Expr"}, (old, kinds)
        warns = [ast.unparse(node) for node in body if isinstance(node, ast.Expr)]
        assert len(warns) == 1 and "DeprecationWarning" in warns[0] and f"moved to `{MOVED_TO[old]}`" in warns[0], (old, warns)
    hooks = [name for name, (path, _) in MODULES.items() if "meta_path" in path.read_text(encoding="utf-8")]
    assert hooks == []


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_module_path_imports_the_new_module_with_a_warning(old):
    name, home = OLD_PATHS[old]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"`{old}` moved to"):
        module = importlib.import_module(old)
    assert getattr(module, name) is getattr(importlib.import_module(home), name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(importlib.import_module(home), name) is not None  # the new path does not warn


def test_old_from_imports_work_in_a_fresh_process():
    """``from fastweights.train import ...`` and friends, as user scripts wrote them, before
    anything else imported the new rooms."""
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n    from fastweights.train import TrainConfig\nexcept DeprecationWarning as e:\n    print('warned:', e)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        "from fastweights.train import TrainConfig, train, make_task, evaluate_tokens, PRECISIONS\n"
        "from fastweights.checkpoint import load_model, save_checkpoint, CheckpointError, FORMAT\n"
        "from fastweights.run_folder import RunFolderError, StopSignals, prune_checkpoints\n"
        "from fastweights import examples, lm_bench, tune_cpu_allocator\n"
        "from fastweights.bench import add_arguments, main\n"
        "import fastweights.training as t\n"
        "assert TrainConfig is t.TrainConfig and load_model is t.load_model and FORMAT == 'fastweights-lm-1'\n"
        "assert examples.all_examples and lm_bench.MIXERS and callable(main) and callable(tune_cpu_allocator)\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=PACKAGE.parent, env={**__import__("os").environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warned: `fastweights.train` moved to `fastweights.training`" in proc.stdout
    assert proc.stdout.strip().endswith("ok")


def test_the_old_bench_module_names_forward_to_chunk_speed_with_a_warning():
    from benchmarks import chunk_speed

    sys.modules.pop("fastweights.bench", None)
    with pytest.warns(DeprecationWarning, match="moved to `benchmarks.chunk_speed`"):
        bench = importlib.import_module("fastweights.bench")
    assert bench.add_arguments is chunk_speed.add_arguments and bench.main is chunk_speed.main
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = bench.no_such_name


def test_nothing_in_the_package_imports_the_benchmarks_but_the_old_paths():
    """The benchmarks live beside the package (``benchmarks/``, not installed); only the old module
    paths forward to them (and ``fastweights bench`` finds them in a checkout at run time)."""
    importers = sorted(name for name, (path, is_package) in MODULES.items()
                       if any(t == "benchmarks" or t.startswith("benchmarks.") for t, _ in _imports(name, path, is_package)))
    assert importers == ["fastweights.bench", "fastweights.lm_bench"]


def test_every_name_the_training_room_lists_resolves():
    import fastweights.training as training

    missing = [n for n in training.__all__ if not hasattr(training, n)]
    assert missing == [] and set(training.__all__) <= set(dir(training))


REPO = PACKAGE.parent


def _tracked_text_files():
    """The repository's tracked text files (empty where this is not a git checkout)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    keep = (".py", ".md", ".toml", ".js", ".html", ".css", "Makefile", ".ci/run")
    return [REPO / name for name in out.stdout.splitlines() if name.endswith(keep)]


def test_the_readme_stays_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    print(f"README.md: {len(lines)} lines")
    assert len(lines) <= 350


def test_no_file_points_at_a_tracker_or_a_document_readers_do_not_have():
    """Readers of the repository have neither the issue tracker nor the texts it was built from."""
    import re

    files = _tracked_text_files()
    if not files:
        pytest.skip("not a git checkout")
    pattern = re.compile(r"\b[Ii]ssues? ?#?[0-9]+\b|\.\./shared|\bDESIGN\.md|seed text")
    hits = [f"{path.relative_to(REPO)}:{n}" for path in files for n, line in
            enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
            if pattern.search(line) and path.name != "test_layout.py"]
    assert not hits, hits[:20]


def test_the_tasks_names_the_training_room_used_to_list_warn_and_resolve():
    """``fastweights.training.make_task`` and friends live in :mod:`fastweights.tasks`; the old names
    still resolve there, with a DeprecationWarning, and are not listed as the room's own."""
    import fastweights.tasks as tasks
    import fastweights.training as training

    for name in ("make_task", "RecallData", "TextData", "step_generator"):
        assert name not in training.__all__
        with pytest.warns(DeprecationWarning, match=f"moved to `fastweights.tasks.{name}`"):
            assert getattr(training, name) is getattr(tasks, name)
