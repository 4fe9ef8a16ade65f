"""The checkpoint files: what a model or a run looks like on disk, and reading it back.

Both :mod:`fastweights.training` (which writes checkpoints while it trains and resumes from them)
and :mod:`fastweights.hf` (which converts them to and from transformers' folders) use this room;
it needs only the model (:mod:`fastweights.models`) and the shared :mod:`fastweights.config`.

- :mod:`.checkpoint`: the checkpoint folder (``config.json``, ``model.safetensors``, ``train.json``,
  ``train_state.safetensors``, ``manifest.json``): save, verify, load, and the single-file model of
  ``fastweights export``;
- :mod:`.dcp_checkpoint`: an FSDP run's sharded checkpoints, through ``torch.distributed.checkpoint``;
- :mod:`.sealing`: a checkpoint folder sealed (manifest last, fsync, rename), for both kinds;
- :mod:`.listing`: a run folder's checkpoints (names, ``latest``, listing, removal);
- :mod:`.errors`: :class:`CheckpointError` and :class:`CheckpointWriteError` (one-line ``ValueError``s).

Files are safetensors plus JSON: loading executes no code (docs/design.md, section 7). The names
are imported from their modules (``from fastweights.io.checkpoint import load_model``); the
training room also lists the ones a training script needs (``fastweights.training.load_model``).
"""
