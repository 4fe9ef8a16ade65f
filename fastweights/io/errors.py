"""The errors of the checkpoint files (``ValueError``s with a one-line message)."""

__all__ = ["CheckpointError", "CheckpointWriteError"]


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match its config."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a read-only folder); nothing was replaced."""
