"""The shared skeleton of the fast-weight mixers (linear attention, DeltaNet, Gated DeltaNet).

Per token, with ``x [B, T, d_model]``::

    q, k, v = W_q x, W_k x, W_v x                     projections           [B, T, H·K]
    q, k, v = ShortConv(q, k, v)                        optional, kernel W    (causal, depthwise)
    q, k = act(q), act(k);  v = act_v(v)                silu / elu+1 / relu / identity
    o, h = op(q, k, v, ..., initial_state=h)            fastweights.ops: the memory itself
    o = RMSNorm(o) · silu(W_g x)                        per head; the gate is optional
    y = W_o o                                                                 [B, T, d_model]

A subclass only says which op to call and with which extra per-token inputs
(β, g): :meth:`FastWeightMixer.memory`. Prefill and training use the chunk
form; decoding one token from a carried state is :meth:`FastWeightMixer.step`,
the same computation fused into a few ops: one matmul for every input
projection, the convolution's window as one product, and the op's one-token
update (``fastweights.ops``' ``*_step`` functions, which the recurrent forms
run token by token: a layer never re-implements a recurrence), given by
:meth:`FastWeightMixer.memory_step`.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import check_chunk_option, compute_dtype, resolve_chunk_size
from .common import (
    FastWeightState, GatedRMSNorm, ShortConvolution, WindowInputs, cached_weights, check_context_parallel_input,
    check_layer_input, forward_with_mask, get_activation, window_conv_state,
)


class FastWeightMixer(nn.Module):
    """Base class; see the module docstring. Subclasses implement :meth:`memory`.

    Args:
        d_model: model width; ``n_heads`` must divide it (head size K = V = d_model / n_heads).
        n_heads: H.
        use_short_conv: put a causal depthwise convolution of width ``conv_size`` on q, k, v.
        conv_size: W, the convolution's kernel width.
        activation: q/k activation: ``"silu"``, ``"elu"`` (elu+1), ``"relu"`` or ``"identity"``.
        value_activation: the same choice for v.
        use_output_gate: multiply the normalized output by ``silu(W_g x)``.
        norm_eps: epsilon of the output RMSNorm.
        chunk_size: C of the chunk form used for prefill and training; ``None`` (default) picks
            it per key size and device (:func:`~fastweights.ops.default_chunk_size`:
            32 on the CPU for K <= 64, else 64).
        head_dim: K, the key (and query) size per head; ``None`` means d_model / n_heads.
        expand_v: V = expand_v · K, the value size per head (1 by default).
        num_v_heads: HV, the number of value heads (a multiple of n_heads; each q/k head
            serves HV / n_heads value heads, "grouped value heads"); ``None`` means n_heads.

    flash-linear-attention's constructor names are accepted too (:data:`FLA_NAMES`):
    ``hidden_size`` for d_model, ``num_heads`` for n_heads, ``use_gate`` for
    use_output_gate; ``head_dim``, ``expand_v``, ``num_v_heads``, ``conv_size`` and
    ``norm_eps`` are spelled alike. Defaults are ours, not fla's (README, "fla compatibility").
    """

    kind = "fast-weight mixer"

    def __init__(
        self,
        d_model: Optional[int] = None,
        n_heads: Optional[int] = None,
        *,
        use_short_conv: bool = True,
        conv_size: int = 4,
        activation: str = "silu",
        value_activation: str = "silu",
        use_output_gate: bool = True,
        norm_eps: float = 1e-6,
        chunk_size: Optional[int] = None,
        head_dim: Optional[int] = None,
        expand_v: float = 1.0,
        num_v_heads: Optional[int] = None,
        **fla_names,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        d_model, n_heads, use_output_gate = resolve_fla_names(
            name, fla_names, d_model=d_model, n_heads=n_heads, use_output_gate=use_output_gate,
        )
        if not isinstance(d_model, int) or not isinstance(n_heads, int) or d_model <= 0 or n_heads <= 0:
            raise ValueError(f"{name}: `d_model` and `n_heads` must be positive ints, got {d_model!r} and {n_heads!r}")
        if head_dim is None and d_model % n_heads:
            raise ValueError(f"{name}: `d_model`={d_model} must be divisible by `n_heads`={n_heads}")
        key_dim = d_model // n_heads if head_dim is None else head_dim
        value_dim = key_dim * expand_v
        value_heads = n_heads if num_v_heads is None else num_v_heads
        if not isinstance(key_dim, int) or key_dim <= 0 or value_dim != int(value_dim) or value_dim <= 0:
            raise ValueError(
                f"{name}: `head_dim`={head_dim!r} and `expand_v`={expand_v!r} must give positive integer "
                f"key and value sizes, got K={key_dim!r}, V={value_dim!r}"
            )
        if not isinstance(value_heads, int) or value_heads <= 0 or value_heads % n_heads:
            raise ValueError(f"{name}: `num_v_heads`={num_v_heads!r} must be a positive multiple of `n_heads`={n_heads}")
        self.d_model, self.n_heads = d_model, n_heads
        self.head_dim, self.value_head_dim, self.num_v_heads = key_dim, int(value_dim), value_heads
        self.key_width, self.value_width = n_heads * key_dim, value_heads * int(value_dim)  # H·K, HV·V
        check_chunk_option(name, chunk_size)
        self.chunk_size = chunk_size
        self.activation = get_activation(activation, name)
        self.value_activation = get_activation(value_activation, name)
        self.q_proj = nn.Linear(d_model, self.key_width, bias=False)
        self.k_proj = nn.Linear(d_model, self.key_width, bias=False)
        self.v_proj = nn.Linear(d_model, self.value_width, bias=False)
        self.conv = ShortConvolution(2 * self.key_width + self.value_width, conv_size) if use_short_conv else None
        self.g_proj = nn.Linear(d_model, self.value_width, bias=False) if use_output_gate else None
        self.o_norm = GatedRMSNorm(self.value_head_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_width, d_model, bias=False)

    # -- the part a subclass provides ------------------------------------------------------
    def memory(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: torch.Tensor,
        initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], recurrent: bool,
        max_seqlen: Optional[int] = None, cp_group=None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Run the op: ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``extra [B, T, ·]`` (the
        subclass's own projections of x, in the order of :meth:`step_projections`: β's logits,
        the decay's) -> ``(o [B, T, HV, V], final state [N, HV, K, V])``; ``cu_seqlens`` and
        ``max_seqlen`` go to the op as they are. With ``cp_group`` (context parallelism) the
        chunk op runs on the rank's slice and no final state is asked for (None)."""
        raise NotImplementedError

    def memory_step(
        self, qk: torch.Tensor, v: torch.Tensor, extra: torch.Tensor, memory: torch.Tensor,
        state_indices: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """One decoding token of the op: ``qk [N, 2, H, K]`` (q and k side by side), ``v [N, H, V]``
        (activated), ``extra [N, ·]`` (the outputs of :meth:`step_projections` beyond q, k, v and
        the gate) and the state ``[N, H, K, V]`` -> ``(o [N, H, V] in the compute dtype, new state)``.
        With ``state_indices [N]`` (int64, slots in ``[0, S)``, distinct), ``memory`` is a pool
        ``[S, H, K, V]``: row n reads and writes slot ``state_indices[n]`` in place (the op's pool
        form, :mod:`fastweights.ops.state_pool`), and the pool is returned."""
        raise NotImplementedError

    def memory_op(self, recurrent: bool, recurrent_op, chunk_op):
        """The op a :meth:`memory` call runs: ``recurrent_op`` (no chunks), or ``chunk_op`` with the
        layer's ``chunk_size`` passed down as it is (None included: the ops' one resolver decides)."""
        return recurrent_op if recurrent else functools.partial(chunk_op, chunk_size=self.chunk_size)

    def chunk_length(self, like: torch.Tensor) -> int:
        """C of this layer's chunk-op calls on tensors like ``like``: what the op runs for the layer's
        ``chunk_size`` (passed down as it is, None included), by the ops' one resolver
        (:func:`~fastweights.ops.resolve_chunk_size`)."""
        return resolve_chunk_size(self.chunk_size, self.head_dim, like.device)

    def memory_shape(self, n: int) -> Tuple[int, ...]:
        """The state's shape ``[N, H, K, V]`` for N sequences."""
        return (n, self.n_heads, self.head_dim, self.head_dim)

    def step_projections(self) -> Tuple[str, ...]:
        """Names of the linear maps of x that one decoding step needs, in the order of the
        fused matmul: q, k, v, the output gate (if any), then a subclass's own (β, the decay)."""
        return ("q_proj", "k_proj", "v_proj") + (() if self.g_proj is None else ("g_proj",))

    # -- the shared skeleton ------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        state: Optional[FastWeightState] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        cp_group=None,
    ) -> Tuple[torch.Tensor, Optional[FastWeightState]]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model], state)``.

        ``state`` is the :class:`FastWeightState` returned by the previous call (N = B,
        or the number of sequences in ``cu_seqlens``). A call with T = 1 and a state
        is one decoding step (:meth:`step`, the recurrent form's update fused); anything else uses the chunk op.
        ``attention_mask [B, T]`` (0 = padding, e.g. a left-padded batch) runs the real
        tokens only: a pad neither writes to nor decays the memory, nor enters the
        convolution, and its output is 0. ``max_seqlen`` (with ``cu_seqlens``): the longest
        sequence's length, passed to the op so that it need not read the offsets (under
        ``torch.compile`` that read is a graph break).

        Context parallelism: with ``cp_group`` (a ``torch.distributed.ProcessGroup``) ``x`` is
        this rank's contiguous slice ``[B, L, d_model]`` of the sequence (``cu_seqlens``: the
        global offsets, the same on every rank); the short convolution takes its W − 1
        inputs before the slice from the previous rank and the op exchanges state
        summaries (:mod:`fastweights.ops.context_parallel`). Returns ``(y, None)``: no state
        (training and prefill of a slice; ``state`` and ``attention_mask`` are refused).
        """
        name = type(self).__name__
        if cp_group is not None:
            check_context_parallel_input(name, x, self.d_model, state, cu_seqlens, attention_mask, cp_group)
            mask = None
        else:
            mask = check_layer_input(name, x, self.d_model, cu_seqlens, attention_mask)
        if state is not None and not isinstance(state, FastWeightState):
            raise TypeError(f"{name}: `state` must be a FastWeightState (as returned by this layer), got {type(state).__name__}")
        if mask is not None:
            return forward_with_mask(self, x, state, mask)
        if state is not None and x.shape[1] == 1 and cu_seqlens is None and self.fused_step:
            return self.step(x, state)
        q, k, v, gate, extra, conv_state, _ = self._memory_inputs(x, state, cu_seqlens, cp_group)
        recurrent = state is not None and x.shape[1] == 1
        o, memory = self.memory(q, k, v, extra, None if state is None else state.memory, cu_seqlens, recurrent,
                                 max_seqlen=max_seqlen, cp_group=cp_group)
        y = self._output(o, gate)
        return y, (None if cp_group is not None else FastWeightState(memory, conv_state))

    def _memory_inputs(self, x: torch.Tensor, state: Optional[FastWeightState], cu_seqlens: Optional[torch.Tensor],
                       cp_group=None):
        """The per-token inputs of the memory for ``x [B, T, d_model]``: ``(q, k [B, T, H, K], v [B, T, HV, V],
        gate [B, T, HV·V] or None, extra [B, T, ·], the convolution's new state or None, its inputs
        [B, T, C] or None)``: projections (one matmul), short convolution, activations."""
        name = type(self).__name__
        B, T, _ = x.shape
        kw, vw = self.key_width, self.value_width
        proj = F.linear(x, self._in_weight())  # [B, T, 2·H·K + HV·V (+ HV·V gate) + extra]: one matmul
        gated = self.g_proj is not None
        sizes = [2 * kw + vw] + ([vw] if gated else []) + [proj.shape[-1] - 2 * kw - vw - (vw if gated else 0)]
        qkv, *rest = proj.split(sizes, dim=-1)  # (split's backward is one cat; slicing's, a zero fill each)
        gate, extra = rest if gated else (None, rest[0])
        conv_state = conv_input = None
        if self.conv is not None:
            conv_input = qkv
            qkv, conv_state = self.conv(qkv, None if state is None else state.conv, cu_seqlens, cp_group=cp_group)
        elif state is not None and state.conv is not None:
            raise ValueError(f"{name}: `state` carries a convolution state but this layer has no short convolution")
        if self.activation is self.value_activation:  # elementwise: once on all of q, k, v
            q, k, v = self.activation(qkv).split([kw, kw, vw], dim=-1)
        else:
            q, k, v = qkv.split([kw, kw, vw], dim=-1)
            q, k, v = self.activation(q), self.activation(k), self.value_activation(v)
        q, k = (t.reshape(B, T, self.n_heads, self.head_dim) for t in (q, k))
        v = v.reshape(B, T, self.num_v_heads, self.value_head_dim)
        return q, k, v, gate, extra, conv_state, conv_input

    def _output(self, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        """``o [B, T, HV, V]`` -> ``y [B, T, d_model]``: the output norm, the gate, the output projection."""
        B, T, hv, dv = o.shape
        o = self.o_norm(o, None if gate is None else gate.reshape(B, T, hv, dv))
        return self.o_proj(o.reshape(B, T, hv * dv))

    # -- verify windows (speculative decoding; fastweights.models.window) -----------------------
    #: Whether a padded row can be made a no-op of the memory (β = 0, α = 1: the delta rules);
    #: linear attention cannot (φ(k) > 0 for its usual maps), so its windows run the recurrent form.
    neutral_pads = False

    def forward_window(
        self, x: torch.Tensor, state: FastWeightState, real: int, chunk_from: int
    ) -> Tuple[torch.Tensor, FastWeightState, "WindowInputs"]:
        """A verify window: ``x [B, P, d_model]`` whose first ``real`` rows are tokens and the rest
        padding (P fixed per window width, so every token's arithmetic is the same whatever the
        window's length) -> ``(y [B, P, d_model], the state after the real tokens, their inputs)``.

        The memory runs the chunk form over all P rows when ``P >= chunk_from`` and the layer
        has :attr:`neutral_pads` (pads get β = 0 and α = 1, so they leave the state exactly as
        it was), else the recurrent form over the real rows (:meth:`memory_step`, the decoding
        step's update, when :attr:`fused_step` applies). :meth:`replay` redoes the same
        computation for a prefix of the real rows.
        """
        q, k, v, gate, extra, _, conv_input = self._memory_inputs(x, state, None)
        o, memory = self._window_memory(q, k, v, extra, state.memory, real, chunk_from)
        conv = None if conv_input is None else window_conv_state(state.conv, conv_input[:, :real])
        keep = WindowInputs(k[:, :real], v[:, :real], extra[:, :real], None if conv_input is None else conv_input[:, :real])
        return self._output(o, gate), FastWeightState(memory, conv), keep

    def _window_memory(self, q, k, v, extra, memory, real: int, chunk_from: int):
        """The memory of a window (see :meth:`forward_window`): ``(o [B, P, HV, V], state after ``real`` rows)``."""
        P = q.shape[1]
        # One memory layout for the forward (views of the projections) and the replay (fresh tensors):
        # vectorized elementwise kernels (sigmoid, exp) round a strided tensor's elements differently.
        q, k, v, extra = (t.contiguous() for t in (q, k, v, extra))
        if self.neutral_pads and P >= chunk_from:
            if real < P:  # β = sigmoid(−∞) = 0 and g = −exp(A)·softplus(−∞) = −0: a pad writes and decays nothing
                extra = torch.cat([extra[:, :real], extra.new_full((extra.shape[0], P - real, extra.shape[2]), float("-inf"))], 1)
            return self.memory(q, k, v, extra, memory, None, recurrent=False)
        tokens = self.window_step_inputs(q, k, v, extra, memory.dtype) if self.fused_step else None
        if tokens is not None:  # per-token inputs of all P rows at once, then the one-token update per real row
            outputs = []
            for t in range(real):
                o_t, memory = self.window_step(*(None if x is None else x[:, t] for x in tokens), memory)
                outputs.append(o_t)
            o = torch.stack(outputs, 1).to(q.dtype)
        elif self.fused_step:  # the decoding step's update, token by token (no per-call checks)
            outputs = []
            for t in range(real):
                o_t, memory = self.memory_step(torch.stack([q[:, t], k[:, t]], 1), v[:, t], extra[:, t], memory)
                outputs.append(o_t)
            o = torch.stack(outputs, 1).to(q.dtype)
        else:
            o, memory = self.memory(q[:, :real], k[:, :real], v[:, :real], extra[:, :real], memory, None, recurrent=True)
        return F.pad(o, (0, 0, 0, 0, 0, P - real)), memory

    def window_step_inputs(self, q, k, v, extra, dtype):
        """For a window's recurrent form: the op's per-token inputs of all P rows, ``[N, P, ...]``
        tensors in the state's ``dtype`` (normalized q, k; v; β; g or None), computed at once
        and then read row by row by :meth:`window_step`; ``None`` (default) steps with
        :meth:`memory_step` instead."""
        return None

    def window_step(self, q, k, v, beta, g, memory):
        """One token of :meth:`window_step_inputs`' rows: ``(o [N, H, V], new state)``."""
        raise NotImplementedError

    def replay(self, before: FastWeightState, keep: "WindowInputs", accepted: int, width: int, chunk_from: int) -> FastWeightState:
        """The state after the first ``accepted`` tokens of a window read from ``before``: the memory
        computation of a window of exactly those tokens (padded to ``width`` rows, the same form),
        from the kept inputs; the convolution's state is a copy of their last W − 1 inputs."""
        N, dt = keep.k.shape[0], keep.k.dtype
        k = keep.k.new_zeros((N, width) + keep.k.shape[2:])
        v = keep.v.new_zeros((N, width) + keep.v.shape[2:])
        extra = keep.extra.new_zeros((N, width, keep.extra.shape[2]))
        k[:, :accepted], v[:, :accepted], extra[:, :accepted] = keep.k[:, :accepted], keep.v[:, :accepted], keep.extra[:, :accepted]
        q = torch.zeros_like(k, dtype=dt)  # the outputs are not needed; the state does not read q
        _, memory = self._window_memory(q, k, v, extra, before.memory, accepted, chunk_from)
        conv = None if keep.conv is None else window_conv_state(before.conv, keep.conv[:, :accepted])
        return FastWeightState(memory, conv)

    def step(
        self, x: torch.Tensor, state: FastWeightState, state_indices: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, FastWeightState]:
        """One decoding step: ``x [N, 1, d_model]`` and the state -> ``(y [N, 1, d_model], state)``.

        With ``state_indices [N]`` (an int64 tensor of distinct slots in ``[0, S)``, checked by
        the caller: :class:`~fastweights.models.pool.SessionPool`), ``state`` holds pools of S
        sessions (memory ``[S, H, K, V]``, convolution ``[S, W − 1, C]``) and row n steps the
        session at slot ``state_indices[n]`` in place: the memory through the op's pool form
        (on the CPU the compiled kernel updates the slots where they lie: no gathered copy of
        the states), the convolution's small window gathered and written back. ``state`` itself
        is returned. The rows' arithmetic is that of the same sessions stepped one state per row.

        The same function as :meth:`forward` with T = 1 (which calls it), in about 45
        aten calls per layer (views included): every projection of x is one matmul
        (weights concatenated and transposed once, cached until a parameter changes:
        :meth:`_step_weights`), the short convolution is its window times the kernel,
        q and k are activated and normalized together, and the state update is the
        op's one-token step (:meth:`memory_step`). The state is checked here in Python
        (shapes, dtype); the ops' per-call checks (a NaN scan per tensor) stay with the
        public ops.
        """
        name = type(self).__name__
        if not self.fused_step:
            raise ValueError(f"{name}.step: the fused step needs as many value heads as heads and V = K; use forward")
        N, D, H, K = x.shape[0], self.key_width, self.n_heads, self.head_dim  # D: H·K = HV·V here
        modules = self._modules  # (plain dict lookups: nn.Module.__getattr__ costs ~1 µs a call)
        conv = modules.get("conv")
        if conv is not None:
            conv.check_state(state.conv, N if state_indices is None else state.conv.shape[0])
        elif state.conv is not None:
            raise ValueError(f"{name}: `state` carries a convolution state but this layer has no short convolution")
        memory = state.memory
        want = self.memory_shape(N)
        if state_indices is not None and isinstance(memory, torch.Tensor):  # a pool: any number of slots
            want = tuple(memory.shape[:1]) + want[1:]
        if not isinstance(memory, torch.Tensor) or tuple(memory.shape) != want or memory.dtype != compute_dtype(x.dtype):
            got = f"{list(memory.shape)} {memory.dtype}" if isinstance(memory, torch.Tensor) else type(memory).__name__
            rows = "S" if state_indices is not None else "N"
            raise ValueError(
                f"{name}: `state.memory` must have shape [{rows}, H, K, V] = {list(want)} and dtype {compute_dtype(x.dtype)}, got {got}"
            )
        w_in, w_out, w_conv = self._step_weights()
        proj = x.reshape(N, self.d_model) @ w_in  # [N, 3D + gate + extra]: q, k, v, then the rest
        qkv, rest = proj[:, : 3 * D], proj[:, 3 * D:]
        conv_state = None
        if conv is not None and state_indices is not None:  # the W − 1 inputs: a few KiB per session
            qkv, window = conv.step(qkv, state.conv.index_select(0, state_indices), w_conv)
            conv_state = state.conv.index_copy_(0, state_indices, window)
        elif conv is not None:
            qkv, conv_state = conv.step(qkv, state.conv, w_conv)
        if self.activation is self.value_activation:
            qkv = self.activation(qkv)
        else:
            qkv = torch.cat([self.activation(qkv[:, : 2 * D]), self.value_activation(qkv[:, 2 * D:])], dim=-1)
        qkv = qkv.view(N, 3, H, K)
        gated = modules.get("g_proj") is not None
        o, memory = self.memory_step(qkv[:, :2], qkv[:, 2], rest[:, D:] if gated else rest, memory,
                                     **({} if state_indices is None else {"state_indices": state_indices}))
        o = modules["o_norm"].unit(o.to(x.dtype))  # the norm's weight is folded into w_out
        if gated:
            o = o * F.silu(rest[:, :D].view(N, H, K))
        return (o.reshape(N, D).to(x.dtype) @ w_out).view(N, 1, self.d_model), FastWeightState(memory, conv_state)

    @property
    def fused_step(self) -> bool:
        """Whether :meth:`step` applies: one value head per head and V = K (else decoding
        takes :meth:`forward`'s general path with the recurrent op)."""
        return self.num_v_heads == self.n_heads and self.value_head_dim == self.head_dim

    def _in_weight(self) -> torch.Tensor:
        """The weights of :meth:`step_projections` stacked, ``[2·H·K + HV·V + ..., d_model]``:
        every projection of x as one matmul (see :func:`~fastweights.layers.common.cached_weights`)."""
        modules = self._modules
        params = [modules[n]._parameters["weight"] for n in self.step_projections()]
        return cached_weights(self, "_in_weight_cache", params, lambda: (torch.cat(params),))[0]

    def _step_weights(self) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``(W_inᵀ [d_model, ·], (W_o diag(w))ᵀ [H·K, d_model], conv kernelᵀ [W, ·] or None)`` for
        :meth:`step`: w is the output norm's weight (per head, repeated over the heads)."""
        modules = self._modules
        conv = modules.get("conv")
        n_in = len(self.step_projections())
        params = [modules[n]._parameters["weight"] for n in self.step_projections() + ("o_proj", "o_norm")]
        params += [] if conv is None else [conv._parameters["weight"]]

        def build():
            w_o, w_norm = params[n_in], params[n_in + 1]
            w_conv = None if conv is None else params[-1].t()
            return torch.cat(params[:n_in]).t(), (w_o * w_norm.repeat(self.n_heads)).t(), w_conv

        return cached_weights(self, "_step_weights_cache", params, build)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02, out_std: Optional[float] = None) -> None:
        """Normal(0, std) projections; ``out_std`` for ``o_proj`` (scaled down by depth in a model)."""
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.g_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, std=std)
        nn.init.normal_(self.o_proj.weight, std=std if out_std is None else out_std)


