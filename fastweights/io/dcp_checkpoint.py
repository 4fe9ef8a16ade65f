"""Sharded checkpoints of FSDP2 runs, through ``torch.distributed.checkpoint`` (DCP).

A sharded checkpoint is a folder with the same guarantees as the single-file one
(see the checkpoint module): written under a ``*.tmp-*`` name and renamed into place,
a ``manifest.json`` with the SHA-256 of every file written last, the run id in
``train.json``, and loaded without executing code::

    ckpt-000200/
        config.json        the LMConfig (plain JSON)
        train.json         run id, step, configs, loss history, optimizer hyperparameters,
                           "format": "fastweights-dcp-1", the world size it was written by
        .metadata          DCP's index of the shards (which rank wrote which slice)
        __0_0.distcp ...   one file per rank: its shards of the weights, of the optimizer
                           moments, and (rank 0) the RNG state
        manifest.json      the SHA-256 and size of every other file, written last

Every rank writes its own shards (``dcp.save``); rank 0 then adds the JSON files and
the manifest, and renames the folder into place. A run killed at any moment leaves a
``*.tmp-*`` folder, which the next run removes, and never half a checkpoint under a
checkpoint's name. The folder must be on a filesystem every rank sees (as DCP's
file system writer requires).

Loading resharded: DCP reads each rank's slices from whichever files hold them, so a
run saved by 4 processes resumes on 2 (or on 1, or is exported to one file). The same
world size reads back exactly the bytes that were written: resume is bitwise.

Every file a load reads is a regular file of the folder itself, listed in the manifest
(:func:`checked_metadata`): a ``.metadata`` naming another folder's shards, a FIFO or a symlink is
refused in one line before DCP opens anything.

No code runs on load: DCP's ``.metadata`` is a pickle, read here with an unpickler that
builds only DCP's own metadata classes, ``torch.Size`` and dtypes (anything else is
refused); the shards are read with ``torch.load(weights_only=True)``; entries DCP would
unpickle (non-tensor "bytes" items, which this writer never writes) are refused.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from typing import Any, ClassVar

import torch

from .errors import CheckpointError, CheckpointWriteError
from .sealing import MANIFEST, check_own_file, publish, read_manifest, reason, write_manifest

FORMAT_DCP = "fastweights-dcp-1"
DCP_METADATA = ".metadata"
DCP_SUFFIX = ".distcp"

__all__ = [
    "FORMAT_DCP",
    "SafeFileSystemReader",
    "checked_metadata",
    "is_sharded_checkpoint",
    "load_full_weights",
    "load_sharded",
    "save_sharded",
    "is_dcp_file",
]


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the checkpoint folder ``path`` was written by DCP (an FSDP run)."""
    return os.path.isfile(os.path.join(os.fspath(path), DCP_METADATA))


def is_dcp_file(name: str) -> bool:
    """Whether a file name in a checkpoint folder is one of DCP's (the index or a rank's shards)."""
    return name == DCP_METADATA or name.endswith(DCP_SUFFIX)


# -- reading DCP's metadata without running code ----------------------------------------------------


def _allowed_globals() -> dict[tuple[str, str], Any]:
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata

    allowed = {("torch", "Size"): torch.Size, ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
               ("collections", "OrderedDict"): __import__("collections").OrderedDict,
               ("pathlib", "PosixPath"): pathlib.PurePosixPath, ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
               ("pathlib", "Path"): pathlib.PurePath, ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
               ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath, ("pathlib", "PurePath"): pathlib.PurePath,
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): filesystem._StorageInfo}
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
                 "StorageMeta", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"):
        if hasattr(metadata, name):
            allowed[("torch.distributed.checkpoint.metadata", name)] = getattr(metadata, name)
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    allowed: ClassVar[dict[tuple[str, str], Any]] = {}

    def find_class(self, module: str, name: str):
        found = self.allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's checkpoint metadata")
        return found


