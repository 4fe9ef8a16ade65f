"""Which implementation runs a chunk op, and what it keeps for a backward.

Shared by the PyTorch and the Triton chunk paths, which are peers: neither
imports the other's module to decide.
"""

from __future__ import annotations

import torch

__all__ = ["backward_can_follow"]


def backward_can_follow(*inputs) -> bool:
    """Whether a backward may follow this forward: grad mode on and an input requires grad.

    Decided by the caller of ``autograd.Function.apply``: inside ``forward`` grad
    mode is always off, and ``ctx.needs_input_grad`` stays True under
    ``torch.no_grad()`` / ``torch.inference_mode()`` when the inputs require grad,
    so it cannot tell inference from training. ``None`` inputs are skipped.
    """
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
