"""RWKV-7 "Goose" time mixing (Peng et al. 2025, arXiv:2503.14456) as a token mixer.

The memory is the DPLR delta rule (:mod:`fastweights.ops.dplr`); everything around it is
RWKV-7's. Glossary (code -> paper, section 4 of the paper; fla 0.6.0's parameter names in
brackets, which :func:`~fastweights.layers.load_fla_state_dict` maps):

- ``token_mix [6, D]`` (``x_r … x_g``): μ, the token shift's interpolation per channel; input
  ``x_t^□ = x_t + μ_□ ⊙ (x_{t−1} − x_t)`` for □ = r, w, k, v, a, g (x_{t−1} is the carried last
  token of the previous call, zeros at a sequence's start).
- ``r_proj``, ``k_proj``, ``v_proj``: the receptance (query) r, the key k and the value v.
- ``w_lora``: the decay; log decay ``w = −e^{−1/2} · sigmoid(w_lora(x^w))`` in (−0.607, 0) per channel.
- ``a_lora``: the in-context learning rate ``a = sigmoid(a_lora(x^a))`` per channel.
- ``v_lora`` (layers after the first): the value residual ``v ← lerp(v, v₁, sigmoid(v_lora(x^v)))``,
  v₁ the first RWKV-7 layer's values of the same tokens.
- ``removal_key_scale`` (``k_k``): ξ, the removal key ``κ̂ = normalize(k ⊙ ξ)`` per head.
- ``replacement_rate`` (``k_a``): α, the replacement key ``k̃ = k ⊙ (1 + (a − 1) ⊙ α)``.
- ``bonus [H, K]`` (``r_k``): ρ, the output correction ``(Σ_K r ⊙ k̃ ⊙ ρ) · v`` per head.
- ``g_lora``: the output gate ``g = up(sigmoid(down(x^g)))`` (no bias).
- ``g_norm``: the per-head group norm of the memory's read (eps = K · ``norm_eps``).

Per head and token (state h [K, V], read as hᵀr; scale 1)::

    h_t = (diag(e^{w_t}) + (κ̂_t ⊙ a_t)(−κ̂_t)ᵀ) h_{t−1} + k̃_t v_tᵀ        chunk_dplr_delta_rule(a=−κ̂, b=κ̂⊙a)
    o_t = GroupNorm(h_tᵀ r_t),   y_t = W_o ((o_t + (Σ r_t ⊙ k̃_t ⊙ ρ) v_t) ⊙ g_t)

Prefill and training run :func:`~fastweights.ops.chunk_dplr_delta_rule`; decoding one token
runs :func:`~fastweights.ops.dplr_step` (a constant-size state: the memory ``[N, H, K, V]``
and the last token ``[N, 1, D]`` the token shift needs, as ``FastWeightState.conv``).

The value residual crosses layers: the first RWKV-7 layer of a stack (``layer_idx=0``) writes
its values into the dict passed as ``value_residual`` (key ``"v_first"``), the later ones read
them; :class:`~fastweights.models.LM` passes one such dict through its blocks per call.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import check_int
from ..ops import check_chunk_option, chunk_dplr_delta_rule, compute_dtype, dplr_step
from .base import pool_step_rows
from .common import (
    FastWeightState, WindowInputs, check_layer_input, forward_with_mask, sequence_positions, window_conv_state,
)

__all__ = ["RWKV7Attention", "LowRank"]

#: e^{−1/2}: the log decay is −e^{−1/2}·sigmoid(·), so a channel keeps at least e^{−e^{−1/2}} ≈ 0.545 per token.
DECAY_FLOOR = math.exp(-0.5)
#: The rows of ``token_mix``: one interpolation per input of the layer.
MIX_ROWS = ("r", "w", "k", "v", "a", "g")


class LowRank(nn.Module):
    """``up(act(down(x)))``: a rank-r map ``[.., D] -> [.., out]`` (the paper's LoRA-style MLPs)."""

    def __init__(self, d_in: int, d_out: int, rank: int, activation: Optional[str], bias: bool = True) -> None:
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=bias)
        self.activation = {None: None, "tanh": torch.tanh, "sigmoid": torch.sigmoid}[activation]
        self.activation_name = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(x)
        return self.up(h if self.activation is None else self.activation(h))


