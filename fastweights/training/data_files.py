"""Which data files a run trained on: absolute path and content fingerprint, checked on resume.

A run's ``train.json`` records, for its text data (``data`` and ``val_data``; the built-in
recall task has none), ``{"path": absolute real path, "bytes": size, "sha256": hex,
"hashed": "all" | "sample"}``. The hash covers the whole file up to :data:`WHOLE_FILE`
bytes; beyond that, the size and :data:`SAMPLES` blocks of :data:`BLOCK` bytes spread
evenly over the file (the first and last included), so a resume never reads a large file
whole: an edit that changes the size or touches a sampled block is caught, one confined
to the bytes between samples of a file over 256 MB is not.

``--resume`` compares the files its configuration resolves to now (a relative path
resolves from the current directory) with the record and refuses another file, naming
both, unless ``--allow-data-change`` (then the new file is recorded from the next
checkpoint on). A checkpoint from before fingerprints has no record: it resumes
unchecked, with a line saying so, and records one from then on.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, Optional

from .errors import RunFolderError

WHOLE_FILE = 256 << 20
BLOCK = 1 << 20
SAMPLES = 16

__all__ = ["fingerprint", "data_fingerprints", "check_data_files", "DataChangedError", "DataWatch", "BusErrorGuard", "DATA_CHANGED"]


class DataChangedError(RunFolderError):
    """A resumed run's data file is not the one it trained on."""


def fingerprint(path: str) -> Dict[str, Any]:
    """``{"path", "bytes", "sha256", "hashed"}`` of the file at ``path`` (see the module docstring)."""
    real = os.path.realpath(os.path.abspath(path))
    size = os.path.getsize(real)
    digest = hashlib.sha256()
    with open(real, "rb") as f:
        if size <= WHOLE_FILE:
            for block in iter(lambda: f.read(BLOCK), b""):
                digest.update(block)
            hashed = "all"
        else:
            digest.update(str(size).encode())
            for i in range(SAMPLES):
                f.seek((size - BLOCK) * i // (SAMPLES - 1))
                digest.update(f.read(BLOCK))
            hashed = "sample"
    return {"path": real, "bytes": size, "sha256": digest.hexdigest(), "hashed": hashed}


def data_fingerprints(config) -> Dict[str, Dict[str, Any]]:
    """The fingerprints of a :class:`TrainConfig`'s text files (``{}`` for the recall task)."""
    files = {}
    if config.data != "recall":
        files["data"] = fingerprint(config.data)
        if config.val_data is not None:
            files["val_data"] = fingerprint(config.val_data)
    return files


def _describe(fp: Dict[str, Any]) -> str:
    return f"{fp['path']} ({fp['bytes']:,} bytes, sha256 {fp['sha256'][:12]}...)"


def check_data_files(recorded: Optional[Dict[str, Dict[str, Any]]], current: Dict[str, Dict[str, Any]],
                     allow_change: bool = False, log=print) -> None:
    """Refuse a resume whose data files differ from the ``recorded`` ones (:class:`DataChangedError`,
    naming both), unless ``allow_change`` (then say so); ``recorded=None``: a checkpoint from
    before fingerprints, resumed unchecked."""
    if recorded is None:
        if current:
            log("note: the checkpoint has no data fingerprint (written before they were recorded); the data "
                "file is not checked this time, and is recorded from the next checkpoint on")
        return
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key), current.get(key)
        flag = "--" + key.replace("_", "-")
        if old is not None and new is not None and (old["bytes"], old["sha256"]) == (new["bytes"], new["sha256"]):
            if old["path"] != new["path"]:
                log(f"note: {flag} is now {new['path']}, the same content as {old['path']} (size and sha256 agree)")
            continue
        if old is None or new is None:
            what = f"{flag} was {'not given' if old is None else _describe(old)}; now it is " \
                   f"{'not given' if new is None else _describe(new)}"
        elif old["path"] == new["path"]:
            what = f"{flag} {old['path']} has changed since the run trained on it: it was {old['bytes']:,} bytes, " \
                   f"sha256 {old['sha256'][:12]}..., now {_describe(new)}"
        else:
            what = f"the run trained on {flag} {_describe(old)}, but {flag} now resolves to {_describe(new)}"
        if allow_change:
            log(f"warning: {what}; continuing on it (--allow-data-change)")
            continue
        raise DataChangedError(f"train --resume: {what}. Resume with the run's own file, or pass "
                               f"--allow-data-change to continue on this one")


