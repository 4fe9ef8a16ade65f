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

from ..ops import EluPlusOne, Identity, ReLU, packed_positions
from ..ops.cpu import kernels_for
from ..ops.cpu import library as cpu_kernels

__all__ = [
    "FastWeightState", "ShortConvolution", "RMSNorm", "GatedRMSNorm", "ACTIVATIONS",
    "get_activation", "check_layer_input", "sequence_positions", "rotary_embedding",
    "check_rope_theta", "check_attention_mask", "pack_rows", "unpack_rows", "forward_with_mask",
    "align_rows", "unalign_rows", "cached_weights", "check_context_parallel_input", "WindowInputs", "window_conv_state",
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


@dataclass
class WindowInputs:
    """What a layer keeps of a verify window's T tokens to roll back within them
    (:mod:`fastweights.models.window`): the memory's inputs after projection, and the
    short convolution's inputs.

    Fields:
        k: ``[N, T, H, K]`` activated keys; v: ``[N, T, HV, V]`` activated values.
        extra: ``[N, T, ·]`` the layer's own projections (β's logits, the decay's), or ``[N, T, 0]``.
        conv: ``[N, T, C]`` the convolution's inputs (projected q, k, v), or ``None``.
    """

    k: Optional[torch.Tensor] = None
    v: Optional[torch.Tensor] = None
    extra: Optional[torch.Tensor] = None
    conv: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.extra, self.conv) if t is not None)