def _read_metadata(file: str):
    """DCP's ``Metadata`` from ``file``, built from an allow-list of classes only."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata


    if not _MetadataUnpickler.allowed:
        _MetadataUnpickler.allowed = _allowed_globals()
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointError(f"{file}: not a DCP metadata file this library wrote ({e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{file}: not a DCP metadata file (holds {type(metadata).__name__})")
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):  # DCP would torch.load it with weights_only=False
            raise CheckpointError(f"{file}: entry {key!r} is a pickled object, not a tensor; refused (it could run code)")
    return metadata


def checked_metadata(path: str):
    """DCP's ``Metadata`` of the sharded checkpoint folder ``path``, read without running code, with
    every file it makes DCP read checked: a shard file (``*.distcp``) of this folder itself, listed
    in its ``manifest.json`` (whose SHA-256 :func:`~fastweights.io.checkpoint.verify_manifest`
    checks), a regular file, not a symbolic link. Anything else is a one-line :class:`CheckpointError`
    naming the file, raised before DCP opens anything (a FIFO would block it forever; a path
    outside the folder would read another checkpoint's weights)."""
    folder = os.fspath(path)
    metadata = _read_metadata(check_own_file(folder, DCP_METADATA))
    listed = {name for name, _, _ in read_manifest(folder)}
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict):
        raise CheckpointError(f"{folder}/{DCP_METADATA}: no index of the shards (storage_data is {type(storage).__name__})")
    for index, info in storage.items():
        name = getattr(info, "relative_path", None)
        what = getattr(index, "fqn", index)
        if not isinstance(name, str) or not name.endswith(DCP_SUFFIX) or os.path.basename(name) != name:
            raise CheckpointError(f"{folder}/{DCP_METADATA}: {what} is stored in {name!r}, which is not a shard file "
                                  f"of this folder; refused (a checkpoint reads only its own files)")
        if name not in listed:
            raise CheckpointError(f"{folder}/{DCP_METADATA}: {what} is stored in {name}, which {MANIFEST} does not "
                                  f"list: it cannot be verified; refused")
        check_own_file(folder, name)
    return metadata


def SafeFileSystemReader(path: str, metadata=None):
    """A DCP ``FileSystemReader`` for ``path`` whose ``read_metadata`` runs no code and returns
    :func:`checked_metadata` (or ``metadata``, already checked); rank-local metadata files
    (which this writer never writes, and no manifest lists) are never read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            checked = metadata if metadata is not None else checked_metadata(os.fspath(self.path))
            if getattr(checked, "storage_meta", None) is None:
                checked.storage_meta = StorageMeta()
            checked.storage_meta.load_id = self.load_id
            return checked

    return _Reader(path)


# -- the state that goes through DCP ----------------------------------------------------------------


def _dcp_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """``({"model": ..., "optim": ..., "rng": ...}, param_groups)``: the tensors DCP saves or fills
    (sharded as the model is), and the optimizer's hyperparameters, which go to train.json."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd["state"], "rng": {"torch": torch.get_rng_state()}}
    return state, optim_sd["param_groups"]


def _json_groups(groups) -> list:
    return [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in groups]


