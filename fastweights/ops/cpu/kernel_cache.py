"""The compiled CPU kernels' cache: one verified entry per build key, a build lock that names its
holder and dies with it, a bounded wait that signals can end, and loads that never map an
unchecked file.

An entry is the folder ``<root>/cpu_kernels/<key>/``:

- ``<module>.so``: the built extension. It is renamed into place whole and never written in
  place, so a process that has it mapped never sees it change under it;
- ``entry.json``: the ``.so``'s size and SHA-256 (and what built it, for people), written after the
  ``.so`` by temp file + rename. The entry is *complete* when both exist and the file's size and
  digest match the record; only a complete entry is loaded, and loading it takes no lock and
  writes nothing, so a read-only cache (a shared mount) works;
- ``build.lock``: held with ``flock`` by the one process that builds; its text names the holder
  (pid, host, start time). The operating system drops an ``flock`` when its holder exits however it
  exits (SIGKILL included), so a killed build never leaves a lock that others wait on: the next
  process gets it at once and says whose build it takes over. The file itself stays (removing a
  locked file races with a process that has just opened it);
- ``build-<host>-<pid>/``: the builder's private folder (``torch.utils.cpp_extension`` writes its
  ninja file, objects and its own lock there), removed after publishing, or by the next builder
  when its owner was killed. Nothing in it is shared, so a path baked into a ninja file (the
  checkout's) never makes another checkout rebuild.

This module imports only the standard library: the caller passes the compile step, so the lock and
verification logic is tested with a small stand-in extension instead of a minute-long build.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, List, Optional

try:  # POSIX; elsewhere builds run unlocked (still safe: every build is private until its atomic publish)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = [
    "ENTRY", "LOCK", "WAIT_ENV", "DEFAULT_WAIT_S", "KernelCacheError", "BuildWaitError",
    "wait_seconds", "file_digest", "check_entry", "load_extension", "load_or_build", "build_key", "compiler_version",
]

ENTRY = "entry.json"
LOCK = "build.lock"
#: Seconds a process waits for another's build before it runs the PyTorch path (a build takes
#: about a minute on 2 idle cores, a few under load).
WAIT_ENV = "FASTWEIGHTS_KERNEL_WAIT"
DEFAULT_WAIT_S = 300.0
_POLL_S = 0.25


class KernelCacheError(RuntimeError):
    """The cache can neither give a verified build nor make one (unwritable, wait over, ...)."""


class BuildWaitError(KernelCacheError):
    """Gave up waiting for another process's build (time out, or a signal asked this one to stop)."""


def wait_seconds() -> float:
    """``$FASTWEIGHTS_KERNEL_WAIT`` (seconds, ≥ 0) or the default; a bad value is a ValueError naming it."""
    raw = os.environ.get(WAIT_ENV, "").strip()
    if not raw:
        return DEFAULT_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0:  # also catches nan
        raise ValueError(f"{WAIT_ENV} must be a number of seconds >= 0, got {raw!r}")
    return value


def _say(message: str) -> None:
    print("fastweights: " + message, file=sys.stderr, flush=True)


def file_digest(path: Path) -> tuple:
    """``(size in bytes, SHA-256 hex)`` of a file, read in blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def _library_name(module: str) -> str:
    return module + importlib.machinery.EXTENSION_SUFFIXES[-1]  # ".so" on Linux, ".pyd" on Windows


def check_entry(folder: Path, module: str) -> Optional[str]:
    """None when ``folder`` holds a complete, verified build of ``module``; else why not (a phrase).

    Reads only: ``entry.json`` (JSON, never code) and the library's bytes."""
    record_path = Path(folder) / ENTRY
    try:
        record = json.loads(record_path.read_text())
    except FileNotFoundError:
        return "no build yet"
    except (OSError, ValueError) as exc:
        return f"unreadable {ENTRY} ({type(exc).__name__})"
    if not isinstance(record, dict) or record.get("module") != module or record.get("file") != _library_name(module):
        return f"{ENTRY} describes another build"
    library = Path(folder) / record["file"]
    try:
        size, digest = file_digest(library)
    except OSError as exc:
        return f"{record['file']} unreadable ({type(exc).__name__})"
    if size != record.get("size"):
        return f"{record['file']} has {size} bytes, {ENTRY} says {record.get('size')}"
    if digest != record.get("sha256"):
        return f"{record['file']}'s SHA-256 differs from {ENTRY}'s"
    return None


