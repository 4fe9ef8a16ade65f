"""Training an LM: one concern a module.

- :mod:`.config`: :class:`TrainConfig`, the checked training flags;
- :mod:`.loop`: :func:`train`, the loop (steps, evaluations, checkpoints, exact resume);
- :mod:`.optim`: AdamW and the learning-rate schedule;
- :mod:`.precision`: the weights' dtype, autocast, fp16's gradient scaler;
- :mod:`.distributed`: the process group, heartbeats, collectives with a deadline;
- :mod:`.parallel`: the dp × cp grid of processes, FSDP2 sharding (``--fsdp``, ``--context-parallel``);
- :mod:`.evaluation`: held-out loss and accuracy (of a model, or of a checkpoint on a file);
- :mod:`.metrics`: the run folder's ``metrics.jsonl``;
- :mod:`.train_state`: the training state a checkpoint carries for an exact resume, its schema,
  and the tokenizer a run was trained with;
- :mod:`.run_folder`: a run owns its folder (lock, run id, resume, pruning);
- :mod:`.signals`: SIGINT / SIGTERM save and stop;
- :mod:`.errors`: the one-line error of run folders;
- :mod:`.allocator`: keep freed CPU memory in the process (a measured speed-up of CPU runs).

The checkpoint files (format, sealing, listing, sharded checkpoints) are their own room,
:mod:`fastweights.io`, which :mod:`fastweights.hf` uses too; the names a training script needs
are listed here as well. The data the loop reads comes from :mod:`fastweights.tasks`
(:func:`~fastweights.tasks.make_task`).
"""

# The names load on first use (PEP 562), so that ``import fastweights.training.allocator`` (which
# the command line does before anything else) does not import torch. One list: each module and the
# names this room takes from it; ``__all__`` is made from it.
import importlib as _importlib
import warnings as _warnings

_HOMES = {
    "fastweights.training.allocator": ("tune_cpu_allocator",),
    "fastweights.training.config": ("TrainConfig", "load_config_file"),
    "fastweights.training.distributed": ("DistributedTimeout", "Heartbeat"),
    "fastweights.training.errors": ("RunFolderError",),
    "fastweights.training.evaluation": ("evaluate", "evaluate_file", "evaluate_tokens", "split_accuracy", "token_losses"),
    "fastweights.training.loop": ("TrainResult", "train"),
    "fastweights.training.optim": ("learning_rate", "make_optimizer"),
    "fastweights.training.parallel": ("ParallelPlan", "plan_parallel", "shard_model"),
    "fastweights.training.precision": ("DTYPES", "PRECISIONS", "autocast", "check_precision", "make_scaler"),
    "fastweights.training.run_folder": ("RunLock", "claim_run_folder", "load_resume_checkpoint", "new_run_id",
                                        "prune_checkpoints"),
    "fastweights.training.signals": ("StopSignals", "TrainingInterrupted"),
    "fastweights.training.train_state": ("GRAD_SCALER_SCHEMA", "check_train_state", "check_training_tensors",
                                         "load_training_checkpoint", "optimizer_from_flat", "optimizer_to_flat",
                                         "tokenizer_of"),
    "fastweights.io.checkpoint": ("Checkpoint", "FORMAT", "export_model", "load_checkpoint", "load_model",
                                  "load_model_file", "load_weights", "save_checkpoint", "save_model_file",
                                  "verify_manifest"),
    "fastweights.io.errors": ("CheckpointError", "CheckpointWriteError"),
    "fastweights.io.listing": ("LATEST", "clean_stray", "mark_latest", "remove_folder", "resolve_checkpoint",
                               "run_checkpoints"),
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

#: Names this room used to re-export from :mod:`fastweights.tasks`; they resolve, with a DeprecationWarning.
_TASKS_NAMES = ("RecallData", "TextData", "make_task", "step_generator")


def __getattr__(name):
    if name in _HOME:
        value = getattr(_importlib.import_module(_HOME[name]), name)
        globals()[name] = value
        return value
    if name in _TASKS_NAMES:
        _warnings.warn(f"`fastweights.training.{name}` moved to `fastweights.tasks.{name}`; import it from there "
                       f"(the old name will be removed)", DeprecationWarning, stacklevel=2)
        return getattr(_importlib.import_module("fastweights.tasks"), name)
    raise AttributeError(f"module 'fastweights.training' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_HOME))


__all__ = sorted(_HOME)
