"""The compiled kernels' cache (fastweights/ops/cpu/kernel_cache.py): killed builds, waits, truncated
libraries, read-only caches and two checkouts.

The lock and verification logic does not depend on what is compiled, so these tests give it a
stand-in compile step: a ten-line C extension (``answer() -> 42``) built with the system's C
compiler in a fraction of a second, copied into place in slices with pauses so that a kill can land
mid-write. The children load ``kernel_cache.py`` by its path (it imports only the standard
library), so each starts in ~0.1 s instead of importing torch. One real build, from two
checkout paths, is marked slow.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

from fastweights.ops import cpu
from fastweights.ops.cpu import kernel_cache as kc

_KC_PATH = Path(kc.__file__).resolve()
_CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
pytestmark = pytest.mark.skipif(_CC is None or not Path(sysconfig.get_paths()["include"], "Python.h").exists(),
                                reason="needs a C compiler and Python's headers for the stand-in extension")

_EXT_C = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "42"}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "NAME", NULL, -1, methods};
PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&def); }
"""


def compile_probe(name: str, out: Path) -> Path:
    """Build the stand-in extension module ``name`` into ``out`` (a file path)."""
    src = out.with_suffix(".c")
    src.write_text(_EXT_C.replace("NAME", name))
    subprocess.run([_CC, "-shared", "-fPIC", "-O0", "-I", sysconfig.get_paths()["include"], str(src), "-o", str(out)],
                   check=True, capture_output=True)
    src.unlink()
    return out


@pytest.fixture(scope="module")
def probe_so(tmp_path_factory) -> Path:
    """One stand-in library, module name ``fwprobe``, that the children's compile step copies."""
    return compile_probe("fwprobe", tmp_path_factory.mktemp("probe") / "fwprobe.so")


# The children's program: load_or_build on FOLDER with a compile step that copies the probe in
# slices (STEP_S apart), counting its calls in FOLDER/../compiles.
_CHILD = textwrap.dedent("""
    import importlib.util, json, os, signal, sys, time
    from pathlib import Path
    spec = importlib.util.spec_from_file_location("kernel_cache", os.environ["KC_PATH"])
    kc = importlib.util.module_from_spec(spec); spec.loader.exec_module(kc)
    folder = Path(os.environ["FOLDER"]); step = float(os.environ.get("STEP_S", "0"))
    if os.environ.get("FLAG_HANDLER"):  # like train's: the first SIGTERM only asks to stop later
        signal.signal(signal.SIGTERM, lambda s, f: print("handler saw", signal.Signals(s).name, flush=True))

    def compile_step(private):
        with open(folder.parent / "compiles", "a") as f:
            f.write(f"{os.getpid()}\\n")
        data = Path(os.environ["PROBE"]).read_bytes()
        out = private / "fwprobe.so"
        with open(out, "wb") as f:
            for i in range(0, len(data), len(data) // 8 + 1):
                f.write(data[i:i + len(data) // 8 + 1]); f.flush(); time.sleep(step)
        time.sleep(float(os.environ.get("HOLD_S", "0")))
        return out

    print("ready", flush=True)
    t0 = time.monotonic()
    try:
        mod = kc.load_or_build(folder, "fwprobe", compile_step, wait_s=float(os.environ.get("WAIT_S", "30")))
    except kc.KernelCacheError as exc:
        print("fallback", type(exc).__name__, exc, flush=True)
        sys.exit(3)
    print("answer", mod.answer(), f"{time.monotonic() - t0:.2f}", flush=True)
""")