def save_sharded(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config_json: str,
    train: dict[str, Any],
    *,
    rank: int,
) -> str:
    """Write a sharded checkpoint at ``path`` from every rank (a collective); returns ``path``.

    Args:
        path: the checkpoint folder to create (replaced if it exists).
        model, optimizer: the FSDP2-sharded model and its optimizer.
        config_json: the model's config as JSON text.
        train: the JSON training state (run id, step, configs, history, evals); the
            optimizer's hyperparameters, the format and the world size are added.
        rank: this process's rank (rank 0 writes the JSON files and the manifest, and renames; the
            caller waits for it at a barrier before any rank reads the checkpoint).

    Raises:
        CheckpointWriteError: a write failed (a full disk); nothing was replaced.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = os.path.abspath(path)
    tmp = f"{path}.tmp-dcp"  # one name every rank knows; a leftover of a killed run is removed first
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as e:
            error = e
    _agree(error, rank, path, tmp, "create")
    state, groups = _dcp_state(model, optimizer)
    error = None
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    except (OSError, RuntimeError, CheckpointException) as e:  # DCP raises on every rank when one fails
        error = _first_failure(e)
    if error is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(error, OSError):  # a rank gone or silent: the caller's collective error names it
            raise RuntimeError(f"sharded checkpoint {path}: {reason(error)}") from None
        raise CheckpointWriteError(f"could not write checkpoint {path}: {reason(error)}") from None
    if rank == 0:
        try:
            world = dist.get_world_size() if dist.is_initialized() else 1
            with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
                f.write(config_json)
            with open(os.path.join(tmp, "train.json"), "w", encoding="utf-8") as f:
                json.dump({**train, "format": FORMAT_DCP, "world_size": world,
                           "optimizer": {"param_groups": _json_groups(groups)}}, f, indent=1)
            write_manifest(tmp, FORMAT_DCP)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(f"could not write checkpoint {path}: {reason(e)}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        publish(tmp, path)
    return path


def _agree(error: BaseException | None, rank: int, path: str, tmp: str, what: str) -> None:
    """Every rank learns whether rank 0's step ``what`` failed (a one-number broadcast), and all raise."""
    import torch.distributed as dist

    failed = error is not None
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([float(failed)])
        dist.broadcast(flag, 0)
        failed = bool(flag.item())
    if failed:
        why = reason(error) if error is not None else f"rank 0 could not {what} {tmp}"
        raise CheckpointWriteError(f"could not write checkpoint {path}: {why}")


def load_sharded(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train: dict[str, Any]) -> None:
    """Fill the (sharded) ``model`` and ``optimizer`` and the RNG from the sharded checkpoint ``path``
    (a collective; each rank reads the slices it holds, whatever world size wrote them).

    ``train`` is the checkpoint's checked train.json (its ``optimizer.param_groups``). The
    files must already be verified against the manifest (:func:`~fastweights.io.checkpoint.load_checkpoint`).
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict


    state, groups = _dcp_state(model, optimizer)
    _dcp_load(state, path, "this model and optimizer", no_dist=False)
    saved_groups = train["optimizer"].get("param_groups")
    if not isinstance(saved_groups, list) or len(saved_groups) != len(groups):
        raise CheckpointError(f"{path}/train.json: `optimizer.param_groups` must list {len(groups)} groups")
    merged = [{**g, **{k: (tuple(v) if k == "betas" else v) for k, v in s.items() if k != "params"}}
              for g, s in zip(groups, saved_groups)]
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"], "param_groups": merged})
    torch.set_rng_state(state["rng"]["torch"])
    taken = train["step"] - sum(1 for r in train["history"] if r.get("skipped"))
    for fqn, slots in state["optim"].items():  # AdamW's own step counters must agree with train.json
        step = slots.get("step") if isinstance(slots, dict) else None
        if isinstance(step, torch.Tensor) and step.numel() == 1 and float(step) != taken:
            raise CheckpointError(f"{path}/train.json: `step`={train['step']} does not match the optimizer state "
                                  f"({fqn}.step = {float(step):g})")


def load_full_weights(path: str, model: torch.nn.Module) -> None:
    """Fill an unsharded ``model`` (one process, no process group) with the full weights of the
    sharded checkpoint ``path``, reassembled from every rank's shards (for export, generate, eval)."""

    import warnings

    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _dcp_load(state, path, "the model of its config.json", no_dist=True)
    model.load_state_dict(state["model"])


def _first_failure(error: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's ``CheckpointException`` (which wraps every rank's)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)]
        return getattr(inner, "exc", inner) if isinstance(getattr(inner, "exc", inner), BaseException) else error
    return error


def _dcp_load(state, path: str, what: str, no_dist: bool) -> None:
    """``dcp.load`` into ``state``; any failure (a missing key, a shape that does not fit, a refused
    metadata file) becomes one :class:`CheckpointError` line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException


    # checked first, outside DCP: a refused file is one line here, not DCP's logged tracebacks and
    # its fallback to rank-local metadata, ending in a misleading "does not fit"
    metadata = checked_metadata(path)
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path, metadata), no_dist=no_dist)
    except (RuntimeError, ValueError, KeyError, CheckpointException) as e:
        e = _first_failure(e)
        if isinstance(e, CheckpointError):
            raise e from None
        reason = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: the sharded checkpoint does not fit {what}: {reason}") from None
