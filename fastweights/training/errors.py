"""The errors of run folders (the checkpoint files' own are in :mod:`fastweights.io.errors`)."""

from ..io.errors import CheckpointError, CheckpointWriteError

__all__ = ["CheckpointError", "CheckpointWriteError", "RunFolderError"]


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (held by another trainer, holds another run)."""