def _start(folder: Path, probe: Path, **env) -> subprocess.Popen:
    e = dict(os.environ, KC_PATH=str(_KC_PATH), FOLDER=str(folder), PROBE=str(probe), **{k: str(v) for k, v in env.items()})
    p = subprocess.Popen([sys.executable, "-c", _CHILD], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def _finish(p: subprocess.Popen, timeout: float = 60):
    """Wait for the child; its whole stdout (after "ready") and stderr. (Not communicate(): it reads
    the pipes' descriptors and would miss what readline() has already buffered.)"""
    p.wait(timeout=timeout)
    os.set_blocking(p.stderr.fileno(), True)
    out, err = p.stdout.read() or "", p.stderr.read() or ""
    p.stdout.close()
    p.stderr.close()
    return p.returncode, out, _stderr_seen.pop(p.pid, "") + err


def _compiles(folder: Path) -> int:
    f = folder.parent / "compiles"
    return len(f.read_text().split()) if f.exists() else 0


def _build_entry(folder: Path, probe: Path) -> None:
    rc, out, err = _finish(_start(folder, probe))
    assert rc == 0 and out.startswith("answer 42"), (out, err)
    assert kc.check_entry(folder, "fwprobe") is None


def test_entry_records_size_and_sha256_and_publishes_nothing_else(tmp_path, probe_so):
    folder = tmp_path / "cpu_kernels" / "k"
    _build_entry(folder, probe_so)
    record = json.loads((folder / kc.ENTRY).read_text())
    size, digest = kc.file_digest(folder / "fwprobe.so")
    assert (record["size"], record["sha256"]) == (size, digest) == (probe_so.stat().st_size, kc.file_digest(probe_so)[1])
    assert record["built_by"]["pid"] > 0 and record["built_by"]["host"]
    assert sorted(p.name for p in folder.iterdir()) == [kc.LOCK, kc.ENTRY, "fwprobe.so"]  # the private folder is gone
    assert (folder / kc.LOCK).read_text() == ""  # released cleanly: nothing for a next process to take over


def test_a_complete_entry_loads_without_lock_or_write(tmp_path):
    """The path a read-only cache takes: a verified entry is loaded, nothing is opened for writing."""
    folder = tmp_path / "entry"
    name = "fwprobe_inproc_a"
    mod = kc.load_or_build(folder, name, lambda d: compile_probe(name, d / f"{name}.so"), say=lambda m: None)
    assert mod.answer() == 42
    (folder / kc.LOCK).unlink()
    sys.modules.pop(name)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def no_compile(_):
        raise AssertionError("a verified entry must not be rebuilt")

    assert kc.load_or_build(folder, name, no_compile).answer() == 42
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before  # no lock file, nothing touched


@pytest.mark.parametrize("damage", ["truncate", "flip", "record"])
def test_a_damaged_library_is_rebuilt_never_loaded(tmp_path, probe_so, damage):
    """A truncated .so used to be mapped and die with SIGBUS; now its size/SHA-256 mismatch rebuilds it."""
    folder = tmp_path / "cpu_kernels" / "k"
    _build_entry(folder, probe_so)
    lib = folder / "fwprobe.so"
    data = lib.read_bytes()
    if damage == "truncate":
        lib.write_bytes(data[: len(data) // 3])
    elif damage == "flip":  # same size, one byte changed
        lib.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    else:
        (folder / kc.ENTRY).write_text("{not json")
    rc, out, err = _finish(_start(folder, probe_so))
    assert rc == 0 and out.startswith("answer 42"), (out, err)
    assert "fail their check" in err and "rebuilding" in err, err
    assert _compiles(folder) == 2 and kc.check_entry(folder, "fwprobe") is None


def test_a_failed_compile_leaves_no_entry_and_no_lock_holder(tmp_path):
    """The compile step's error reaches the caller (which falls back); the private folder is gone,
    the lock released, and the next call builds."""
    folder = tmp_path / "entry"
    name = "fwprobe_inproc_b"

    def broken(private):
        (private / "half.o").write_bytes(b"x")
        raise RuntimeError("compiler said no")

    with pytest.raises(RuntimeError, match="compiler said no"):
        kc.load_or_build(folder, name, broken, say=lambda m: None)
    assert sorted(p.name for p in folder.iterdir()) == [kc.LOCK] and (folder / kc.LOCK).read_text() == ""
    assert kc.load_or_build(folder, name, lambda d: compile_probe(name, d / f"{name}.so"), say=lambda m: None).answer() == 42


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, probe_so):
    """A lock file naming a holder that is gone (it holds no flock): the next process builds at once."""
    folder = tmp_path / "cpu_kernels" / "k"
    folder.mkdir(parents=True)
    (folder / kc.LOCK).write_text(json.dumps({"pid": 999999, "host": "elsewhere", "started": "2026-01-01 00:00:00 UTC",
                                              "started_unix": time.time() - 60}))
    (folder / "build-elsewhere-999999").mkdir()  # its private folder, left behind
    rc, out, err = _finish(_start(folder, probe_so), timeout=30)
    assert rc == 0 and out.startswith("answer 42"), (out, err)
    assert "taking over the CPU kernel build lock" in err and "pid 999999 on host elsewhere" in err and "which is gone" in err
    assert not (folder / "build-elsewhere-999999").exists()


@pytest.mark.parametrize("seed", [0, 1, 2] + [pytest.param(s, marks=pytest.mark.slow) for s in range(3, 15)])
def test_a_build_killed_at_a_random_point_never_blocks_the_next(tmp_path, probe_so, seed):
    """SIGKILL a building process at a random moment (before, during, after its compile step); a second
    process then finishes within a bounded time with a verified build, and no private folder stays."""
    folder = tmp_path / "cpu_kernels" / "k"
    first = _start(folder, probe_so, STEP_S=0.1, HOLD_S=0.2)  # ~1 s of compile step
    time.sleep(random.Random(seed).uniform(0.0, 1.4))
    first.kill()
    _finish(first)
    t0 = time.monotonic()
    rc, out, err = _finish(_start(folder, probe_so, WAIT_S=30), timeout=60)
    assert rc == 0 and out.startswith("answer 42"), (out, err)
    assert time.monotonic() - t0 < 20, "the second process must not wait for a dead builder"
    assert "waiting for" not in err, err
    assert kc.check_entry(folder, "fwprobe") is None
    assert not list(folder.glob("build-*"))


def test_a_waiter_names_the_holder_and_gives_up_after_its_bound(tmp_path, probe_so):
    folder = tmp_path / "cpu_kernels" / "k"
    holder = _start(folder, probe_so, HOLD_S=60)
    try:
        _wait_for_lock_text(folder)
        t0 = time.monotonic()
        rc, out, err = _finish(_start(folder, probe_so, WAIT_S=1.0), timeout=30)
        waited = time.monotonic() - t0
    finally:
        holder.kill()
        _finish(holder)
    assert rc == 3 and "BuildWaitError" in out and "waited 1 s" in out and kc.WAIT_ENV in out, (out, err)
    assert f"waiting for the CPU kernel build by pid {holder.pid} on host" in err, err
    assert waited < 15


def _wait_for_lock_text(folder: Path, timeout: float = 20) -> None:
    """Until a holder has written its name into the lock (it then builds for HOLD_S seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (folder / kc.LOCK).exists() and (folder / kc.LOCK).read_text().strip():
            return
        time.sleep(0.05)
    raise AssertionError("the first process never took the lock")


@pytest.mark.parametrize("handler", ["default", "flag"])
def test_sigterm_ends_the_wait(tmp_path, probe_so, handler):
    """SIGTERM reaches a waiting process: the default action ends it at once; a handler that only
    records it (as ``train``'s first SIGTERM does) runs, and the wait ends with the fallback."""
    folder = tmp_path / "cpu_kernels" / "k"
    holder = _start(folder, probe_so, HOLD_S=60)
    try:
        _wait_for_lock_text(folder)
        env = {"WAIT_S": 600} if handler == "default" else {"WAIT_S": 600, "FLAG_HANDLER": 1}
        waiter = _start(folder, probe_so, **env)
        deadline = time.monotonic() + 20
        while "waiting" not in _peek_stderr(waiter) and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        waiter.send_signal(signal.SIGTERM)
        rc, out, err = _finish(waiter, timeout=30)
        took = time.monotonic() - t0
    finally:
        holder.kill()
        _finish(holder)
    assert took < 10, took
    if handler == "default":
        assert rc == -signal.SIGTERM, (rc, out, err)
    else:
        assert rc == 3 and "handler saw SIGTERM" in out and "SIGTERM received" in out, (rc, out, err)


_stderr_seen = {}


def _peek_stderr(p: subprocess.Popen) -> str:
    """What the child has written to stderr so far (non-blocking)."""
    os.set_blocking(p.stderr.fileno(), False)
    try:
        chunk = os.read(p.stderr.fileno(), 65536).decode()
    except BlockingIOError:
        chunk = ""
    _stderr_seen[p.pid] = _stderr_seen.get(p.pid, "") + chunk
    return _stderr_seen[p.pid]


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    d = Path(tempfile.mkdtemp())
    try:
        r = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount --bind -o ro "{d}" "{d}" && ! touch "{d}/x" 2>/dev/null'],
                           capture_output=True, timeout=30)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.mark.skipif(not _unshare_works(), reason="needs `unshare -rm` (user and mount namespaces) for a read-only bind mount")
@pytest.mark.parametrize("state", ["complete", "truncated"])
def test_a_read_only_cache(tmp_path, probe_so, state):
    """The cache mounted read-only (a bind mount in a private mount namespace: root ignores chmod, not
    a read-only mount). A complete entry loads; a damaged one falls back at once, never waits."""
    folder = tmp_path / "ro" / "cpu_kernels" / "k"
    _build_entry(folder, probe_so)
    if state == "truncated":
        lib = folder / "fwprobe.so"
        lib.write_bytes(lib.read_bytes()[:1000])
    (folder / kc.LOCK).unlink()
    ro = tmp_path / "ro"
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, KC_PATH=str(_KC_PATH), FOLDER=str(folder), PROBE=str(probe_so), WAIT_S="600")
    r = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount --bind -o ro "{ro}" "{ro}" && exec "{sys.executable}" "{script}"'],
                       env=env, capture_output=True, text=True, timeout=60)
    if state == "complete":
        assert r.returncode == 0 and "answer 42" in r.stdout, (r.stdout, r.stderr)
    else:
        assert r.returncode == 3 and "not writable" in r.stdout and "has 1000 bytes" in r.stdout, (r.stdout, r.stderr)
    assert not (folder / kc.LOCK).exists()