def load_extension(path: Path, module: str):
    """Import the extension module ``module`` from the library file ``path``."""
    if module in sys.modules:  # this process built it (the compile step imports it) or loaded it
        return sys.modules[module]
    loader = importlib.machinery.ExtensionFileLoader(module, str(path))
    spec = importlib.util.spec_from_file_location(module, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules[module] = mod
    return mod


def _holder_text() -> str:
    now = datetime.datetime.now(datetime.timezone.utc)
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": now.strftime("%Y-%m-%d %H:%M:%S UTC"),
                       "started_unix": time.time()})


def _describe_holder(text: str) -> str:
    """``pid 123 on host h, started 2026-… UTC (40 s ago)`` from a lock file's text."""
    try:
        h = json.loads(text)
        ago = max(0.0, time.time() - float(h["started_unix"]))
        return f"pid {int(h['pid'])} on host {h['host']}, started {h['started']} ({ago:.0f} s ago)"
    except (ValueError, KeyError, TypeError):
        return "another process (it has not written its name yet)"


@contextlib.contextmanager
def _signals_end_the_wait():
    """While waiting, SIGINT/SIGTERM stop the wait; on leaving, the signal is raised again so the
    process's own handling runs (the default ends it; ``train``'s handler finishes its step on the
    PyTorch path and saves). Yields a list that receives the signal's number. Main thread only
    (handlers can be set nowhere else; other threads' waits end on the time bound)."""
    got: List[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            old = signal.getsignal(s)
            if old in (signal.SIG_IGN, None):  # ignored stays ignored; None: set outside Python
                continue
            previous[s] = signal.signal(s, lambda signum, frame: got.append(signum))
    try:
        yield got
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
        if got:
            signal.raise_signal(got[0])


class _BuildLock:
    """``flock`` on ``<folder>/build.lock``; waits at most ``wait_s`` seconds, saying for whom."""

    def __init__(self, folder: Path, wait_s: float, say: Callable[[str], None]) -> None:
        self.path = Path(folder) / LOCK
        self.wait_s, self.say = wait_s, say
        self.fd: Optional[int] = None

    def _try(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _text(self) -> str:
        try:
            return os.pread(self.fd, 4096, 0).decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def __enter__(self) -> "_BuildLock":
        if fcntl is None:
            return self
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise KernelCacheError(f"cannot open the build lock {self.path} ({exc.strerror or exc})") from None
        try:
            if not self._try():
                self._wait()
            left = self._text()
            if left:  # the previous holder exited without releasing: killed mid-build
                self.say(f"taking over the CPU kernel build lock in {self.path.parent} from {_describe_holder(left)}, which is gone")
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, _holder_text().encode(), 0)
        except BaseException:
            os.close(self.fd)
            self.fd = None
            raise
        return self

    def _wait(self) -> None:
        holder = _describe_holder(self._text())
        self.say(f"waiting for the CPU kernel build by {holder} in {self.path.parent} "
                 f"(at most {self.wait_s:.0f} s; {WAIT_ENV} sets it)")
        deadline = time.monotonic() + self.wait_s
        with _signals_end_the_wait() as got:
            while True:
                if self._try():
                    return
                if got:
                    raise BuildWaitError(f"stopped waiting for the CPU kernel build by {holder} "
                                         f"({signal.Signals(got[0]).name} received)")
                if time.monotonic() >= deadline:
                    raise BuildWaitError(f"waited {self.wait_s:.0f} s for the CPU kernel build by {holder} in "
                                         f"{self.path.parent}; set {WAIT_ENV} to wait longer")
                time.sleep(_POLL_S)

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            try:
                os.ftruncate(self.fd, 0)  # released cleanly: the next holder has nothing to take over
            finally:
                os.close(self.fd)  # closing drops the flock
                self.fd = None


def _write_json_atomic(path: Path, record: dict) -> None:
    from fastweights.config import atomic_write_text  # (absolute: a copy of this file elsewhere works too)

    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")


def load_or_build(folder: Path, module: str, compile_step: Callable[[Path], Path], *,
                  wait_s: Optional[float] = None, say: Callable[[str], None] = _say, describe: Optional[dict] = None):
    """The extension ``module`` from the cache entry ``folder``, built there first if needed.

    ``compile_step(private_dir) -> path`` builds the library into the empty folder it is given
    and returns the file's path (it may import the module too). ``wait_s`` bounds the wait for
    another process's build (default :func:`wait_seconds`); ``describe`` adds fields to
    ``entry.json``. Raises :class:`KernelCacheError` when the cache can give no build (the caller
    falls back), or whatever the compile step raises.
    """
    folder = Path(folder)
    reason = check_entry(folder, module)
    if reason is None:  # the common case: no lock, no write
        return load_extension(folder / _library_name(module), module)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KernelCacheError(f"{folder} holds no verified build ({reason}) and cannot be created ({exc.strerror or exc})") from None
    if not os.access(folder, os.W_OK):  # e.g. a read-only mount: building there cannot work, waiting cannot help
        raise KernelCacheError(f"{folder} holds no verified build ({reason}) and is not writable")
    with _BuildLock(folder, wait_seconds() if wait_s is None else wait_s, say):
        reason = check_entry(folder, module)  # another process may have finished while we waited
        if reason is None:
            return load_extension(folder / _library_name(module), module)
        if reason != "no build yet":
            say(f"the cached CPU kernels in {folder} fail their check ({reason}); rebuilding")
        for left in folder.glob("build-*"):  # private folders of builds that were killed
            shutil.rmtree(left, ignore_errors=True)
        private = folder / f"build-{socket.gethostname()}-{os.getpid()}"
        private.mkdir()
        t0 = time.perf_counter()
        try:
            built = Path(compile_step(private))
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)  # a failed build leaves nothing behind
            raise
        seconds = time.perf_counter() - t0
        size, digest = file_digest(built)
        target = folder / _library_name(module)
        with contextlib.suppress(FileNotFoundError):
            (folder / ENTRY).unlink()  # readers see "no build" rather than an old record beside a new file
        os.replace(built, target)
        record = dict(describe or {}, module=module, file=target.name, size=size, sha256=digest,
                      built_by=json.loads(_holder_text()), build_seconds=round(seconds, 1))
        _write_json_atomic(folder / ENTRY, record)
        shutil.rmtree(private, ignore_errors=True)
        return load_extension(target, module)


def compiler_version(cxx: Optional[str] = None) -> str:
    """The first line of ``$CXX --version`` (``c++`` when unset), or why it could not run."""
    cxx = cxx or os.environ.get("CXX") or "c++"
    try:
        r = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cxx}: {type(exc).__name__}"
    lines = (r.stdout or r.stderr).strip().splitlines()
    return f"{cxx}: {lines[0] if lines else 'rc ' + str(r.returncode)}"


def build_key(folder: Path, files, *parts: str) -> str:
    """A 16-hex-digit key from the named files' names and bytes (not their folder: two checkouts
    of the same sources share a key) and ``parts`` (flags, versions, CPU, compiler)."""
    h = hashlib.sha256()
    for name in files:
        h.update(name.encode() + b"\0" + (Path(folder) / name).read_bytes() + b"\0")
    for part in parts:
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]
