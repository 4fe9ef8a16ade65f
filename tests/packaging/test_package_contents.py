"""What the wheel and the sdist hold, against what the installed package reads at run time.

The benchmarks (``benchmarks/`` beside the package) are not in the wheel: a checkout has them, an
installed copy does not (``fastweights bench`` says where they are).

Every file under ``fastweights/`` that is not Python (the compiled kernels' sources, the folders'
READMEs, the lab's page, ``py.typed``) must be in the wheel, or be listed in ``EXCLUDED`` with
the reason. The wheel and the sdist are built the way pip builds them (setuptools' PEP 517 hooks)
from a copy of the checkout, so a new kernel source that ``pyproject.toml`` does not list fails
here instead of silently sending every installed copy down the PyTorch path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from fastweights.ops import cpu

ROOT = Path(__file__).resolve().parents[2]
#: Non-Python files under fastweights/ that the wheel leaves out on purpose, with why.
EXCLUDED: dict = {}
_JUNK_DIRS = {"__pycache__"}
_JUNK_SUFFIXES = (".pyc", ".pyo", ".so")  # bytecode; a stray build product


def package_files() -> set:
    """Paths (``fastweights/...``) of every file of the package in the checkout."""
    out = set()
    for dirpath, dirnames, filenames in os.walk(ROOT / "fastweights"):
        dirnames[:] = [d for d in dirnames if d not in _JUNK_DIRS and not d.endswith(".egg-info")]
        for f in filenames:
            if not f.endswith(_JUNK_SUFFIXES):
                out.add((Path(dirpath) / f).relative_to(ROOT).as_posix())
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(wheel names, sdist names)``: both built from a clean copy of the checkout."""
    tmp = tmp_path_factory.mktemp("dist")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("fastweights", "benchmarks"):  # a clean checkout has both; only the package may ship
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    names = []
    for hook in ("build_wheel", "build_sdist"):  # one process each, as pip runs them (sharing one confuses setuptools)
        code = f"import sys; from setuptools import build_meta as b; print('BUILT', b.{hook}(sys.argv[1]))"
        r = subprocess.run([sys.executable, "-c", code, str(tmp / "out")], cwd=src, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        names.append(r.stdout.rsplit("BUILT ", 1)[1].strip())
    wheel_name, sdist_name = names
    with zipfile.ZipFile(tmp / "out" / wheel_name) as z:
        wheel = set(z.namelist())
    with tarfile.open(tmp / "out" / sdist_name) as t:
        prefix = sdist_name[: -len(".tar.gz")] + "/"
        sdist = {m.name[len(prefix):] for m in t.getmembers() if m.isfile()}
    return wheel, sdist


def test_the_wheel_holds_every_file_the_package_reads(built):
    wheel, _ = built
    need = package_files()
    assert not set(EXCLUDED) - need, f"EXCLUDED names files that no longer exist: {sorted(set(EXCLUDED) - need)}"
    missing = sorted(need - wheel - set(EXCLUDED))
    assert not missing, f"in fastweights/ but not in the wheel (add them to [tool.setuptools.package-data]): {missing}"
    shipped_anyway = sorted(set(EXCLUDED) & wheel)
    assert not shipped_anyway, f"listed as excluded but in the wheel: {shipped_anyway}"


def test_the_wheel_holds_the_kernel_sources_the_build_compiles(built):
    """The build's own list (sources and headers) against the wheel: the first-use build from an
    installed copy finds every file it compiles or includes."""
    wheel, _ = built
    kernel_files = {f"fastweights/ops/cpu/{n}" for n in cpu._SOURCES + cpu._HEADERS}
    assert kernel_files <= wheel, sorted(kernel_files - wheel)
    on_disk = {f"fastweights/ops/cpu/{p.name}" for p in cpu._HERE.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == kernel_files, f"kernel sources on disk that the build does not list (or the reverse): {sorted(on_disk ^ kernel_files)}"


def test_the_sdist_holds_the_wheel_and_what_builds_it(built):
    wheel, sdist = built
    in_package = {n for n in wheel if n.startswith("fastweights/")}
    assert in_package <= sdist, sorted(in_package - sdist)
    assert {"pyproject.toml", "README.md", "LICENSE"} <= sdist


def _imports_benchmarks(path: Path) -> bool:
    import ast

    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        if any(n == "benchmarks" or n.startswith("benchmarks.") for n in names):
            return True
    return False


def test_the_wheel_holds_no_benchmark_code(built):
    """The installed package contains no benchmark: nothing of ``benchmarks/`` (which the build saw)
    or of the package's old ``bench/`` room, and the only modules that name the benchmarks are the
    two old module paths that forward to them (a few lines each)."""
    wheel, _ = built
    assert (ROOT / "benchmarks" / "run.py").is_file(), "the checkout's benchmarks are missing: this test would prove nothing"
    top = {name.split("/")[0] for name in wheel if ".dist-info/" not in name}
    assert top == {"fastweights"}, sorted(top)
    assert [name for name in wheel if name.startswith("fastweights/bench/")] == []
    forwarding = sorted(name for name in wheel if name.endswith(".py") and _imports_benchmarks(ROOT / name))
    assert forwarding == ["fastweights/bench.py", "fastweights/lm_bench.py"]
    assert all(len((ROOT / name).read_text(encoding="utf-8").splitlines()) <= 20 for name in forwarding)
