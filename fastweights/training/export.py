"""One file for a trained model: ``fastweights export RUN --out model.safetensors``.

The file is a safetensors file whose metadata holds what a checkpoint's
``model.safetensors`` holds (the format name, the LMConfig as JSON, the dtype) plus
``"tensors_sha256"``: the SHA-256 of every tensor's name, dtype, shape and bytes, in
name order, and ``"train"``: the run's id, step, tokenizer and training config (JSON; no
optimizer state: the file is for using the model, not for resuming its training). Loading (``generate``, ``eval``, ``hf convert``, :func:`load_model_file`)
checks that digest, so a flipped bit is refused as a checkpoint's manifest refuses it.
Written atomically (a temp file, fsync, rename); read without executing code.

The source is a run folder (its ``latest``) or a checkpoint folder, either the
single-process kind or a sharded one written by an FSDP run (its shards are
reassembled here, in one process, without a process group).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch

__all__ = ["export_model", "is_model_file", "load_model_file", "save_model_file", "tensors_sha256"]

DIGEST_KEY = "tensors_sha256"
TRAIN_KEY = "train"  # the run's tokenizer and training config, for generate and eval
RUN_FIELDS = ("run_id", "step", "tokenizer", "train_config")


def is_model_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a single-file model (a ``.safetensors`` file) rather than a folder."""
    return os.path.isfile(os.fspath(path)) and os.fspath(path).endswith(".safetensors")


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype!s}|{list(t.shape)}\n".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def save_model_file(model, path: str | os.PathLike, train: dict | None = None) -> str:
    """Write ``model`` (an :class:`~fastweights.models.LM`) as one safetensors file at ``path``, atomically.
    ``train``: what the loaders need of the run (``tokenizer``, ``train_config``, ``step``, ``run_id``), as JSON."""
    from safetensors.torch import save_file

    from .checkpoint import FORMAT, _weights_of
    from .errors import CheckpointWriteError

    path = os.path.abspath(os.fspath(path))
    weights = _weights_of(model)
    metadata = {"format": FORMAT, "config": model.config.to_json(),
                "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), DIGEST_KEY: tensors_sha256(weights)}
    if train:
        metadata[TRAIN_KEY] = json.dumps(train)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(weights, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise CheckpointWriteError(f"could not write {path}: {e.strerror or e}") from None
        raise
    return path


def load_model_file(path: str | os.PathLike):
    """``(config, weights, train)`` of a single-file model, its digest checked (``train``: the run's
    tokenizer and training config, or ``None``); :class:`CheckpointError` otherwise."""
    from ..models import LMConfig
    from .checkpoint import FORMAT, _read_safetensors
    from .errors import CheckpointError

    path = os.fspath(path)
    weights, metadata = _read_safetensors(path)
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {metadata.get('format')!r}, expected {FORMAT!r}")
    if DIGEST_KEY not in metadata:
        raise CheckpointError(f"{path}: no `{DIGEST_KEY}` in its metadata, so it cannot be verified; a checkpoint's "
                              f"model.safetensors is checked by its folder's manifest: pass the checkpoint folder")
    found = tensors_sha256(weights)
    if found != metadata[DIGEST_KEY]:
        raise CheckpointError(f"{path}: the tensors fail their SHA-256 check (sha256 {found[:16]}..., expected "
                              f"{metadata[DIGEST_KEY][:16]}...): the file is corrupt")
    try:
        config = LMConfig.from_dict(LMConfig.fill_legacy(json.loads(metadata["config"])), source=f"file {path}")
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}: the config in its metadata is invalid: {e}") from None
    try:
        train = json.loads(metadata[TRAIN_KEY]) if TRAIN_KEY in metadata else None
    except ValueError as e:
        raise CheckpointError(f"{path}: the `{TRAIN_KEY}` entry of its metadata is not valid JSON: {e}") from None
    if train is not None and not isinstance(train, dict):
        raise CheckpointError(f"{path}: the `{TRAIN_KEY}` entry of its metadata must be a JSON object")
    return config, weights, train


def export_model(source: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype | None = None) -> str:
    """Write the model of ``source`` (a run folder, a checkpoint folder, single-process or sharded, or a
    single-file model) as one file at ``out``; returns ``out``'s path. ``dtype``: the weights' dtype
    (default: as saved)."""
    from .checkpoint import load_model

    if not os.fspath(out).endswith(".safetensors"):
        raise ValueError(f"export: `--out` must name a .safetensors file, got {os.fspath(out)!r}")
    model, ckpt = load_model(source, dtype=dtype)
    train = {k: ckpt.train[k] for k in RUN_FIELDS if k in (ckpt.train or {})}
    return save_model_file(model, out, train)