def default_rank(scale: float, d_model: int, factor: float = 1.0) -> int:
    """The paper's low-rank sizes: ``scale·√D`` (times K/64 for the decay, a and v maps), rounded
    to a multiple of 32, at least 32."""
    return max(32, int(round(scale * math.sqrt(d_model) * factor / 32) * 32))


def token_shift(x: torch.Tensor, last: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(x_{t−1} [B, T, D], the new last tokens [N, 1, D])`` for ``x [B, T, D]``: the previous token of
    each position within its sequence, ``last [N, 1, D]`` (or zeros) before a sequence's first one."""
    B, T, D = x.shape
    n = B if cu_seqlens is None else cu_seqlens.numel() - 1
    if last is None:
        last = x.new_zeros(n, 1, D)
    if cu_seqlens is None:
        return torch.cat([last, x[:, :-1]], dim=1), x[:, -1:].clone()
    seq, pos = sequence_positions(B, T, cu_seqlens, x.device)
    shifted = F.pad(x, (0, 0, 1, 0))[:, :T]
    prev = torch.where((pos >= 1)[..., None], shifted, last[seq, 0])
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    lengths = (cu[1:] - cu[:-1])[:, None, None]  # [N, 1, 1]
    from_x = x[0, (cu[1:] - 1).clamp(0, T - 1)][:, None]  # each sequence's last token (if it has one)
    return prev, torch.where(lengths >= 1, from_x, last)


class RWKV7Attention(nn.Module):
    """The RWKV-7 time mixer. ``forward(x, state=None, cu_seqlens=None, ..., value_residual=None) -> (y, state)``.

    Args:
        d_model: D (fla: ``hidden_size``); the keys span all of it: H·K = D.
        n_heads: H (fla: ``num_heads``), or give ``head_dim`` K instead (fla's default: 64).
        value_dim: H·V, the values' total width (default D).
        decay_low_rank_dim, a_low_rank_dim, v_low_rank_dim, gate_low_rank_dim: the ranks of the
            low-rank maps (default: the paper's, :func:`default_rank`).
        layer_idx: 0 for the first RWKV-7 layer of a stack (it has no ``v_lora`` and supplies the
            value residual's v₁); any other value mixes in v₁ (fla's meaning).
        num_hidden_layers: the stack's depth, read by the depth-dependent initialization only.
        norm_eps: the group norm's epsilon per channel (eps = K · norm_eps; fla's default 1e-5).
        elementwise_affine: the group norm's weight and bias.
        chunk_size: C of the chunk op (None: :func:`~fastweights.ops.default_chunk_size`).

    fla's other constructor arguments ``mode`` and ``fuse_norm`` choose among its kernels and
    are accepted and ignored.

    Example::

        >>> first, second = RWKV7Attention(64, 4, layer_idx=0), RWKV7Attention(64, 4, layer_idx=1)
        >>> shared = {}
        >>> y, state = first(torch.randn(2, 10, 64), value_residual=shared)   # writes shared["v_first"]
        >>> y2, state2 = second(y, value_residual=shared)                      # reads it
        >>> state.memory.shape, state.conv.shape                               # the memory, the last token
        (torch.Size([2, 4, 16, 16]), torch.Size([2, 1, 64]))
    """

    kind = "fast-weight mixer"
    #: Decoding windows step token by token (:meth:`forward_window`).
    neutral_pads = False
    #: Takes the ``value_residual`` dict (:class:`~fastweights.models.lm.Block` passes it).
    uses_value_residual = True

    def __init__(
        self, d_model: Optional[int] = None, n_heads: Optional[int] = None, *, head_dim: Optional[int] = None,
        value_dim: Optional[int] = None, decay_low_rank_dim: Optional[int] = None, a_low_rank_dim: Optional[int] = None,
        v_low_rank_dim: Optional[int] = None, gate_low_rank_dim: Optional[int] = None, layer_idx: int = 0,
        num_hidden_layers: Optional[int] = None, norm_eps: float = 1e-5, elementwise_affine: bool = True,
        chunk_size: Optional[int] = None, hidden_size: Optional[int] = None, num_heads: Optional[int] = None,
        mode: str = "chunk", fuse_norm: bool = False,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        for ours, theirs, label in ((d_model, hidden_size, "d_model` and `hidden_size"), (n_heads, num_heads, "n_heads` and `num_heads")):
            if ours is not None and theirs is not None and ours != theirs:
                raise ValueError(f"{name}: `{label}` disagree ({ours} and {theirs}); give one of them")
        d_model = d_model if d_model is not None else hidden_size
        n_heads = n_heads if n_heads is not None else num_heads
        check_int(name, "d_model", d_model)
        if n_heads is None and head_dim is None:
            head_dim = 64
        if n_heads is not None:
            check_int(name, "n_heads", n_heads)
            if d_model % n_heads:
                raise ValueError(f"{name}: `d_model`={d_model} must be divisible by `n_heads`={n_heads}")
            if head_dim is not None and head_dim * n_heads != d_model:
                raise ValueError(f"{name}: `head_dim`={head_dim} times `n_heads`={n_heads} must equal `d_model`={d_model}")
            head_dim = d_model // n_heads
        check_int(name, "head_dim", head_dim)
        if d_model % head_dim:
            raise ValueError(f"{name}: `d_model`={d_model} must be divisible by `head_dim`={head_dim}")
        n_heads = d_model // head_dim
        value_dim = d_model if value_dim is None else value_dim
        check_int(name, "value_dim", value_dim)
        if value_dim % n_heads:
            raise ValueError(f"{name}: `value_dim`={value_dim} must be divisible by the {n_heads} heads")
        check_int(name, "layer_idx", layer_idx, minimum=0, what="an int >= 0 (0: the first RWKV-7 layer)")
        check_chunk_option(name, chunk_size)
        check_int(name, "num_hidden_layers", num_hidden_layers, none_ok=True)
        if mode not in ("chunk", "fused_recurrent"):
            raise ValueError(f"{name}: unknown `mode` {mode!r}; expected 'chunk' or 'fused_recurrent' (fla's kernel choice, ignored)")
        if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not norm_eps > 0:
            raise ValueError(f"{name}: `norm_eps` must be a number > 0, got {norm_eps!r}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, head_dim
        self.value_head_dim, self.value_dim = value_dim // n_heads, value_dim
        self.num_v_heads = n_heads
        self.layer_idx, self.num_hidden_layers, self.chunk_size = layer_idx, num_hidden_layers, chunk_size
        factor = head_dim / 64
        ranks = dict(
            decay=decay_low_rank_dim or default_rank(2.5, d_model, factor),
            a=a_low_rank_dim or default_rank(2.5, d_model, factor),
            v=v_low_rank_dim or default_rank(1.7, d_model, factor),
            gate=gate_low_rank_dim or default_rank(5.0, d_model),
        )
        for key, rank in ranks.items():
            check_int(name, f"{key}_low_rank_dim" if key != "decay" else "decay_low_rank_dim", rank)
        self.token_mix = nn.Parameter(torch.zeros(len(MIX_ROWS), d_model))
        self.removal_key_scale = nn.Parameter(torch.zeros(d_model))
        self.replacement_rate = nn.Parameter(torch.zeros(d_model))
        self.bonus = nn.Parameter(torch.zeros(n_heads, head_dim))
        self.r_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, value_dim, bias=False)
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)
        self.w_lora = LowRank(d_model, d_model, ranks["decay"], "tanh")
        self.v_lora = LowRank(d_model, value_dim, ranks["v"], None) if layer_idx != 0 else None
        self.a_lora = LowRank(d_model, d_model, ranks["a"], None)
        self.g_lora = LowRank(d_model, value_dim, ranks["gate"], "sigmoid", bias=False)
        self.g_norm = nn.GroupNorm(n_heads, value_dim, eps=head_dim * norm_eps, affine=elementwise_affine)
        self.reset_parameters()

    # -- initialization -----------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: Optional[float] = None) -> None:
        """The paper's depth-dependent initialization of the token shift, decay, learning rate and
        value residual (section 6; layer ``layer_idx`` of ``num_hidden_layers``, default 2 layers),
        normal(0, ``std``) projections and low-rank maps, ``out_std`` for ``o_proj``."""
        D, K = self.d_model, self.head_dim
        layers = max(self.num_hidden_layers or 2, self.layer_idx + 1, 2)
        depth = self.layer_idx / (layers - 1)         # 0 (first layer) .. 1 (last)
        shallowness = 1.0 - self.layer_idx / layers   # 1 (first layer) .. ~0
        n = torch.arange(D, dtype=torch.float64)
        ramp = n / D                                   # 0 .. 1 over the channels
        centred = n / max(D - 1, 1) - 0.5              # −0.5 .. 0.5
        within = (n % K - (K - 1) / 2) / max((K - 1) / 2, 1)
        zigzag = within * within.abs()                 # −1 .. 1 within each head
        powers = torch.tensor([0.2, 0.9, 0.7, 0.7, 0.9, 0.2], dtype=torch.float64)  # r, w, k, v, a, g
        self.token_mix.copy_(1.0 - ramp[None] ** (powers[:, None] * shallowness))
        self.removal_key_scale.copy_(0.71 - 0.1 * centred)
        self.replacement_rate.fill_(1.02)
        self.bonus.fill_(-0.04)
        for lin in (self.r_proj, self.k_proj, self.v_proj):
            nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=std if out_std is None else out_std)
        for lora in (self.w_lora, self.a_lora, self.g_lora, self.v_lora):
            if lora is not None:
                nn.init.normal_(lora.down.weight, std=std)
                nn.init.normal_(lora.up.weight, std=std)
        # slow channels first, fast ones last (sigmoid of about −6 .. 0.5), varied within each head
        decay_bias = -6 + 6 * (n / max(D - 1, 1)) ** (1 + depth ** 0.3) + 0.5 + 2.5 * zigzag
        self.w_lora.up.bias.copy_(decay_bias)
        self.a_lora.up.bias.copy_(-0.19 + 0.3 * zigzag + 0.4 * centred)
        if self.v_lora is not None:
            nv = torch.arange(self.value_dim, dtype=torch.float64) / max(self.value_dim - 1, 1) - 0.5
            self.v_lora.up.bias.copy_(0.73 - 0.4 * nv)
        if self.g_norm.weight is not None:
            self.g_norm.weight.fill_(((self.layer_idx + 1) / layers) ** 0.7)
            self.g_norm.bias.zero_()

    # -- the per-token inputs of the memory ---------------------------------------------------
    def memory_shape(self, n: int) -> Tuple[int, ...]:
        return (n, self.n_heads, self.head_dim, self.value_head_dim)

    def _inputs(self, x: torch.Tensor, prev: torch.Tensor, value_residual: Optional[dict]):
        """From ``x`` and its shifted ``prev [B, T, D]``: ``(r, w, k̃, v, a, b, extra)`` with ``r, w,
        k̃, a = −κ̂, b = κ̂ ⊙ a`` ``[B, T, H, K]``, ``v [B, T, H, V]`` (value residual mixed in) and
        ``extra = (g [B, T, H·V], the k̃ the bonus reads)``."""
        B, T, _ = x.shape
        H, K, V = self.n_heads, self.head_dim, self.value_head_dim
        xr, xw, xk, xv, xa, xg = torch.addcmul(x.unsqueeze(2), (prev - x).unsqueeze(2), self.token_mix).unbind(2)
        r = self.r_proj(xr)
        w = -DECAY_FLOOR * torch.sigmoid(self.w_lora(xw))
        k = self.k_proj(xk)
        v = self.v_proj(xv)
        if self.layer_idx == 0:
            if value_residual is not None:
                value_residual["v_first"] = v
        else:
            v_first = None if value_residual is None else value_residual.get("v_first")
            if v_first is None or v_first.shape != v.shape:
                got = "nothing" if v_first is None else f"shape {list(v_first.shape)}"
                raise ValueError(
                    f"{type(self).__name__}: layer_idx={self.layer_idx} mixes in the first RWKV-7 layer's values: "
                    f"pass the dict that layer wrote as `value_residual` (its 'v_first' must have shape "
                    f"{list(v.shape)}, got {got})"
                )
            v = torch.lerp(v, v_first, torch.sigmoid(self.v_lora(xv)))
        a = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        kk = F.normalize((k * self.removal_key_scale).view(B, T, H, K), dim=-1)
        k = k * (1 + (a - 1) * self.replacement_rate)
        r, w, k, a = (t.view(B, T, H, K) for t in (r, w, k, a))
        return r, w, k, v.view(B, T, H, V), -kk, kk * a, g

    def _output(self, o: torch.Tensor, r: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """``o [B, T, H, V]`` -> ``y [B, T, D]``: group norm, the bonus ``(Σ r ⊙ k̃ ⊙ ρ) v``, the gate, W_o."""
        B, T = o.shape[:2]
        o = self.g_norm(o.reshape(B * T, self.value_dim)).view(B, T, self.n_heads, self.value_head_dim)
        bonus = (r * k * self.bonus).sum(-1, keepdim=True) * v
        return self.o_proj((o + bonus).reshape(B, T, self.value_dim) * g)

    # -- forward, one step, verify windows ----------------------------------------------------
    def forward(
        self, x: torch.Tensor, state: Optional[FastWeightState] = None, cu_seqlens: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None, cp_group=None, *,
        value_residual: Optional[dict] = None,
    ) -> Tuple[torch.Tensor, FastWeightState]:
        """``x [B, T, D]`` -> ``(y [B, T, D], state)``; ``state`` as returned by the previous call (N = B or
        the number of packed sequences). T = 1 with a state is one decoding step (:meth:`step`);
        otherwise the chunk op. ``attention_mask [B, T]`` (0 = padding) runs only the real tokens.
        ``value_residual``: the dict carrying the first RWKV-7 layer's values (module docstring)."""
        name = type(self).__name__
        if cp_group is not None:
            raise ValueError(f"{name}: context parallelism (`cp_group`) is not supported by the DPLR ops; "
                             f"run the sequence on one rank")
        mask = check_layer_input(name, x, self.d_model, cu_seqlens, attention_mask)
        if state is not None and not isinstance(state, FastWeightState):
            raise TypeError(f"{name}: `state` must be a FastWeightState (as returned by this layer), got {type(state).__name__}")
        if mask is not None:
            return forward_with_mask(
                lambda xp, s, cu: self.forward(xp, s, cu, value_residual=value_residual), x, state, mask)
        n = x.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        if state is not None:
            self._check_state(state, n, x.dtype)
        if state is not None and x.shape[1] == 1 and cu_seqlens is None:
            return self.step(x, state, value_residual=value_residual)
        prev, last = token_shift(x, None if state is None else state.conv, cu_seqlens)
        r, w, k, v, a, b, g = self._inputs(x, prev, value_residual)
        o, memory = chunk_dplr_delta_rule(  # chunk_size as set (None: the op's one resolver decides)
            r, k, v, a, b, w, 1.0, initial_state=None if state is None else state.memory, output_final_state=True,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, chunk_size=self.chunk_size,
        )
        return self._output(o, r, k, v, g), FastWeightState(memory, last)

    def _check_state(self, state: FastWeightState, n: int, dtype: torch.dtype, pool: bool = False) -> None:
        name = type(self).__name__
        mem, conv = state.memory, state.conv
        want = self.memory_shape(mem.shape[0] if pool and isinstance(mem, torch.Tensor) else n)
        if not isinstance(mem, torch.Tensor) or tuple(mem.shape) != want or mem.dtype != compute_dtype(dtype):
            got = f"{list(mem.shape)} {mem.dtype}" if isinstance(mem, torch.Tensor) else type(mem).__name__
            raise ValueError(f"{name}: `state.memory` must have shape [N, H, K, V] = {list(want)} and dtype "
                             f"{compute_dtype(dtype)}, got {got}")
        want_conv = (mem.shape[0] if pool else n, 1, self.d_model)
        if not isinstance(conv, torch.Tensor) or tuple(conv.shape) != want_conv:
            got = list(conv.shape) if isinstance(conv, torch.Tensor) else type(conv).__name__
            raise ValueError(f"{name}: `state.conv` (the last token, for the token shift) must have shape "
                             f"[N, 1, d_model] = {list(want_conv)}, got {got}")

    def _memory_steps(self, r, k, v, a, b, w, memory: torch.Tensor, rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """The first ``rows`` tokens through :func:`~fastweights.ops.dplr_step` from ``memory``:
        ``(o [N, rows, H, V] in the inputs' dtype, the state after them)``."""
        dt = memory.dtype
        outputs = []
        for t in range(rows):
            o_t, memory = dplr_step(*(z[:, t].to(dt) for z in (r, k, v, a, b, w)), memory, 1.0)
            outputs.append(o_t)
        o = torch.stack(outputs, 1) if outputs else v.new_zeros(v.shape[0], 0, *v.shape[2:], dtype=dt)
        return o.to(r.dtype), memory

    def step(self, x: torch.Tensor, state: FastWeightState, state_indices: Optional[torch.Tensor] = None, *,
             value_residual: Optional[dict] = None) -> Tuple[torch.Tensor, FastWeightState]:
        """One decoding token ``x [N, 1, D]`` -> ``(y [N, 1, D], state)``. With ``state_indices [N]``
        (distinct slots, checked by the caller: :class:`~fastweights.models.pool.SessionPool`) the
        state holds pools of S sessions, and row n reads and writes slot ``state_indices[n]`` in place."""
        pool = state_indices is not None
        if pool:
            self._check_state(state, x.shape[0], x.dtype, pool=True)
        last = state.conv if not pool else state.conv.index_select(0, state_indices)
        r, w, k, v, a, b, g = self._inputs(x, last, value_residual)

        def step(h):
            return self._memory_steps(r, k, v, a, b, w, h, 1)

        o, memory = step(state.memory) if not pool else pool_step_rows(step, state.memory, state_indices)
        y = self._output(o, r, k, v, g)
        conv = x.clone() if not pool else state.conv.index_copy_(0, state_indices, x)
        return y, FastWeightState(memory, conv)

    def forward_window(self, x: torch.Tensor, state: FastWeightState, real: int, chunk_from: int, *,
                       value_residual: Optional[dict] = None):
        """A verify window (:mod:`fastweights.models.window`): ``x [B, P, D]``, the first ``real`` rows
        tokens -> ``(y, the state after them, what a rollback replays)``. The inputs of all P rows are
        computed at once; the memory steps through the real rows (the decoding step's update)."""
        prev, _ = token_shift(x, state.conv, None)
        r, w, k, v, a, b, g = self._inputs(x, prev, value_residual)
        o, memory = self._memory_steps(r, k, v, a, b, w, state.memory, real)
        o = F.pad(o, (0, 0, 0, 0, 0, x.shape[1] - real))
        keep = WindowInputs(torch.stack([k, a, b, w], 2)[:, :real], v[:, :real], None, x[:, :real])
        return self._output(o, r, k, v, g), FastWeightState(memory, window_conv_state(state.conv, x[:, :real])), keep

    def replay(self, before: FastWeightState, keep: WindowInputs, accepted: int, width: int, chunk_from: int) -> FastWeightState:
        """The state after the first ``accepted`` tokens of a window read from ``before``: the same
        steps over the kept inputs; the token shift's state is the last accepted token."""
        k, a, b, w = keep.k[:, :accepted].unbind(2)
        _, memory = self._memory_steps(k, k, keep.v[:, :accepted], a, b, w, before.memory, accepted)
        return FastWeightState(memory, window_conv_state(before.conv, keep.conv[:, :accepted]))
