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
form; decoding one token from a carried state uses the recurrent form, both from
:mod:`fastweights.ops` (a layer never re-implements a recurrence).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn as nn
from .common import (
    FastWeightState, GatedRMSNorm, ShortConvolution, check_layer_input, forward_with_mask, get_activation,
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
        chunk_size: C of the chunk form used for prefill and training.
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
        chunk_size: int = 64,
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
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
        initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], recurrent: bool,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Run the op: ``q, k [B, T, H, K]``, ``v [B, T, H, V]``, the layer input ``x`` (for
        β or g) -> ``(o [B, T, H, V], final state [N, H, K, V])``."""
        raise NotImplementedError

    # -- the shared skeleton ------------------------------------------------------------------
    def forward(
        self,
        x: torch.Tensor,
        state: Optional[FastWeightState] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
    ) -> Tuple[torch.Tensor, FastWeightState]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model], state)``.

        ``state`` is the :class:`FastWeightState` returned by the previous call (N = B,
        or the number of sequences in ``cu_seqlens``). A call with T = 1 and a state
        is one decoding step and uses the recurrent op; anything else uses the chunk op.
        ``attention_mask [B, T]`` (0 = padding, e.g. a left-padded batch) runs the real
        tokens only: a pad neither writes to nor decays the memory, nor enters the
        convolution, and its output is 0.
        """
        name = type(self).__name__
        mask = check_layer_input(name, x, self.d_model, cu_seqlens, attention_mask)
        if state is not None and not isinstance(state, FastWeightState):
            raise TypeError(f"{name}: `state` must be a FastWeightState (as returned by this layer), got {type(state).__name__}")
        if mask is not None:
            return forward_with_mask(self, x, state, mask)
        B, T, _ = x.shape
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [B, T, 3·d_model]
        conv_state = None
        if self.conv is not None:
            qkv, conv_state = self.conv(qkv, None if state is None else state.conv, cu_seqlens)
        elif state is not None and state.conv is not None:
            raise ValueError(f"{name}: `state` carries a convolution state but this layer has no short convolution")
        q, k, v = qkv.split([self.key_width, self.key_width, self.value_width], dim=-1)
        q, k = (t.reshape(B, T, self.n_heads, self.head_dim) for t in (q, k))
        v = v.reshape(B, T, self.num_v_heads, self.value_head_dim)
        q, k, v = self.activation(q), self.activation(k), self.value_activation(v)
        recurrent = state is not None and T == 1
        o, memory = self.memory(q, k, v, x, None if state is None else state.memory, cu_seqlens, recurrent)
        gate = None if self.g_proj is None else self.g_proj(x).reshape(B, T, self.num_v_heads, self.value_head_dim)
        o = self.o_norm(o, gate)
        return self.o_proj(o.reshape(B, T, self.value_width)), FastWeightState(memory, conv_state)

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


__all__ = ["FastWeightMixer", "FLA_NAMES", "resolve_fla_names", "write_strength", "inverse_softplus", "log_uniform"]