# -- a data file that changes under a running trainer -------------------------------------------------
#
# The text data is memory-mapped (fastweights.tasks.text.read_bytes). If the file is truncated while
# the run reads it, the next read of a page past the new end raises SIGBUS, which kills the process
# with no message (rc 135). Two defences: DataWatch compares each file's size (through a descriptor
# of the very file that is mapped, so a file renamed over it, which leaves the mapping valid, does not
# count) before every step and every evaluation, so every epoch boundary is covered, and says so in one
# line while the last checkpoint is intact; a truncation in the instant between that check and the read
# is caught by a SIGBUS handler that prints the same line and exits 2.

DATA_CHANGED = "the data file changed while training"


class DataWatch:
    """The sizes of a run's data files, as they were when the run mapped them; see above.

    Args:
        files: ``{flag key: path}`` (``{"data": ..., "val_data": ...}``).
        describe: a callable giving the state of the run's checkpoints for the message
            (``"the previous checkpoint ckpt-000010 (latest) is intact"``).
    """

    def __init__(self, files: Dict[str, str], describe=lambda: "") -> None:
        self.describe = describe
        self.files = []  # (flag, path, descriptor, size)
        for key, path in files.items():
            fd = os.open(path, os.O_RDONLY)
            self.files.append(("--" + key.replace("_", "-"), path, fd, os.fstat(fd).st_size))

    def message(self) -> Optional[str]:
        """The one line saying which file changed, or ``None`` when every size is as it was."""
        for flag, path, fd, size in self.files:
            now = os.fstat(fd).st_size
            if now != size:
                latest = self.describe()
                return (f"train: {DATA_CHANGED}: {flag} {path} was {size:,} bytes when the run began, now {now:,}; "
                        f"training reads it in place, so it must not change until the run ends"
                        + (f"; {latest}" if latest else ""))
        return None

    def check(self) -> None:
        """Raise :class:`DataChangedError` if a file's size changed (a ``fstat`` per file: microseconds)."""
        message = self.message()
        if message is not None:
            raise DataChangedError(message)

    def close(self) -> None:
        for _, _, fd, _ in self.files:
            os.close(fd)
        self.files = []


class BusErrorGuard:
    """While active (a context manager; it closes ``watch`` on exit), SIGBUS (a read of a mapped page past the end of a truncated file) prints
    ``watch``'s one line (or a generic one) to stderr, calls ``on_fault`` (the trainer releases its
    run lock) and ends the process with exit code 2, instead of dying silently with rc 135.

    Python's own ``signal.signal`` cannot do this: its handler only sets a flag, and the faulting
    instruction would run again forever. The handler here is a C function pointer (``ctypes``)
    installed with the C library's ``signal``; it runs at the fault, on the faulting thread, and
    takes the GIL (torch releases it inside its ops). Linux and macOS only; elsewhere a no-op."""

    def __init__(self, watch: Optional[DataWatch], on_fault=lambda: None) -> None:
        self.watch, self.on_fault = watch, on_fault
        self._libc = self._handler = self._previous = None

    def _fault(self, signum: int) -> None:
        try:
            message = self.watch.message() if self.watch is not None else None
            message = message or (f"train: {DATA_CHANGED}: a read of the memory-mapped data failed (SIGBUS: the file "
                                  f"was truncated or its storage went away)")
            os.write(2, (message + "\n").encode("utf-8", "replace"))
            self.on_fault()
        finally:
            os._exit(2)

    def __enter__(self) -> "BusErrorGuard":
        import ctypes
        import signal
        import sys
        import threading

        if not hasattr(signal, "SIGBUS") or not sys.platform.startswith(("linux", "darwin")) \
                or threading.current_thread() is not threading.main_thread():
            return self
        handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        self._handler = handler_type(self._fault)  # kept alive while installed
        self._libc = libc
        self._previous = libc.signal(int(signal.SIGBUS), ctypes.cast(self._handler, ctypes.c_void_p))
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self._libc is not None:
            self._libc.signal(int(signal.SIGBUS), self._previous)
            self._libc = self._handler = None
        if self.watch is not None:
            self.watch.close()
