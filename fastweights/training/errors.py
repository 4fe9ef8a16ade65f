"""The errors of checkpoints and run folders (all ``ValueError``s with a one-line message)."""

__all__ = ["CheckpointError", "CheckpointWriteError", "RunFolderError"]


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match its config."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a read-only folder); nothing was replaced."""


class RunFolderError(ValueError):
    """The run folder cannot be used as asked (held by another trainer, holds another run)."""
