"""Training an LM: one concern a module.

- :mod:`.config`: :class:`TrainConfig`, the checked training flags;
- :mod:`.loop`: :func:`train`, the loop (steps, evaluations, checkpoints, exact resume);
- :mod:`.optim`: AdamW and the learning-rate schedule;
- :mod:`.precision`: the weights' dtype, autocast, fp16's gradient scaler;
- :mod:`.distributed`: the process group, heartbeats, collectives with a deadline;
- :mod:`.parallel`: the dp × cp grid of processes, FSDP2 sharding (``--fsdp``, ``--context-parallel``);
- :mod:`.evaluation`: held-out loss and accuracy (of a model, or of a checkpoint on a file);
- :mod:`.metrics`: the run folder's ``metrics.jsonl``;
- :mod:`.checkpoint`: the checkpoint file format (weights and config; loading without code), and
  the single-file model of ``fastweights export``;
- :mod:`.dcp_checkpoint`: an FSDP run's sharded checkpoints, through ``torch.distributed.checkpoint``;
- :mod:`.sealing`: a checkpoint folder sealed (manifest last, fsync, rename), for both kinds;
- :mod:`.train_state`: the training state a checkpoint carries for an exact resume, and its schema;
- :mod:`.listing`: a run folder's checkpoints (names, ``latest``, listing, removal);
- :mod:`.run_folder`: a run owns its folder (lock, run id, resume, pruning);
- :mod:`.signals`: SIGINT / SIGTERM save and stop;
- :mod:`.errors`: the one-line errors of checkpoints and run folders;
- :mod:`.allocator`: keep freed CPU memory in the process (a measured speed-up of CPU runs).

The data the loop reads comes from :mod:`fastweights.tasks` (:func:`~fastweights.tasks.make_task`).
"""

# The names load on first use (PEP 562), so that ``import fastweights.training.allocator`` (which
# the command line does before anything else) does not import torch.
import importlib as _importlib

_LAZY = {
    "Checkpoint": "fastweights.training.checkpoint",
    "CheckpointError": "fastweights.training.errors",
    "CheckpointWriteError": "fastweights.training.errors",
    "DTYPES": "fastweights.training.precision",
    "DistributedTimeout": "fastweights.training.distributed",
    "FORMAT": "fastweights.training.checkpoint",
    "GRAD_SCALER_SCHEMA": "fastweights.training.train_state",
    "Heartbeat": "fastweights.training.distributed",
    "LATEST": "fastweights.training.listing",
    "PRECISIONS": "fastweights.training.precision",
    "RecallData": "fastweights.tasks.adapters",
    "RunFolderError": "fastweights.training.errors",
    "RunLock": "fastweights.training.run_folder",
    "StopSignals": "fastweights.training.signals",
    "TextData": "fastweights.tasks.adapters",
    "TrainConfig": "fastweights.training.config",
    "TrainResult": "fastweights.training.loop",
    "TrainingInterrupted": "fastweights.training.signals",
    "autocast": "fastweights.training.precision",
    "check_precision": "fastweights.training.precision",
    "check_train_state": "fastweights.training.train_state",
    "check_training_tensors": "fastweights.training.train_state",
    "claim_run_folder": "fastweights.training.run_folder",
    "clean_stray": "fastweights.training.listing",
    "evaluate": "fastweights.training.evaluation",
    "export_model": "fastweights.training.checkpoint",
    "ParallelPlan": "fastweights.training.parallel",
    "plan_parallel": "fastweights.training.parallel",
    "shard_model": "fastweights.training.parallel",
    "save_model_file": "fastweights.training.checkpoint",
    "load_model_file": "fastweights.training.checkpoint",
    "evaluate_file": "fastweights.training.evaluation",
    "evaluate_tokens": "fastweights.training.evaluation",
    "learning_rate": "fastweights.training.optim",
    "load_checkpoint": "fastweights.training.checkpoint",
    "load_config_file": "fastweights.training.config",
    "load_model": "fastweights.training.checkpoint",
    "load_resume_checkpoint": "fastweights.training.run_folder",
    "load_training_checkpoint": "fastweights.training.train_state",
    "load_weights": "fastweights.training.checkpoint",
    "make_optimizer": "fastweights.training.optim",
    "make_scaler": "fastweights.training.precision",
    "make_task": "fastweights.tasks.adapters",
    "mark_latest": "fastweights.training.listing",
    "new_run_id": "fastweights.training.run_folder",
    "optimizer_from_flat": "fastweights.training.train_state",
    "optimizer_to_flat": "fastweights.training.train_state",
    "prune_checkpoints": "fastweights.training.run_folder",
    "remove_folder": "fastweights.training.listing",
    "resolve_checkpoint": "fastweights.training.listing",
    "run_checkpoints": "fastweights.training.listing",
    "save_checkpoint": "fastweights.training.checkpoint",
    "split_accuracy": "fastweights.training.evaluation",
    "step_generator": "fastweights.tasks.adapters",
    "token_losses": "fastweights.training.evaluation",
    "tokenizer_of": "fastweights.training.checkpoint",
    "train": "fastweights.training.loop",
    "tune_cpu_allocator": "fastweights.training.allocator",
    "verify_manifest": "fastweights.training.checkpoint",
}


def __getattr__(name):
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fastweights.training' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Checkpoint", "CheckpointError", "CheckpointWriteError", "DTYPES", "DistributedTimeout", "FORMAT",
    "GRAD_SCALER_SCHEMA", "Heartbeat", "LATEST", "PRECISIONS", "ParallelPlan", "export_model", "load_model_file",
    "plan_parallel", "save_model_file", "shard_model", "RecallData", "RunFolderError", "RunLock",
    "StopSignals", "TextData", "TrainConfig", "TrainResult", "TrainingInterrupted", "autocast", "check_precision",
    "check_train_state", "check_training_tensors", "claim_run_folder", "clean_stray", "evaluate", "evaluate_file",
    "evaluate_tokens", "learning_rate", "load_checkpoint", "load_config_file", "load_model", "load_resume_checkpoint",
    "load_training_checkpoint", "load_weights", "make_optimizer", "make_scaler", "make_task", "mark_latest",
    "new_run_id", "optimizer_from_flat", "optimizer_to_flat", "prune_checkpoints", "remove_folder",
    "resolve_checkpoint", "run_checkpoints", "save_checkpoint", "split_accuracy", "step_generator", "token_losses",
    "tokenizer_of", "train", "tune_cpu_allocator", "verify_manifest",
]