#: flash-linear-attention's layer constructor names -> ours (the same-named ones need no entry).
FLA_NAMES = {"hidden_size": "d_model", "num_heads": "n_heads", "use_gate": "use_output_gate"}


def resolve_fla_names(owner: str, given: dict, **ours):
    """Merge fla's constructor names (``given``) into ours; a value given under both names
    must agree, and any other unknown name is a TypeError naming it. Returns ours, in order."""
    for fla_name, value in given.items():
        if fla_name not in FLA_NAMES:
            known = ", ".join(sorted(FLA_NAMES))
            raise TypeError(f"{owner}: unexpected keyword argument `{fla_name}` (fla's names we accept: {known})")
        our = FLA_NAMES[fla_name]
        default = {"use_output_gate": True}.get(our)
        if ours[our] is not None and ours[our] != default and ours[our] != value:
            raise ValueError(f"{owner}: `{fla_name}`={value!r} contradicts `{our}`={ours[our]!r}; give one of them")
        ours[our] = value
    return tuple(ours.values())


def pool_step_rows(step, pool: torch.Tensor, state_indices: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The pool form of a one-token ``step(h [N, H, K, V]) -> (o, h')`` that takes one state per row:
    the rows' states gathered from ``pool [S, H, K, V]`` at ``state_indices [N]``, stepped and
    written back in place; returns ``(o, pool)``."""
    from ..ops.state_pool import gather_states, scatter_states

    o, h = step(gather_states(pool, state_indices))
    scatter_states(pool, state_indices, h)
    return o, pool


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y (for y > 0)."""
    return y + torch.log(-torch.expm1(-y))


def log_uniform(n: int, low: float, high: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """n samples, log-uniform on [low, high]."""
    u = torch.rand(n, generator=generator)
    return torch.exp(math.log(low) + u * (math.log(high) - math.log(low)))


def write_strength(logits: torch.Tensor, allow_neg_eigval: bool) -> torch.Tensor:
    """β = sigmoid(logits) in (0, 1), or 2·sigmoid in (0, 2) when negative eigenvalues of
    the transition I − β k kᵀ are allowed (Grazzi et al. 2024)."""
    beta = torch.sigmoid(logits)
    return 2 * beta if allow_neg_eigval else beta


__all__ = ["FastWeightMixer", "FLA_NAMES", "resolve_fla_names", "write_strength", "pool_step_rows", "inverse_softplus", "log_uniform"]
