"""Pieces shared by the mixer layers: states, the short convolution, norms, activations.

Glossary (code name -> meaning):

- ``B, T``: batch and sequence length; with ``cu_seqlens`` B = 1 and N sequences
  are packed along T (FlashAttention's convention, as in the ops).
- ``N``: the number of sequences a state holds (B, or len(cu_seqlens) − 1).
- ``H, K, V``: heads, key size, value size per head.
- ``W``: the short convolution's kernel width (4 by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import EluPlusOne, Identity, ReLU

__all__ = [
    "FastWeightState", "ShortConvolution", "RMSNorm", "GatedRMSNorm", "ACTIVATIONS",
    "get_activation", "check_layer_input", "sequence_positions",
]


@dataclass
class FastWeightState:
    """Decode state of a linear-attention / DeltaNet / Gated DeltaNet layer.

    Fields:
        memory: ``[N, H, K, V]`` the fast-weight matrix h (fp32, fp64 for fp64
            inputs); linear attention with the normalizer has ``V + 1`` columns.
        conv: ``[N, W − 1, C]`` the last W − 1 inputs of the short convolution
            (C = its channels), or ``None`` when the layer has no convolution.

    Its size does not depend on how many tokens were read: that is the point.
    """

    memory: torch.Tensor
    conv: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        tensors = [self.memory] + ([self.conv] if self.conv is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def sequence_positions(
    batch: int, length: int, cu_seqlens: Optional[torch.Tensor], device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position within its sequence), each ``[B, T]`` long.

    Without ``cu_seqlens`` row b is sequence b; with it (B = 1) token t belongs to
    the sequence whose span ``[cu[n], cu[n+1])`` contains t.
    """
    if cu_seqlens is None:
        seq = torch.arange(batch, device=device)[:, None].expand(batch, length)
        pos = torch.arange(length, device=device)[None, :].expand(batch, length)
        return seq, pos
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=device), cu[1:] - cu[:-1])
    pos = torch.arange(length, device=device) - cu[seq]
    return seq[None], pos[None]


class ShortConvolution(nn.Module):
    """Causal depthwise 1-D convolution over time, with a decode state.

    ``y_t[c] = Σ_{j=0}^{W−1} weight[c, W−1−j] · x_{t−j}[c]`` (+ bias), where inputs
    before a sequence's start come from the carried state (zeros if none). This is
    the "short convolution" that DeltaNet puts on q, k and v (Yang et al. 2024): it
    gives each token a view of its W − 1 predecessors before the memory is read.

    ``forward(x [B, T, C], state [N, W−1, C] | None, cu_seqlens) -> (y [B, T, C], state)``;
    the returned state holds each sequence's last W − 1 inputs (older ones from the
    incoming state when the sequence is shorter than W − 1).
    """

    def __init__(self, channels: int, kernel_size: int = 4, bias: bool = False) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"ShortConvolution: `kernel_size` must be >= 1, got {kernel_size}")
        self.channels, self.kernel_size = channels, kernel_size
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        nn.init.uniform_(self.weight, -kernel_size ** -0.5, kernel_size ** -0.5)

    def forward(
        self, x: torch.Tensor, state: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        W = self.kernel_size
        seq, pos = sequence_positions(B, T, cu_seqlens, x.device)
        n = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if state is None:
            state = x.new_zeros(n, W - 1, C)
        else:
            self.check_state(state, n)
        y = x * self.weight[:, W - 1]
        for j in range(1, W):
            shifted = F.pad(x, (0, 0, j, 0))[:, :T]  # x_{t−j}, wrong across sequence starts...
            from_state = state[seq, (W - 1 - j + pos).clamp(max=W - 2)]  # ...where the state supplies it
            y = y + torch.where((pos >= j)[..., None], shifted, from_state) * self.weight[:, W - 1 - j]
        if self.bias is not None:
            y = y + self.bias
        if cu_seqlens is None:
            new_state = torch.cat([state, x], dim=1)[:, T:]
        else:
            bounds = cu_seqlens.tolist()
            new_state = torch.stack([
                torch.cat([state[i], x[0, a:b]], dim=0)[b - a:] for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
            ])
        return y, new_state

    def check_state(self, state, n: int) -> None:
        W, C = self.kernel_size, self.channels
        if not isinstance(state, torch.Tensor) or tuple(state.shape) != (n, W - 1, C):
            got = list(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"ShortConvolution: `state` must have shape [N, W-1, C] = [{n}, {W - 1}, {C}], got {got}")

    def step(
        self, x: torch.Tensor, state: torch.Tensor, weight_t: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One token: ``x [N, C]``, ``state [N, W−1, C]`` -> ``(y [N, C], new state [N, W−1, C])``;
        :meth:`forward` with T = 1, as one window times the kernel (``state`` checked by the
        caller; ``weight_t`` is ``weight.t()``, given when the caller keeps it contiguous)."""
        window = torch.cat([state, x.unsqueeze(1)], dim=1)  # [N, W, C]: x_{t−W+1}, ..., x_t
        y = (window * (self.weight.t() if weight_t is None else weight_t)).sum(1)
        if self.bias is not None:
            y = y + self.bias
        return y, window[:, 1:]


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x²) + eps) · weight`` over the last dimension (fp32 or wider inside)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.unit(x) * self.weight).to(x.dtype)

    def unit(self, x: torch.Tensor) -> torch.Tensor:
        """``x / sqrt(mean(x²) + eps)`` without the weight (fp32 for half inputs)."""
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)


class GatedRMSNorm(RMSNorm):
    """``RMSNorm(x) · silu(gate)``: the output norm with gate of DeltaNet / Gated DeltaNet."""

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = super().forward(x)
        return y if gate is None else y * F.silu(gate)


# q/k activations, applied before the q/k normalization. elu+1, relu and identity are
# the feature maps of fastweights.ops; silu is DeltaNet's default (Yang et al. 2024).
ACTIVATIONS = {
    "silu": F.silu,
    "elu": EluPlusOne(),
    "relu": ReLU(),
    "identity": Identity(),
}


def get_activation(name: str, owner: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "elu+1":
        name = "elu"
    if name not in ACTIVATIONS:
        raise ValueError(f"{owner}: unknown `activation` {name!r}; expected one of {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def check_layer_input(owner: str, x, d_model: int, cu_seqlens: Optional[torch.Tensor]) -> None:
    """``x`` must be a float ``[B, T, d_model]`` tensor; ``cu_seqlens`` requires B = 1."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner}: `x` must be a torch.Tensor of shape [B, T, d_model], got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{owner}: `x` must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{owner}: `x` must have shape [B, T, d_model={d_model}], got {list(x.shape)}")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"{owner}: `cu_seqlens` requires batch size 1 (sequences packed along T), got {x.shape[0]}")
