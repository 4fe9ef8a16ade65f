"""Where the converters may write: a new or empty folder, or one they wrote themselves.

``fastweights hf export`` and ``hf import`` replace their output folder as a whole (a
temporary folder beside it, then a rename), so they must never be pointed at a folder
that holds anything else. :func:`write_output_folder` decides, then writes:

==========================================  =========================  ================
the output path is                          without ``overwrite``      ``overwrite``
==========================================  =========================  ================
absent, or an empty folder                  written                    written
a folder holding our marker file and only   replaced                   replaced
the files the marker lists
any other folder (user files, a run         refused, naming it         replaced
folder, a checkpoint, a marker that does
not check out)
a file, a link                              refused                    refused
the source, a folder holding the source,    refused                    refused
or one holding the current directory
==========================================  =========================  ================

The marker, ``.fastweights-output.json``, says which command wrote the folder and lists
its files: ``{"written_by": "fastweights hf export", "files": [...]}``. A folder with a
file the marker does not list (a note the user added) is no longer only ours.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Iterable, List, Union

MARKER = ".fastweights-output.json"
WRITERS = ("fastweights hf export", "fastweights hf import")

PathLike = Union[str, os.PathLike]


class OutputFolderError(ValueError):
    """An output folder the converters refuse to write (one line naming it)."""


def _real(path: PathLike) -> str:
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (both resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _read_marker(folder: str):
    """The marker's content when it is valid JSON of the expected form, else None."""
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if (not isinstance(marker, dict) or marker.get("written_by") not in WRITERS
            or not isinstance(marker.get("files"), list) or not all(isinstance(n, str) for n in marker["files"])):
        return None
    return marker


def check_output_folder(out_dir: PathLike, sources: Iterable[PathLike], command: str, overwrite: bool = False) -> str:
    """The resolved path ``command`` may (re)write, or :class:`OutputFolderError` saying why not.

    Args:
        out_dir: the folder to write.
        sources: what the command reads (a checkpoint, a run folder, a transformers folder):
            ``out_dir`` may neither be one of them nor hold one, even with ``overwrite``.
        command: the command's name, for the messages (``"hf export"``).
        overwrite: replace a folder that holds other files (never a source, never a folder
            holding the current directory).
    """
    shown = os.path.abspath(os.fspath(out_dir))
    if os.path.islink(shown):
        raise OutputFolderError(f"{command}: the output {shown} is a symbolic link; give a real folder path")
    out = _real(out_dir)
    for source in sources:
        if _inside(_real(source), out):
            raise OutputFolderError(
                f"{command}: the output folder {shown} is, or holds, the source {os.fspath(source)}; "
                f"writing there would replace what is being converted (choose another folder)"
            )
    if _inside(_real(os.getcwd()), out):
        raise OutputFolderError(
            f"{command}: the output folder {shown} is, or holds, the current directory; it is never replaced "
            f"(choose a new folder)"
        )
    if not os.path.exists(out):
        return out
    if not os.path.isdir(out):
        raise OutputFolderError(f"{command}: the output {shown} exists and is not a folder; choose a new folder")
    names = sorted(os.listdir(out))
    if not names or overwrite:
        return out
    marker = _read_marker(out)
    if marker is None:
        raise OutputFolderError(
            f"{command}: the output folder {shown} is not empty and was not written by fastweights hf "
            f"(it holds {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}); choose a new or empty folder, "
            f"or pass --overwrite to replace it"
        )
    foreign = [n for n in names if n != MARKER and n not in marker["files"]]
    if foreign:
        raise OutputFolderError(
            f"{command}: the output folder {shown} was written by {marker['written_by']} but now also holds "
            f"{', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}; choose a new or empty folder, "
            f"or pass --overwrite to replace it"
        )
    return out


def write_output_folder(out_dir: PathLike, write: Callable[[str], None], *, sources: Iterable[PathLike],
                        command: str, overwrite: bool = False) -> str:
    """Check ``out_dir`` (:func:`check_output_folder`), call ``write(tmp)`` to fill a fresh
    temporary folder beside it, add the marker, then put the result in place atomically
    (rename; an existing folder is moved aside first and deleted last). Returns the path."""
    out = check_output_folder(out_dir, sources, f"fastweights {command}", overwrite)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        files: List[str] = sorted(os.listdir(tmp))
        with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
            json.dump({"written_by": f"fastweights {command}", "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = f"{out}.old-{os.getpid()}"
    if os.path.exists(out):
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out
