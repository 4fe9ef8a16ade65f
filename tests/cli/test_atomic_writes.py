"""Result files are written atomically: every JSON a benchmark or command writes goes
through ``fastweights.config.atomic_write_text`` (temp file in the same folder, fsync,
``os.replace``), so a kill or a full disk mid-write leaves the previous file whole and
no temp file behind.
"""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from fastweights import config as config_module
from fastweights.config import atomic_write_text

ROOT = Path(__file__).resolve().parents[2]


def _plain_json_writes(path: Path):
    """``x.write_text(...)`` calls whose text comes from ``json.dumps`` (line numbers)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write_text":
            inner = [n for a in node.args for n in ast.walk(a)]
            if any(isinstance(n, ast.Attribute) and n.attr == "dumps" for n in inner):
                found.append(node.lineno)
    return found


def test_no_result_json_is_written_with_plain_write_text():
    files = sorted(ROOT.glob("fastweights/**/*.py"))
    offenders = {str(f.relative_to(ROOT)): lines for f in files if (lines := _plain_json_writes(f))}
    print(f"scanned {len(files)} files; plain JSON writes: {offenders}")
    assert len(files) > 20  # the scan saw the code base
    assert not offenders, f"use fastweights.config.atomic_write_text for these JSON writes: {offenders}"


class DiskFull(OSError):
    pass


@pytest.mark.parametrize("where", ["write", "replace"])
def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path, monkeypatch, where):
    target = tmp_path / "results" / "bench.json"
    atomic_write_text(target, json.dumps({"run": 1}))
    if where == "replace":
        def replace(src, dst):
            raise DiskFull(28, "No space left on device")
        monkeypatch.setattr(config_module.os, "replace", replace)
    else:
        real_fdopen = os.fdopen

        def fdopen(fd, *args, **kwargs):
            f = real_fdopen(fd, *args, **kwargs)

            def write(text):
                raise DiskFull(28, "No space left on device")
            f.write = write
            return f
        monkeypatch.setattr(config_module.os, "fdopen", fdopen)
    with pytest.raises(DiskFull):
        atomic_write_text(target, json.dumps({"run": 2}))
    monkeypatch.undo()
    left = sorted(p.name for p in target.parent.iterdir())
    print(f"after a failed {where}: {left}, content {target.read_text()}")
    assert left == ["bench.json"]
    assert json.loads(target.read_text()) == {"run": 1}
