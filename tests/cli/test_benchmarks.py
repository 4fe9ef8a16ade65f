"""The benchmarks beside the package (``benchmarks/``): one registry, one runner, one argument style
(a ``Config`` dataclass with declared flags, as the studies have), no private imports of the
package, and ``fastweights bench`` on the same registry. Small, honest runs only: speed is never
asserted (BENCHMARKS.md has the figures)."""

import ast
import dataclasses
import json
from pathlib import Path

import pytest

import benchmarks
from benchmarks import REGISTRY, SHARED
from benchmarks.run import config_of, load, main as run_benchmarks, parser_of

FOLDER = Path(benchmarks.__file__).resolve().parent


def test_importing_a_benchmark_changes_nothing_in_the_process():
    """A benchmark sets its environment in ``main`` (Triton reads ``TRITON_INTERPRET`` once): loading
    every module, as the runner and ``fastweights bench`` do, leaves ``os.environ`` as it was."""
    import os

    before = dict(os.environ)
    for name in REGISTRY:
        load(name)
    assert dict(os.environ) == before


def test_the_registry_lists_every_benchmark_module_and_nothing_else():
    modules = {p.stem for p in FOLDER.glob("*.py") if not p.stem.startswith("_") and p.stem != "run"}
    assert modules == set(REGISTRY) | set(SHARED) and not set(REGISTRY) & set(SHARED)
    assert all(isinstance(what, str) and what for what in REGISTRY.values())


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_benchmark_declares_its_flags_in_a_config_and_runs_from_main(name):
    module = load(name)
    assert dataclasses.is_dataclass(module.Config) and callable(module.main)
    flags = [f for f in dataclasses.fields(module.Config) if "flag" in f.metadata]
    help_text = parser_of(name).format_help()
    for f in flags:
        spec = f.metadata["flag"]
        assert (spec["name"] or "--" + f.name.replace("_", "-")) in help_text, (name, f.name)
    assert config_of(name) == module.Config()  # no flags: the dataclass's defaults


def test_the_runner_lists_refuses_unknown_names_and_parses_each_benchmarks_flags(capsys):
    assert run_benchmarks(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in REGISTRY)
    with pytest.raises(ValueError, match="unknown benchmark 'no_such_bench'; known: chunk_speed"):
        run_benchmarks(["family_speed", "no_such_bench"])
    config = config_of("family_speed", ["--T", "64", "--families", "gdn2"])
    assert config.T == 64 and config.families == ("gdn2",) and config.K == 64
    with pytest.raises(SystemExit):
        config_of("family_speed", ["--no-such-flag"])


def test_a_small_run_through_the_runner_writes_its_json(tmp_path, one_thread):
    out = tmp_path / "family.json"
    assert run_benchmarks(["family_speed", "--T", "16", "--H", "1", "--K", "8", "--V", "8", "--chunk-size", "8",
                           "--repeats", "1", "--threads", "1", "--families", "gdn2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["shape"]["T"] == 16 and [r["family"] for r in result["speed"]] == ["gdn2"]


def _fastweights_imports(path):
    """``(module, names)`` of every ``import fastweights...`` / ``from fastweights... import`` in a file."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("fastweights"):
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("fastweights"):
                    yield a.name, []


def test_no_benchmark_imports_a_private_name_of_the_package_or_the_training_rooms_modules():
    private = []
    for path in sorted(FOLDER.glob("*.py")):
        for module, names in _fastweights_imports(path):
            parts = module.split(".")[1:] + names
            if any(p.startswith("_") for p in parts) or module.startswith("fastweights.training."):
                private.append(f"{path.name}: {module} {names}")
    assert private == []
    # and no benchmark reaches into the package by relative import (they are not part of it)
    relative = [p.name for p in FOLDER.glob("*.py") for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                if isinstance(n, ast.ImportFrom) and n.level > 1]
    assert relative == []


def test_fastweights_bench_says_where_the_benchmarks_are_when_they_are_not_installed(tmp_path, monkeypatch, capsys):
    from fastweights.cli import main
    from fastweights.commands import bench as command

    monkeypatch.setattr(command, "CHECKOUT", tmp_path)  # an installed copy: no benchmarks/ beside the package
    assert command.runner() is None
    assert main(["bench"]) == 2
    assert "not part of the installed package" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit:  # flags of the benchmarks: the same answer, not "unrecognized"
        main(["bench", "--lm", "--T", "64"])
    assert exit.value.code == 2 and "not part of the installed package" in capsys.readouterr().err