def window_conv_state(state: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """The short convolution's state after reading ``inputs [N, a, C]`` from ``state [N, W − 1, C]``:
    the last W − 1 rows of ``[state | inputs]`` (a copy: exactly what :class:`ShortConvolution` keeps)."""
    rows = state.shape[1]
    return torch.cat([state, inputs], dim=1)[:, inputs.shape[1]: inputs.shape[1] + rows].clone()


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
    seq, pos = packed_positions(cu_seqlens.to(device), length)
    return seq[None], pos[None]


def rotary_embedding(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE (Su et al. 2021): rotate each pair ``(x[i], x[i + D/2])`` by ``positions · θ^(−2i/D)``.

    ``x [B, T, H, D]`` (D even), ``positions [B, T]`` (token index within its sequence,
    counted from its first real token) -> ``x`` rotated, in its dtype (the angles and
    the rotation are computed in fp32, or fp64 for fp64 inputs). Since rotations
    compose, ``q_t·k_τ`` after rotation depends on ``t − τ`` only: scores see relative
    positions, and a cached key never needs rotating again.
    """
    half = x.shape[-1] // 2
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=dt) / half)  # θ^(−2i/D), [D/2]
    angles = positions.to(dt)[..., None] * inv_freq                              # [B, T, D/2]
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]                 # [B, T, 1, D/2]
    x1, x2 = x[..., :half].to(dt), x[..., half:].to(dt)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def check_rope_theta(owner: str, rope_theta, head_dim: int) -> Optional[float]:
    """A positive RoPE base θ (as float), or ``None`` (NoPE); RoPE needs an even head size."""
    if rope_theta is None:
        return None
    if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)) or not rope_theta > 0 or rope_theta == float("inf"):
        raise ValueError(f"{owner}: `rope_theta` must be a positive number, or None for no positional encoding (NoPE); got {rope_theta!r}")
    if head_dim % 2:
        raise ValueError(f"{owner}: RoPE rotates pairs of channels, so the head size must be even; got head size {head_dim} "
                         f"(set `rope_theta`=None for NoPE, or change `d_model`/`n_heads`)")
    return float(rope_theta)


# -- padding masks ----------------------------------------------------------------------------
#
# A padded batch is run as the packed batch of its real tokens: ``pack_rows`` gathers
# them into ``[1, n, ...]`` with ``cu_seqlens`` marking the rows, the layer runs its
# varlen path (each row is its own sequence: the fast-weight ops never see a pad, so a
# pad writes nothing and decays nothing; the short convolution and softmax attention
# never read one), and ``unpack_rows`` puts the outputs back with zeros at the pads.
# Row b of the result is therefore what row b alone gives, whatever the other rows hold.


def check_attention_mask(owner: str, attention_mask, batch: int, length: int) -> Optional[torch.Tensor]:
    """``attention_mask [B, T]`` (1/True: a real token, 0/False: padding) -> a bool mask, or
    ``None`` when every token is real (then the plain path runs, with no packing).

    Raises a ValueError/TypeError naming ``attention_mask`` for a wrong type or shape, or
    for a row with no real token. Under ``torch.compile`` the checks that read the mask's
    values are skipped (a data-dependent branch breaks the graph) and the mask is always
    returned: the masked path with no pad gives what the plain path gives.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{owner}: `attention_mask` must be a tensor of shape [B, T] = [{batch}, {length}], got {type(attention_mask).__name__}")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise TypeError(f"{owner}: `attention_mask` must be a bool or integer tensor of 0/1, got dtype {attention_mask.dtype}")
    if tuple(attention_mask.shape) != (batch, length):
        raise ValueError(f"{owner}: `attention_mask` must have shape [B, T] = [{batch}, {length}], got {list(attention_mask.shape)}")
    mask = attention_mask.bool()
    if torch.compiler.is_compiling():
        return mask
    if bool(mask.all()):
        return None
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"{owner}: `attention_mask` row(s) {empty} hold no real token; every row needs at least one")
    return mask


def pack_rows(x: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [B, T, ...]``, ``mask [B, T]`` bool -> (the real tokens ``[1, n, ...]`` row after row,
    ``cu_seqlens [B + 1]`` int64 with row b at ``[cu[b], cu[b+1])``)."""
    lengths = mask.sum(dim=1)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return x[mask].unsqueeze(0), cu_seqlens


def unpack_rows(y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_rows`: ``[1, n, ...]`` -> ``[B, T, ...]`` with zeros at the pads."""
    out = y.new_zeros(mask.shape + y.shape[2:])
    out[mask] = y[0]
    return out


def align_rows(mask: torch.Tensor) -> torch.Tensor:
    """``mask [B, T]`` bool -> ``slot [B, T]`` long: where token t of row b goes when each row's
    real tokens are moved to its front (in order) and its pads behind them.

    The static-shape stand-in for :func:`pack_rows` (whose token count depends on the
    mask's values, a graph break when compiled): ``x.scatter(1, slot, x)`` starts every row
    at its first real token, so a causal model run on the aligned rows gives each real token
    what the packed run gives (the pads come after all of a row's real tokens and are never
    read by them). Only the outputs agree: a memory's final state has read the pads too.
    """
    real = mask.long()
    count = real.sum(dim=1, keepdim=True)
    return torch.where(mask, real.cumsum(1) - 1, count + (1 - real).cumsum(1) - 1)


def unalign_rows(y: torch.Tensor, slot: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Inverse of aligning with :func:`align_rows`: ``y [B, T, ...]`` in aligned order -> the
    original order, zeros at the pads (as :func:`unpack_rows` gives)."""
    index = slot.reshape(slot.shape + (1,) * (y.dim() - 2)).expand_as(y)
    out = y.gather(1, index)
    return torch.where(mask.reshape(mask.shape + (1,) * (y.dim() - 2)), out, torch.zeros((), dtype=y.dtype, device=y.device))


def forward_with_mask(forward: Callable, x: torch.Tensor, state, mask: torch.Tensor):
    """``forward(x, state, cu_seqlens) -> (y, state)`` run on the real tokens of ``x`` only
    (see the note above :func:`check_attention_mask`); returns ``(y [B, T, ...], state)``."""
    packed, cu_seqlens = pack_rows(x, mask)
    y, state = forward(packed, state, cu_seqlens)
    return unpack_rows(y, mask), state


def cached_weights(module: nn.Module, slot: str, params, build):
    """``build()``'s tensors, cached on ``module`` (attribute ``slot``) while ``params`` are the same
    tensors, unchanged (an optimizer step or a load bumps a tensor's version; ``.to()`` makes new
    ones) and no gradient is needed; with gradients they are built per call, differentiably.
    For weights a layer concatenates for one matmul: built once per decode, not once per token."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return build()
    cached = module.__dict__.get(slot)
    if cached is None or len(cached[0]) != len(params) or any(
        p is not q or p._version != version or p.data_ptr() != ptr for p, (q, version, ptr) in zip(params, cached[0])
    ):
        weights = tuple(None if w is None else w.detach().contiguous() for w in build())
        cached = ([(p, p._version, p.data_ptr()) for p in params], weights)
        module.__dict__[slot] = cached
    return cached[1]


def _compiled_conv(x, state, taps):
    """The compiled CPU kernels' module when they can run this convolution (at most 16 taps, and
    :func:`~fastweights.ops.cpu.kernels_for`'s conditions), else None (the PyTorch code below)."""
    return None if taps.shape[0] > 16 else kernels_for(x, state, taps)


class _CausalConv(torch.autograd.Function):
    """``y_t = Σ_j weight[:, W−1−j] · x_{t−j}`` over ``[state | x]`` (``x [B, T, C]``, ``state
    [B, W−1, C]``, ``weight [C, W]``), with a hand-written backward.

    Autograd's graph of the W shifted products keeps W intermediate sums and, per tap,
    zero-fills a ``[B, W−1+T, C]`` gradient and adds into it; these passes over
    activations are most of a short convolution's cost (memory traffic, not arithmetic).
    Here the forward accumulates in place into one output, and the backward writes
    d[state | x] into one buffer (W in-place products) and dweight as one product-sum per
    tap. (No ``out=`` into strided views: torch.compile traces this backward and breaks
    its graph on those.)
    """

    @staticmethod
    def forward(ctx, x, state, weight):
        T, W = x.shape[1], weight.shape[1]
        taps = weight.t().contiguous()  # [W, C]: each tap's C weights contiguous (a strided row halves the speed)
        ctx.native = _compiled_conv(x, state, taps) is not None
        if ctx.native:  # fastweights/ops/cpu/short_conv.cpp: one pass, no [state | x] copy
            x, state = x.contiguous(), state.contiguous()
            ctx.save_for_backward(x, state, taps)
            return cpu_kernels.short_conv_fwd(x, state, taps)
        padded = torch.cat([state, x], dim=1)  # [B, W − 1 + T, C]
        y = torch.mul(padded[:, W - 1:], taps[W - 1])
        for j in range(1, W):
            y.addcmul_(padded[:, W - 1 - j: W - 1 - j + T], taps[W - 1 - j])
        ctx.save_for_backward(padded, taps)
        return y

    @staticmethod
    def backward(ctx, dy):
        if ctx.native:
            x, state, taps = ctx.saved_tensors
            dx, dstate, d_taps = cpu_kernels.short_conv_bwd(dy.contiguous(), x, state, taps)
            return dx, dstate, d_taps.t()
        padded, taps = ctx.saved_tensors
        T, W = dy.shape[1], taps.shape[0]
        dx = dstate = dweight = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            # y_t reads row t + i of [state | x] with tap i: so row s collects dy_{s−i} · tap i.
            d_padded = torch.zeros(padded.shape, dtype=padded.dtype, device=padded.device)
            for i in range(W):
                d_padded[:, i: i + T].addcmul_(dy, taps[i])
            dstate, dx = d_padded[:, : W - 1], d_padded[:, W - 1:]
        if ctx.needs_input_grad[2]:
            d_taps = torch.stack([(dy * padded[:, i: i + T]).sum((0, 1)) for i in range(W)])  # [W, C]
            dweight = d_taps.t().to(taps.dtype)
        return dx, dstate, dweight


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, state: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The short convolution as a function: ``y_t = Σ_j weight[:, W−1−j] · x_{t−j}`` (+ bias).

    ``x [B, T, C]``, ``weight [C, W]``, ``state [B, W−1, C]`` (the inputs before x; zeros if
    None) -> ``y [B, T, C]``; the hand-written backward of ``_CausalConv``. :class:`ShortConvolution`
    runs it, and ``fastweights.hf`` routes transformers' ``causal_conv1d_fn`` to it.
    """
    if state is None:
        state = x.new_zeros(x.shape[0], weight.shape[1] - 1, x.shape[2])
    y = _CausalConv.apply(x, state, weight)
    return y if bias is None else y + bias


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
        self, x: torch.Tensor, state: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
        cp_group=None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if cp_group is not None:
            return self._forward_context_parallel(x, state, cu_seqlens, cp_group), None
        B, T, C = x.shape
        W = self.kernel_size
        n = B if cu_seqlens is None else cu_seqlens.numel() - 1
        if state is None:
            state = x.new_zeros(n, W - 1, C)
        else:
            self.check_state(state, n)
        if cu_seqlens is None:  # one sequence per row: shifted views of [state | x], W products
            y = causal_conv1d(x, self.weight, self.bias, state)
            # The last W − 1 inputs, from x alone when it is long enough (no copy of [state | x]).
            new_state = x[:, T - (W - 1):].clone() if T >= W - 1 else torch.cat([state[:, T:], x], dim=1)
            return y, new_state
        seq, pos = sequence_positions(B, T, cu_seqlens, x.device)
        y = x * self.weight[:, W - 1]
        for j in range(1, W):
            shifted = F.pad(x, (0, 0, j, 0))[:, :T]  # x_{t−j}, wrong across sequence starts...
            from_state = state[seq, (W - 1 - j + pos).clamp(max=W - 2)]  # ...where the state supplies it
            y = y + torch.where((pos >= j)[..., None], shifted, from_state) * self.weight[:, W - 1 - j]
        if self.bias is not None:
            y = y + self.bias
        # Sequence i's new state is rows len_i .. len_i + W − 2 of [state[i] | its tokens]: a
        # gather of static shape [N, W − 1, C] (reading the offsets on the host breaks a compiled graph).
        cu = cu_seqlens.to(device=x.device, dtype=torch.long)
        rows = (cu[1:] - cu[:-1])[:, None] + torch.arange(W - 1, device=x.device)  # [N, W − 1]
        from_x = x[0, (cu[:-1, None] + rows - (W - 1)).clamp(0, T - 1)]
        from_state = state[torch.arange(n, device=x.device)[:, None], rows.clamp(max=max(W - 2, 0))]
        return y, torch.where((rows >= W - 1)[..., None], from_x, from_state)

    def _forward_context_parallel(self, x: torch.Tensor, state, cu_seqlens, cp_group) -> torch.Tensor:
        """``y [B, L, C]`` for this rank's slice ``x [B, L, C]`` of a sequence split over ``cp_group``
        (:mod:`fastweights.ops.context_parallel`): the W − 1 inputs before the slice come from the
        previous rank (a "halo"; the gradient flows back to it). No state in or out: a slice
        of a sequence is training or prefill, not decoding. The caller has checked that every
        rank holds the same L and the same global ``cu_seqlens``."""
        from ..ops.context_parallel import check_cp_group, conv_states_from_halo, exchange_halo, host_offsets, local_segments

        if state is not None:
            raise ValueError("ShortConvolution: `state` cannot be given with `cp_group` (a slice of a sequence is "
                             "trained or prefilled; decoding runs on one process)")
        B, L, C = x.shape
        W = self.kernel_size
        if W == 1:
            return self.forward(x, None, cu_seqlens)[0]
        # [B, W − 1, C]: the inputs before the slice, from the previous rank (or, with L < W − 1, several)
        halo = exchange_halo(x[:, max(L - (W - 1), 0):], cp_group, W - 1)
        if cu_seqlens is None:
            return self.forward(x, halo)[0]
        rank, world = check_cp_group("ShortConvolution", cp_group)
        segments = local_segments(host_offsets(cu_seqlens), B, L, rank, world)
        local_cu = torch.tensor(segments.offsets, device=x.device)
        return self.forward(x, conv_states_from_halo(halo, segments), local_cu)[0]

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


def check_layer_input(
    owner: str, x, d_model: int, cu_seqlens: Optional[torch.Tensor], attention_mask: Optional[torch.Tensor] = None
) -> Optional[torch.Tensor]:
    """``x`` must be a float ``[B, T, d_model]`` tensor; ``cu_seqlens`` requires B = 1 and
    excludes ``attention_mask``. Returns the checked mask (see :func:`check_attention_mask`)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner}: `x` must be a torch.Tensor of shape [B, T, d_model], got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{owner}: `x` must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{owner}: `x` must have shape [B, T, d_model={d_model}], got {list(x.shape)}")
    if cu_seqlens is not None and x.shape[0] != 1:
        raise ValueError(f"{owner}: `cu_seqlens` requires batch size 1 (sequences packed along T), got {x.shape[0]}")
    if cu_seqlens is not None and attention_mask is not None:
        raise ValueError(f"{owner}: give `cu_seqlens` (packed rows) or `attention_mask` (padded rows), not both")
    return check_attention_mask(owner, attention_mask, x.shape[0], x.shape[1])


def check_context_parallel_input(owner: str, x, d_model: int, state, cu_seqlens, attention_mask, cp_group) -> None:
    """A layer's checks under context parallelism, passed or failed by every rank of ``cp_group``
    together (:func:`fastweights.ops.context_parallel.agree_on_slice`): ``x`` is the rank's slice
    ``[B, L, d_model]`` (the same L everywhere), ``cu_seqlens`` the global offsets; a ``state``
    or an ``attention_mask`` is refused (a slice is trained or prefilled, not decoded; pack
    padded rows with ``cu_seqlens`` instead)."""
    from ..ops.context_parallel import agree_on_slice

    def local() -> None:
        check_layer_input(owner, x, d_model, None)
        if state is not None:
            raise ValueError(f"{owner}: `state` cannot be given with `cp_group`: a context-parallel call trains or "
                             f"prefills a slice of a sequence; decode on one process")
        if attention_mask is not None:
            raise ValueError(f"{owner}: `attention_mask` cannot be given with `cp_group`; pack the rows with "
                             f"`cu_seqlens` (global offsets) instead")

    agree_on_slice(owner, cp_group, "x", x, cu_seqlens, local)