def test_the_key_covers_the_build_and_not_the_checkout(tmp_path, monkeypatch):
    """Two checkouts of the same sources (different folders), or another ninja on PATH: one key.
    A changed source byte, flag or compiler: another key."""
    names = cpu._SOURCES + cpu._HEADERS
    for d in ("a/fastweights/ops/cpu", "b/elsewhere"):
        (tmp_path / d).mkdir(parents=True)
        for n in names:
            shutil.copy(cpu._HERE / n, tmp_path / d / n)
    key = cpu._build_key()
    monkeypatch.setattr(cpu, "_HERE", tmp_path / "a/fastweights/ops/cpu")
    assert cpu._build_key() == key
    monkeypatch.setattr(cpu, "_HERE", tmp_path / "b/elsewhere")
    assert cpu._build_key() == key
    fake_ninja = tmp_path / "bin" / "ninja"
    fake_ninja.parent.mkdir()
    fake_ninja.write_text("#!/bin/sh\necho 1.0.0\n")
    fake_ninja.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_ninja.parent}{os.pathsep}{os.environ['PATH']}")
    assert cpu._build_key() == key
    with open(tmp_path / "b/elsewhere" / names[0], "ab") as f:
        f.write(b"\n")
    assert cpu._build_key() != key
    monkeypatch.setattr(cpu, "_HERE", tmp_path / "a/fastweights/ops/cpu")
    monkeypatch.setattr(cpu, "_CFLAGS", cpu._CFLAGS + ("-g",))
    assert cpu._build_key() != key
    monkeypatch.setattr(cpu, "_CFLAGS", cpu._CFLAGS[:-1])
    monkeypatch.setattr(cpu, "_compiler_line", "c++: another compiler 99")
    assert cpu._build_key() != key


