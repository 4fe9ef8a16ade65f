"""The training state a checkpoint carries for an exact resume, and its schema.

``train.json`` (run id, step, configs, loss history, optimizer hyperparameters and, for
fp16, the gradient scaler's state) and ``train_state.safetensors`` (optimizer moments and
the RNG state). :func:`check_train_state` and :func:`check_training_tensors` refuse, in
one line, what does not fit before anything is loaded.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, Tuple

import torch

from ..io.checkpoint import Checkpoint, load_checkpoint
from ..io.errors import CheckpointError

__all__ = ["GRAD_SCALER_SCHEMA", "check_train_state", "check_training_tensors", "load_training_checkpoint",
           "optimizer_from_flat", "optimizer_to_flat"]


def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """An optimizer's state dict as (tensors for safetensors, JSON-able rest)."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, slots in sd["state"].items():
        for name, value in slots.items():
            key = f"optimizer.{index}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().contiguous().cpu()
            else:
                scalars[key] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_flat(tensors: Dict[str, torch.Tensor], info: Dict[str, Any]) -> Dict[str, Any]:
    """Inverse of :func:`optimizer_to_flat`: a state dict for ``optimizer.load_state_dict``."""
    state: Dict[int, Dict[str, Any]] = {}
    for key, value in list(tensors.items()) + list(info.get("scalars", {}).items()):
        if not key.startswith("optimizer."):
            continue
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else dict(g) for g in info["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_training_checkpoint(path: "str | os.PathLike") -> Checkpoint:
    """:func:`load_checkpoint` for resuming: the training state must be there and pass
    :func:`check_train_state`."""
    ckpt = load_checkpoint(path)
    if ckpt.train is None or ("rng.torch" not in ckpt.train_tensors and not ckpt.sharded):  # sharded: in the shards
        raise CheckpointError(f"{ckpt.path} holds a model but no training state (train.json, train_state.safetensors); it cannot be resumed")
    check_train_state(ckpt.train, ckpt.train_tensors, f"{ckpt.path}/train.json")
    return ckpt


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def check_train_state(train, tensors: Dict[str, torch.Tensor], where: str = "train.json") -> None:
    """Check ``train.json`` against its schema and against itself; one-line :class:`CheckpointError`.

    Schema: an object with ``step`` (int >= 0), ``history`` (one record per step,
    ``{"step": 1..step, "loss": number, ...}``), ``evals`` (a list of records with
    ``step`` <= step), ``train_config`` (an object), ``optimizer`` (an object) and,
    since run ids exist, ``run_id`` (a string); an fp16 run also has ``grad_scaler``
    (:data:`GRAD_SCALER_SCHEMA`, the state of ``torch.amp.GradScaler``). The step must be
    the one the history and the optimizer's own step counters reached (less the steps
    the history marks ``"skipped": true``, where an fp16 overflow skipped the optimizer):
    a ``step`` edited to 999 in a 20-step checkpoint is refused rather than resumed from
    the wrong place.
    """
    def fail(message: str):
        raise CheckpointError(f"{where}: {message}")

    if not isinstance(train, dict):
        fail(f"expected a JSON object, got {type(train).__name__} {json.dumps(train)[:40]}")
    for key, kind, check in (("step", "an int >= 0", lambda x: _is_int(x) and x >= 0),
                             ("history", "a list", lambda x: isinstance(x, list)),
                             ("evals", "a list", lambda x: isinstance(x, list)),
                             ("train_config", "an object", lambda x: isinstance(x, dict)),
                             ("optimizer", "an object", lambda x: isinstance(x, dict)),
                             ("run_id", "a string", lambda x: isinstance(x, str) and x)):
        if key not in train:
            if key != "run_id":  # checkpoints from before run ids have none
                fail(f"`{key}` is missing (expected {kind})")
            continue
        if not check(train[key]):
            fail(f"`{key}` must be {kind}, got {json.dumps(train[key])[:40]}")
    step, history = train["step"], train["history"]
    for i, record in enumerate(history):
        if not isinstance(record, dict) or record.get("step") != i + 1 or not _is_number(record.get("loss")) \
                or not isinstance(record.get("skipped", False), bool):
            fail(f"`history[{i}]` must be {{\"step\": {i + 1}, \"loss\": <number>, ...}}, got {json.dumps(record)[:60]}")
    if len(history) != step:
        fail(f"`step`={step} does not match the history, which ends at step {len(history)}")
    for i, record in enumerate(train.get("evals", [])):
        if not isinstance(record, dict) or not _is_int(record.get("step")) or not 0 < record["step"] <= step:
            fail(f"`evals[{i}]` must be an object with a `step` in 1..{step}, got {json.dumps(record)[:60]}")
    precision = train["train_config"].get("precision", "fp32")
    if "grad_scaler" in train or precision == "fp16":
        _check_grad_scaler(train.get("grad_scaler"), precision, fail)
    taken = step - sum(1 for record in history if record.get("skipped"))
    for key, value in tensors.items():  # AdamW counts the steps it took: they must agree
        if key.startswith("optimizer.") and key.endswith(".step") and value.numel() == 1 and float(value) != taken:
            skipped = f" less {step - taken} skipped" if taken != step else ""
            fail(f"`step`={step}{skipped} does not match the optimizer state ({key} = {float(value):g})")


# ``train.json``'s ``grad_scaler``: torch.amp.GradScaler.state_dict() of an enabled scaler.
GRAD_SCALER_SCHEMA = {
    "scale": ("a finite number > 0", lambda x: _is_number(x) and x > 0),
    "growth_factor": ("a finite number > 1", lambda x: _is_number(x) and x > 1),
    "backoff_factor": ("a number in (0, 1)", lambda x: _is_number(x) and 0 < x < 1),
    "growth_interval": ("an int > 0", lambda x: _is_int(x) and x > 0),
    "_growth_tracker": ("an int >= 0", lambda x: _is_int(x) and x >= 0),
}


def _check_grad_scaler(state, precision: str, fail) -> None:
    if state is None:
        fail(f"`grad_scaler` is missing: a `precision`={precision!r} run must save its gradient scaler "
             f"(resuming with a fresh scale would not continue the run exactly)")
    if not isinstance(state, dict):
        fail(f"`grad_scaler` must be an object, got {json.dumps(state)[:40]}")
    if precision != "fp16":
        fail(f"`grad_scaler` is only saved by fp16 runs; this run's `precision` is {precision!r}")
    for key, (kind, check) in GRAD_SCALER_SCHEMA.items():
        if key not in state:
            fail(f"`grad_scaler.{key}` is missing (expected {kind})")
        if not check(state[key]):
            fail(f"`grad_scaler.{key}` must be {kind}, got {json.dumps(state[key])[:40]}")
    if state["_growth_tracker"] >= state["growth_interval"]:
        fail(f"`grad_scaler._growth_tracker`={state['_growth_tracker']} must be below "
             f"`growth_interval`={state['growth_interval']}")


def check_training_tensors(ckpt: "Checkpoint", optimizer: torch.optim.Optimizer) -> None:
    """Check a checkpoint's tensors against the run they resume, before anything is loaded:
    finite weights; ``rng.torch`` shaped as torch's CPU generator state; every optimizer
    moment of an existing parameter index, with that parameter's shape and dtype, finite, and
    the same slots for every parameter that has any. (The manifest proves the files are as
    written; this catches what a buggy writer or an edit consistent with the manifest breaks,
    which would otherwise be a raw error deep in the optimizer, or a silent dtype change.)
    One-line :class:`CheckpointError`s naming the file and the tensor.
    """
    weights_file, state_file = f"{ckpt.path}/model.safetensors", f"{ckpt.path}/train_state.safetensors"
    for key, value in ckpt.weights.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{weights_file}: weight `{key}` holds {int((~torch.isfinite(value)).sum())} "
                                  f"non-finite value(s): training cannot continue from it")
    rng, expected = ckpt.train_tensors["rng.torch"], torch.get_rng_state()
    if rng.dtype != expected.dtype or rng.shape != expected.shape:
        raise CheckpointError(f"{state_file}: `rng.torch` must be torch's CPU generator state, a {expected.dtype} "
                              f"tensor of shape {list(expected.shape)}; got {rng.dtype} {list(rng.shape)}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    slots: Dict[int, set] = {}
    for key, value in sorted(ckpt.train_tensors.items()):
        if not key.startswith("optimizer."):
            continue
        _, index, name = key.split(".", 2)
        if not index.isdigit() or int(index) >= len(params):
            raise CheckpointError(f"{state_file}: `{key}` names no parameter (the optimizer has {len(params)}, "
                                  f"indices 0..{len(params) - 1})")
        param = params[int(index)]
        if name == "step" and value.numel() != 1:
            raise CheckpointError(f"{state_file}: `{key}` must hold one number, got shape {list(value.shape)}")
        if name != "step" and (value.shape != param.shape or value.dtype != param.dtype):
            raise CheckpointError(f"{state_file}: `{key}` must have its parameter's shape {list(param.shape)} and dtype "
                                  f"{param.dtype}, got {list(value.shape)} {value.dtype}")
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{state_file}: `{key}` holds {int((~torch.isfinite(value)).sum())} non-finite value(s)")
        slots.setdefault(int(index), set()).add(name)
    every = set().union(*slots.values()) if slots else set()
    for index, names in sorted(slots.items()):
        if names != every:
            raise CheckpointError(f"{state_file}: parameter {index} has optimizer state {sorted(names)} but others have "
                                  f"{sorted(every)}: `optimizer.{index}.{sorted(every - names)[0]}` is missing")


def tokenizer_of(ckpt):
    """(encode, decode) of the data a checkpoint was trained on."""
    from ..tasks import ByteText
    from ..tasks.adapters import RecallData
    from .config import TrainConfig

    kind = (ckpt.train or {}).get("tokenizer", "bytes" if ckpt.config.vocab_size == 256 else None)
    if kind == "bytes":
        return ByteText.encode, ByteText.decode
    if kind == "recall":
        data = RecallData(TrainConfig.from_dict(ckpt.train["train_config"]))
        return data.encode, data.decode
    raise ValueError(f"generate: {ckpt.path} does not say how its tokens were made (no train.json); cannot encode a prompt")
