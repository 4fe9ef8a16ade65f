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

__all__ = ["fingerprint", "data_fingerprints", "check_data_files", "DataChangedError"]


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