def test_two_checkouts_share_one_entry(tmp_path, probe_so):
    """The entry holds no path of the checkout that built it: a second checkout's process loads it."""
    folder = tmp_path / "cpu_kernels" / "k"
    _build_entry(folder, probe_so)
    other = tmp_path / "checkout2" / "kernel_cache.py"
    other.parent.mkdir()
    shutil.copy(_KC_PATH, other)
    e = dict(os.environ, KC_PATH=str(other), FOLDER=str(folder), PROBE=str(probe_so))
    r = subprocess.run([sys.executable, "-c", _CHILD], env=e, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "answer 42" in r.stdout, r.stderr
    assert _compiles(folder) == 1


def test_the_wait_bound_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(kc.WAIT_ENV, raising=False)
    assert kc.wait_seconds() == kc.DEFAULT_WAIT_S
    monkeypatch.setenv(kc.WAIT_ENV, "2.5")
    assert kc.wait_seconds() == 2.5
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(kc.WAIT_ENV, bad)
        with pytest.raises(ValueError, match=f"{kc.WAIT_ENV} must be a number of seconds >= 0, got '{bad}'"):
            kc.wait_seconds()


def test_the_package_falls_back_with_one_warning_when_the_wait_ends(tmp_path, monkeypatch, capfd):
    """fastweights.ops.cpu itself, from a fresh state: another holder (here an flock on a second open
    file, which conflicts within one process too) keeps the build lock past the bound; chunk calls
    give one RuntimeWarning naming the wait, and the PyTorch path's (correct) results."""
    from fastweights import ops

    monkeypatch.setenv("FASTWEIGHTS_CACHE", str(tmp_path))
    monkeypatch.setenv(kc.WAIT_ENV, "0.5")
    for name, value in (("_tried", False), ("_module", None), ("_error", None), ("_enabled_override", True)):
        monkeypatch.setattr(cpu, name, value)  # restored afterwards: the session's loaded kernels come back
    folder = cpu.cache_dir()
    folder.mkdir(parents=True)
    q = torch.nn.functional.normalize(torch.randn(1, 33, 2, 8, dtype=torch.float64), dim=-1)
    beta = torch.rand(1, 33, 2, dtype=torch.float64)
    with open(folder / kc.LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps({"pid": 4242, "host": "there", "started": "now", "started_unix": time.time()}))
        f.flush()
        with pytest.warns(RuntimeWarning) as caught:
            o, _ = ops.chunk_delta_rule(q, q, q, beta)
            o2, _ = ops.chunk_delta_rule(q, q, q, beta)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "waited 0 s for the CPU kernel build by pid 4242 on host there" in messages[0] and "using the PyTorch path" in messages[0]
    assert cpu.status().startswith("PyTorch path (compiled CPU kernels unavailable: BuildWaitError")
    assert "waiting for the CPU kernel build by pid 4242 on host there" in capfd.readouterr().err
    ref, _ = ops.recurrent_delta_rule(q, q, q, beta)
    assert float((o - ref).abs().max()) < 1e-10 and torch.equal(o, o2)


def test_the_report_names_the_path_each_op_takes(capsys):
    """``python -m fastweights.ops.cpu``'s table: every op reaches the compiled kernels when they are
    loaded, and none does when they are turned off."""
    from fastweights.ops.cpu.__main__ import report

    if not cpu.available():
        pytest.skip(f"compiled CPU kernels unavailable: {cpu.status()}")
    assert report() == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("compiled CPU kernels") and len(lines) > 5
    assert all(" compiled (" in ln for ln in lines[1:]), lines
    assert any("chunk_delta_fwd" in ln for ln in lines) and any("chunk_delta_bwd" in ln for ln in lines)
    cpu.set_enabled(False)
    try:
        assert report() == 0
    finally:
        cpu.set_enabled(None)
    lines = capsys.readouterr().out.strip().splitlines()
    assert "turned off" in lines[0] and all(ln.endswith("PyTorch path") for ln in lines[1:]), lines
    assert cpu.kernels() is not None, "the report left the package without its loaded kernels"


@pytest.mark.slow
def test_a_real_build_is_shared_by_two_checkouts(tmp_path):
    """One real compile (about a minute on 2 cores): from a copy of the package at one path, then
    from a copy at another, which loads it without compiling."""
    src = Path(cpu.__file__).parents[2]
    for name in ("one", "two"):
        shutil.copytree(src, tmp_path / name / "fastweights", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, FASTWEIGHTS_CACHE=str(tmp_path / "cache"))
    runs = []
    for name in ("one", "two"):
        env["PYTHONPATH"] = str(tmp_path / name)
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "fastweights.ops.cpu"], env=env, capture_output=True, text=True,
                           timeout=900, cwd=tmp_path / name)
        runs.append((r, time.monotonic() - t0))
        assert r.returncode == 0 and "compiled CPU kernels" in r.stdout, (r.stdout, r.stderr)
    assert "compiling" in runs[0][0].stderr and "compiling" not in runs[1][0].stderr, runs[1][0].stderr
    assert len(list((tmp_path / "cache" / "cpu_kernels").iterdir())) == 1
