"""Sealing a checkpoint folder: the manifest written last, every byte synced, then one rename.

Both kinds of checkpoint (one process's, :mod:`.checkpoint`; an FSDP run's shards, :mod:`.dcp_checkpoint`)
are written into a ``*.tmp-*`` folder and sealed here: :func:`write_manifest` lists the SHA-256 and
size of every file in ``manifest.json`` and syncs them all to disk, and :func:`publish` renames
the folder into place (an existing folder of that name is first renamed to a ``*.tmp-*`` name
and removed after), so a kill at any instant leaves the old checkpoint or the new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from typing import Any, Dict, List, Tuple

from .errors import CheckpointError

MANIFEST = "manifest.json"

__all__ = ["MANIFEST", "check_own_file", "file_digest", "read_manifest", "reason", "write_manifest", "publish"]


def check_own_file(folder: str, name: str) -> str:
    """``folder/name`` if it is a regular file of the checkpoint ``folder`` itself; otherwise a one-line
    :class:`CheckpointError` naming it. Refused: a name with a folder part (``../other/x``, an
    absolute path), a symbolic link (it could point at another checkpoint's file), and anything
    that is not a regular file (a FIFO would block the reader forever, a device never ends)."""
    if not isinstance(name, str) or not name or name in (".", "..") or os.path.basename(name) != name:
        raise CheckpointError(f"{folder}: the checkpoint names the file {name!r}, which is not in its own folder; "
                              f"refused (a checkpoint reads only its own files)")
    file = os.path.join(folder, name)
    try:
        mode = os.lstat(file).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: checkpoint file {name} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{folder}: checkpoint file {name} cannot be read: {reason(e)}") from None
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"{folder}: checkpoint file {name} is a symbolic link; refused (a checkpoint reads "
                              f"only its own files)")
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{folder}: checkpoint file {name} is not a regular file (a FIFO, a device or a "
                              f"folder); refused")
    return file


def read_manifest(folder: str) -> List[Tuple[str, str, int]]:
    """``(name, sha256, bytes)`` of every file ``folder/manifest.json`` lists (the manifest itself
    checked by :func:`check_own_file`); a one-line :class:`CheckpointError` if it cannot be read."""
    file = check_own_file(folder, MANIFEST)
    try:
        with open(file, encoding="utf-8") as f:
            files = json.load(f)["files"]
        return [(str(name), str(e["sha256"]), int(e["bytes"])) for name, e in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{folder}: {MANIFEST} is corrupt: {e}") from None


def file_digest(file: str) -> Dict[str, Any]:
    """``{"sha256": hex, "bytes": size}`` of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"sha256": digest.hexdigest(), "bytes": os.path.getsize(file)}


def reason(e: BaseException) -> str:
    """One line saying why a write failed (``No space left on device (path)``)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f" ({e.filename})" if e.filename else "")
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def write_manifest(folder: str, format: str) -> None:
    """Write ``folder/manifest.json`` (the SHA-256 and size of every other file), then sync every
    file to disk, so the rename that publishes them publishes whole files. Raises ``OSError``."""
    files = {name: file_digest(os.path.join(folder, name)) for name in sorted(os.listdir(folder)) if name != MANIFEST}
    with open(os.path.join(folder, MANIFEST), "w", encoding="utf-8") as f:
        json.dump({"format": format, "files": files}, f, indent=1)
    for name in os.listdir(folder):  # make the bytes durable before the rename publishes them
        with open(os.path.join(folder, name), "rb") as f:
            os.fsync(f.fileno())


def publish(tmp: str, path: str) -> None:
    """Rename the sealed folder ``tmp`` to ``path``, replacing a folder already there."""
    if os.path.isdir(path):
        old = f"{path}.tmp-old-{os.getpid()}"
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)
