"""A small causal language model whose token mixers are sequence memories.

The whole model in one file. Glossary (code name -> meaning):

- ``B, T``: batch size and number of tokens of this call; ``V``: vocabulary size;
  ``D``: ``d_model``; ``L``: ``n_layers``.
- mixer: the per-layer token mixer, one of :data:`fastweights.layers.MIXERS`
  (``"softmax"``, ``"linear"``, ``"deltanet"``, ``"gated_deltanet"``, ``"kda"``, ``"gdn2"``,
  ``"deltaproduct"``, ``"rwkv7"``).
- cache: :class:`LMCache`, every layer's decode state. A softmax layer's state is
  a KV cache that grows by one row per token; a fast-weight layer's state is a
  fixed ``[B, H, K, V]`` matrix plus W − 1 convolution inputs, whatever the context.

Architecture (pre-norm residual blocks, as in GPT-2/Llama)::

    x = embed(input_ids)                            (B, T, D)
    for each block:
        x = x + mixer(RMSNorm(x))                   token mixing: the memory
        x = x + SwiGLU(RMSNorm(x))                  W_down (silu(W_gate x) ⊙ W_up x)
    logits = lm_head(RMSNorm(x))                    (B, T, V); lm_head tied to embed optionally

Generation prefills the prompt with the chunk form of each op, then decodes one
token at a time from the carried state with the recurrent form (see
:mod:`fastweights.layers`).
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import Config, check_int, is_int
from ..layers import MIXERS, RMSNorm
from ..layers.common import align_rows, check_attention_mask, check_rope_theta, pack_rows, unalign_rows, unpack_rows
from ..ops import check_chunk_option, check_cu_seqlens, checked_cu_seqlens_cpu
from .window import CHUNK_FROM, Segment, WINDOW_WIDTH, cuttable, drop_kv_rows, padded_width, rolled_back, window_nbytes

__all__ = ["LMConfig", "LM", "LMCache", "Block", "SwiGLU"]


def _physical_memory() -> int:
    """Bytes of RAM (2**62 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


@dataclass
class LMConfig(Config):
    """The model's shape and its mixers' options; checked on construction.

    Args:
        vocab_size, d_model, n_layers, n_heads: the sizes (``n_heads`` divides ``d_model``).
        mixer: one of ``"softmax"``, ``"linear"``, ``"deltanet"``, ``"gated_deltanet"``, ``"kda"``
            (Kimi Delta Attention: per-key-channel decays), ``"gdn2"`` (Gated DeltaNet-2),
            ``"deltaproduct"`` (Gated DeltaProduct, ``num_householder`` Householder steps per token),
            ``"rwkv7"`` (RWKV-7's time mixing: token shift, DPLR memory, value residual from the first
            RWKV-7 layer; its own norms, so the options below do not reach it), or a list with one of
            these per layer (a hybrid).
        max_seq_len: the longest input (prompt) one call accepts, for models with a softmax
            layer (its KV cache grows with the context); models without one take any length.
        rope_theta: RoPE base θ of the softmax layers (rotary position embeddings, on by
            default); ``None`` means no positional encoding (NoPE).
        mlp_hidden: the width of the SwiGLU MLP's hidden layer; ``None`` means 8/3·d_model rounded up
            to a multiple of 8; 0 means no MLP at all (attention-only blocks, as in Zoology's MQAR
            models). :attr:`mlp_width` is the width in use (``hidden_size``, its former name, is
            deprecated: transformers' ``hidden_size`` is ``d_model``).
        tie_embeddings: share the input embedding and the output projection.
        use_short_conv, conv_size: the causal depthwise convolution on q, k, v of the
            fast-weight mixers (linear, deltanet, gated_deltanet, kda).
        softmax_short_conv: the same convolution (width ``conv_size``) on the softmax layers'
            q, k, v; off by default, so a softmax layer is plain attention unless asked
            (the MQAR study turns it on to give every mixer the convolution).
        qk_activation, qk_norm, allow_neg_eigval: DeltaNet / Gated DeltaNet / KDA options
            (activation silu/elu/relu/identity; norm l2/sum; β in (0, 2)).
        num_householder: DeltaProduct's n_h, Householder steps per token (default 2).
        use_output_gate: gate the normalized output of the fast-weight mixers.
        feature_map, normalize: linear attention's φ and normalizer.
        chunk_size: C of the chunk ops used for training and prefill; ``None`` (default) lets
            each layer pick it per key size and device (32 on the CPU for head sizes <= 64, else 64).
        norm_eps: RMSNorm epsilon; init_std: std of the normal weight init.
        gradient_checkpointing: in training, keep only each block's input and recompute
            the block in the backward pass (less activation memory, one more forward).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    mixer: Union[str, List[str]] = "deltanet"
    max_seq_len: int = 1024
    rope_theta: Optional[float] = 10000.0
    mlp_hidden: Optional[int] = None
    tie_embeddings: bool = True
    use_short_conv: bool = True
    softmax_short_conv: bool = False
    conv_size: int = 4
    qk_activation: str = "silu"
    qk_norm: str = "l2"
    allow_neg_eigval: bool = False
    num_householder: int = 2
    use_output_gate: bool = True
    feature_map: str = "elu"
    normalize: bool = True
    chunk_size: Optional[int] = None
    norm_eps: float = 1e-6
    init_std: float = 0.02
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "conv_size", "num_householder"):
            check_int("LMConfig", name, getattr(self, name))
        check_chunk_option("LMConfig", self.chunk_size)  # as every layer checks it; None is resolved per call
        for name in ("init_std", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
                    or (name == "norm_eps" and value == 0):
                raise ValueError(f"LMConfig: `{name}` must be a finite number {'>' if name == 'norm_eps' else '>='} 0, "
                                 f"got {value!r}")
        check_int("LMConfig", "mlp_hidden", self.mlp_hidden, minimum=0, none_ok=True, what="a non-negative int (0: no MLP) or None")
        if self.d_model % self.n_heads:
            raise ValueError(f"LMConfig: `d_model`={self.d_model} must be divisible by `n_heads`={self.n_heads}")
        mixers = self.mixers
        if len(mixers) != self.n_layers:
            raise ValueError(f"LMConfig: `mixer` lists {len(mixers)} mixers but `n_layers`={self.n_layers}; give one per layer")
        for i, m in enumerate(mixers):
            if m not in MIXERS:
                where = "" if isinstance(self.mixer, str) else f" at layer {i}"
                raise ValueError(f"LMConfig: unknown `mixer` {m!r}{where}; expected one of {', '.join(MIXERS)}")
        if self.qk_activation not in ("silu", "elu", "elu+1", "relu", "identity"):
            raise ValueError(f"LMConfig: unknown `qk_activation` {self.qk_activation!r}; expected silu, elu, relu or identity")
        if self.qk_norm not in ("l2", "sum"):
            raise ValueError(f"LMConfig: unknown `qk_norm` {self.qk_norm!r}; expected 'l2' or 'sum'")
        if "softmax" in mixers:
            check_rope_theta("LMConfig", self.rope_theta, self.d_model // self.n_heads)
        elif self.rope_theta is not None:
            check_rope_theta("LMConfig", self.rope_theta, 2)  # unused without softmax layers, but still a number
        for name in ("tie_embeddings", "use_short_conv", "softmax_short_conv", "allow_neg_eigval", "use_output_gate",
                     "normalize", "gradient_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LMConfig: `{name}` must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.mixer, tuple):
            self.mixer = list(self.mixer)

    @staticmethod
    def fill_legacy(data: dict) -> dict:
        """A saved config with the fields it predates filled in as the model it was saved from
        had them: no RoPE (``rope_theta=None``; RoPE became the default later) and no
        gradient checkpointing. For checkpoints; a new config gets the dataclass defaults."""
        if not isinstance(data, dict):
            return data
        return {**{k: v for k, v in LEGACY_FIELDS.items() if k not in data}, **data}

    @property
    def mixers(self) -> List[str]:
        """The mixer of each layer (a single name is repeated ``n_layers`` times)."""
        if isinstance(self.mixer, str):
            return [self.mixer] * self.n_layers
        if isinstance(self.mixer, (list, tuple)) and all(isinstance(m, str) for m in self.mixer):
            return list(self.mixer)
        raise TypeError(f"LMConfig: `mixer` must be a name or a list of names, got {self.mixer!r}")

    @property
    def mlp_width(self) -> int:
        """The width of each block's SwiGLU MLP (its hidden layer): ``mlp_hidden``, or 8/3·d_model
        rounded up to a multiple of 8 when that is ``None``; 0 means no MLP."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 8 * math.ceil(8 * self.d_model / 3 / 8)

    @property
    def hidden_size(self) -> int:
        """Deprecated name of :attr:`mlp_width` (transformers' ``hidden_size`` is the model width,
        ``d_model``, as in :class:`fastweights.hf.FastWeightsConfig`)."""
        warnings.warn("`LMConfig.hidden_size` is the MLP width and is now `LMConfig.mlp_width` (transformers' "
                      "`hidden_size` is `d_model`); the old name will be removed", DeprecationWarning, stacklevel=2)
        return self.mlp_width


# LMConfig fields added after checkpoints were first written, with the value a checkpoint
# saved before them was trained with.
LEGACY_FIELDS = {"rope_theta": None, "gradient_checkpointing": False, "num_householder": 2}


def build_mixer(name: str, config: LMConfig, layer: int = 0) -> nn.Module:
    """One token mixer with the options of ``config`` that apply to it (``layer``: its index in the stack)."""
    shared = dict(
        use_short_conv=config.use_short_conv, conv_size=config.conv_size, use_output_gate=config.use_output_gate,
        norm_eps=config.norm_eps, chunk_size=config.chunk_size,
    )
    if name == "softmax":
        return MIXERS[name](config.d_model, config.n_heads, rope_theta=config.rope_theta,
                            use_short_conv=config.softmax_short_conv, conv_size=config.conv_size)
    if name == "linear":
        return MIXERS[name](config.d_model, config.n_heads, feature_map=config.feature_map, normalize=config.normalize, **shared)
    if name == "rwkv7":  # its own token shift and norms; layer_idx 0 (the first RWKV-7 layer) supplies the value residual
        mixers = config.mixers
        return MIXERS[name](config.d_model, config.n_heads, layer_idx=mixers[:layer].count("rwkv7"),
                            num_hidden_layers=mixers.count("rwkv7"), chunk_size=config.chunk_size)
    if name == "deltaproduct":
        shared["num_householder"] = config.num_householder
    return MIXERS[name](
        config.d_model, config.n_heads, activation=config.qk_activation, qk_norm=config.qk_norm,
        allow_neg_eigval=config.allow_neg_eigval, **shared,
    )


class SwiGLU(nn.Module):
    """``W_down (silu(W_gate x) ⊙ W_up x)``: [B, T, D] -> [B, T, D] (Shazeer 2020)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, mixer: str, config: LMConfig, layer: int = 0) -> None:
        super().__init__()
        self.mixer_name = mixer
        self.mixer_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mixer = build_mixer(mixer, config, layer)
        # mlp_hidden = 0: a mixer-only block (no MLP, no MLP norm).
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps) if config.mlp_width else None
        self.mlp = SwiGLU(config.d_model, config.mlp_width) if config.mlp_width else None

    def forward(self, x: torch.Tensor, state=None, cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Optional[int] = None,
                cp_group=None, value_residual: Optional[dict] = None):
        """``value_residual``: the dict one LM call passes through its blocks, for mixers that share
        values across layers (RWKV-7's value residual: the first such layer writes, the others read)."""
        extra = {} if cp_group is None else {"cp_group": cp_group}  # context parallelism (LM.forward)
        extra.update(self._residual(value_residual))
        h, state = self.mixer(self.mixer_norm(x), state, cu_seqlens, max_seqlen=max_seqlen, **extra)  # (B, T, D), new state
        x = x + h
        return (x if self.mlp is None else x + self.mlp(self.mlp_norm(x))), state

    def _residual(self, value_residual: Optional[dict]) -> dict:
        return {"value_residual": value_residual} if getattr(self.mixer, "uses_value_residual", False) else {}

    def step_slots(self, x: torch.Tensor, state, state_indices: torch.Tensor, value_residual: Optional[dict] = None) -> torch.Tensor:
        """:meth:`forward` for one decoding token ``x [N, 1, D]`` of N sessions held in pools
        (``state``: the mixer's pooled state, stepped in place at ``state_indices [N]``;
        :meth:`~fastweights.layers.base.FastWeightMixer.step`): returns x."""
        x = x + self.mixer.step(self.mixer_norm(x), state, state_indices, **self._residual(value_residual))[0]
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))

    def forward_window(self, x: torch.Tensor, state, real: int, chunk_from: int, value_residual: Optional[dict] = None):
        """:meth:`forward` for a verify window (``x [B, P, D]``, the first ``real`` rows tokens):
        ``(x, the state after the real tokens, what the mixer keeps to roll back)``."""
        h, state, keep = self.mixer.forward_window(self.mixer_norm(x), state, real, chunk_from,
                                                   **self._residual(value_residual))
        x = x + h
        return (x if self.mlp is None else x + self.mlp(self.mlp_norm(x))), state, keep


@dataclass
class LMCache:
    """Every layer's decode state, and how many tokens have been read.

    ``states[i]`` is a :class:`~fastweights.ops.KVCache` for a softmax layer (an
    :class:`~fastweights.layers.AttentionState` with ``softmax_short_conv``) and a
    :class:`~fastweights.layers.FastWeightState` otherwise.
    """

    states: list
    length: int = 0
    batch_size: int = 0
    mixers: List[str] = field(default_factory=list)
    #: The open verify window: one :class:`~fastweights.models.window.Segment` per forward since
    #: the last commit (empty: committed). See :mod:`fastweights.models.window`.
    window: list = field(default_factory=list)
    #: Keep a window across forwards (every forward adds a segment) until :meth:`commit`.
    recording: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes held by all layers' states (constant in the context length for the
        fast-weight mixers; linear in it for softmax layers), plus an open window's
        (:attr:`window_nbytes`; 0 once committed)."""
        return sum(s.nbytes for s in self.states) + self.window_nbytes

    @property
    def window_nbytes(self) -> int:
        """Bytes the open window holds on top of the states (0 when committed)."""
        return window_nbytes(self.window)

    @property
    def window_tokens(self) -> int:
        """How many of the last tokens :meth:`rollback` can still remove."""
        return sum(seg.tokens for seg in self.window)

    def commit(self) -> None:
        """Close the window: the tokens read so far stay, and the window's memory is freed."""
        self.window = []

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens read (0 <= n <= :attr:`window_tokens`), in place.

        The cache becomes exactly the cache of a window of the tokens before them
        (:mod:`fastweights.models.window`: bitwise, for windows of up to ``LM.window_width``
        tokens); the window stays open for a further rollback. A bad ``n`` raises a
        ValueError/TypeError and leaves the cache as it was.
        """
        check_int("LMCache.rollback", "n", n, minimum=0, error=TypeError if not is_int(n) else ValueError,
                  what="an int >= 0 (tokens to remove)")
        if n == 0:
            return
        if not self.window:
            if cuttable(self.states) and n <= int(min(s.lengths.min() for s in self.states)):
                self.states = [drop_kv_rows(s, n) for s in self.states]
                self.length -= n
                return
            raise ValueError(
                f"LMCache.rollback: cannot remove `n`={n} token(s): the cache has no open window (it was committed "
                f"by a forward or commit(), or never read a multi-token forward). Only the tokens of the last "
                f"multi-token forward can be removed, before the cache is read again"
            )
        if n > self.window_tokens:
            raise ValueError(
                f"LMCache.rollback: `n`={n} is more than the {self.window_tokens} token(s) of the open window; "
                f"expected 0 <= n <= {self.window_tokens}"
            )
        states, window = rolled_back(self.states, self.window, n)
        self.states, self.window, self.length = states, window, self.length - n


class LM(nn.Module):
    """The causal LM of :class:`LMConfig`.
    ``model(input_ids, cache=None, *, attention_mask=None, cu_seqlens=None) -> (logits, cache)``.

    Example::

        >>> model = LM(LMConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, mixer="deltanet"))
        >>> logits, cache = model(torch.randint(0, 256, (2, 10)))
        >>> logits.shape, cache.length
        (torch.Size([2, 10, 256]), 10)
        >>> out = model.generate(torch.randint(0, 256, (1, 5)), max_new_tokens=20)   # (1, 25)
    """

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        if not isinstance(config, LMConfig):
            raise TypeError(f"LM: `config` must be an LMConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(m, config, i) for i, m in enumerate(config.mixers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.gradient_checkpointing = config.gradient_checkpointing  # may be switched on a built model
        # Verify windows (fastweights.models.window): rows a window is padded to a multiple of,
        # and the padded width from which its memory runs the chunk form.
        self.window_width = WINDOW_WIDTH
        self.window_chunk_from = CHUNK_FROM
        self.reset_parameters()
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2L) (GPT-2)."""
        std = self.config.init_std
        out_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for block in self.blocks:
            block.mixer.reset_parameters(std, out_std)
            for lin, s in (() if block.mlp is None else ((block.mlp.gate, std), (block.mlp.up, std),
                                                          (block.mlp.down, out_std))):
                nn.init.normal_(lin.weight, std=s)
            for extra in ("b_proj", "a_proj"):
                if hasattr(block.mixer, extra):
                    nn.init.normal_(getattr(block.mixer, extra).weight, std=std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied weight is counted once

    def _check_ids(self, input_ids, name: str = "input_ids") -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
            what = input_ids.dtype if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise TypeError(f"LM: `{name}` must be an int64 tensor of shape [B, T], got {what}")
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"LM: `{name}` must have shape [B, T] with T >= 1, got {list(input_ids.shape)}")
        if torch.compiler.is_compiling():  # reading the ids' values would break the graph (a device sync too)
            return
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"LM: `{name}` holds token ids in [{int(input_ids.min())}, {int(input_ids.max())}], "
                f"outside the vocabulary [0, {self.config.vocab_size})"
            )

    @property
    def has_softmax(self) -> bool:
        """Whether a layer keeps a growing KV cache (only then does ``max_seq_len`` cap an input)."""
        return "softmax" in self.config.mixers

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Optional[LMCache] = None,
        *,
        attention_mask: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        max_seqlen: Optional[int] = None,
        return_cache: bool = True,
        keep_window: Optional[bool] = None,
        cp_group=None,
    ) -> Tuple[torch.Tensor, Optional[LMCache]]:
        """``input_ids (B, T)`` -> ``(logits (B, T, V), cache)``.

        Args:
            input_ids: ``(B, T)`` token ids.
            cache: the :class:`LMCache` of a previous call; the T tokens continue those
                sequences (T = 1 is one decoding step through the recurrent ops).
            attention_mask: ``(B, T)`` with 1 for a real token and 0 for padding (e.g.
                left-padded prompts), or ``(B, L + T)`` with L = ``cache.length``, the mask
                of every token so far as transformers passes it (only its last T columns
                are read: the cache remembers the rest). Each row's logits are what that
                row alone gives: pads are never read by any layer, fast-weight memories
                included (they are run as packed sequences). Logits at pads are 0.
            cu_seqlens: ``(N + 1)`` int64 offsets of N sequences packed along T (B = 1), as
                in FlashAttention: packed training without padding. Each sequence starts
                from an empty state (or from its row of ``cache``, which then holds N);
                the returned cache holds the N sequences.
            max_seqlen: with ``cu_seqlens``, the longest sequence's length (an int >= it), as in
                FlashAttention's varlen API; without it the offsets are read once here (under
                ``torch.compile``: one graph break).
            return_cache: ``False`` (training) skips building the cache.
            keep_window: whether the returned cache can roll back this call's tokens
                (:meth:`LMCache.rollback`; :mod:`fastweights.models.window`). ``None`` (default):
                yes for T > 1 tokens read from a cache (a verify forward), and for every call
                on a recording cache. ``True`` also takes the window form for T = 1 (the
                reference a rollback to one token equals bitwise). Needs a cache, no
                ``cu_seqlens`` and no padding among the T tokens. The cache read is committed
                first unless it is recording.
            cp_group: context parallelism: a ``torch.distributed.ProcessGroup`` whose ranks each
                hold one contiguous slice of the sequence, in rank order: ``input_ids (B, L)`` is
                this rank's slice (L the same on every rank), ``cu_seqlens`` the *global* offsets
                (the same on every rank; sequences may cross ranks). The logits are the slice's
                ``(B, L, V)``, equal to those rows of a single-process call; gradients too, once
                each rank's parameter gradients are summed over the group (each rank's loss
                covers its own tokens). Fast-weight layers exchange fixed-size state summaries
                and their convolutions a halo; softmax layers all-gather keys and values
                (:mod:`fastweights.ops.context_parallel`). Training only: ``cache`` and
                ``attention_mask`` are refused and ``return_cache`` must be False.

        Under ``torch.compile`` with ``return_cache=False``, ``attention_mask`` moves each row's
        real tokens to its front instead of packing them (:func:`~fastweights.layers.common.align_rows`:
        static shapes, no graph break); the logits are the packed run's up to rounding.
        """
        if cp_group is not None:
            return self._forward_context_parallel(input_ids, cache, attention_mask, cu_seqlens, return_cache, cp_group)
        self._check_ids(input_ids)
        B, T = input_ids.shape
        if self.has_softmax and T > self.config.max_seq_len:
            raise ValueError(f"LM: `input_ids` has {T} tokens, more than `max_seq_len`={self.config.max_seq_len} of this model")
        n_seq = B
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("LM: give `cu_seqlens` (packed rows) or `attention_mask` (padded rows), not both")
            # checked once here (one host read); every layer's op finds the offsets checked
            n_seq = check_cu_seqlens("LM", cu_seqlens, B, T, input_ids.device, max_seqlen=max_seqlen)
            if max_seqlen is None:  # from the checked host copy, not read again by every layer's op
                host = None if torch.compiler.is_compiling() else checked_cu_seqlens_cpu(cu_seqlens)
                offsets = cu_seqlens if host is None else host
                max_seqlen = int((offsets[1:] - offsets[:-1]).max())
        elif max_seqlen is not None:
            raise ValueError(f"LM: `max_seqlen`={max_seqlen!r} describes packed sequences and needs `cu_seqlens`")
        if cache is not None:
            if not isinstance(cache, LMCache):
                raise TypeError(f"LM: `cache` must be an LMCache returned by this model, got {type(cache).__name__}")
            if len(cache.states) != len(self.blocks) or cache.mixers != self.config.mixers:
                raise ValueError(f"LM: `cache` was made by a model with mixers {cache.mixers}, this one has {self.config.mixers}")
            if cache.batch_size != n_seq:
                what = f"{n_seq} packed sequences" if cu_seqlens is not None else f"batch size {B}"
                raise ValueError(f"LM: `cache` holds {cache.batch_size} sequences but `input_ids` has {what}")
        mask = self._mask(attention_mask, B, T, cache)
        window = self._window_mode(keep_window, cache, T, cu_seqlens, mask, return_cache)
        if cache is not None and cache.window and not cache.recording:
            cache.commit()  # read by this forward: its window closes
        if window == "window":
            return self._forward_window(input_ids, cache)
        ids, slot = input_ids, None
        if mask is not None and not return_cache and torch.compiler.is_compiling():
            slot = align_rows(mask)  # real tokens first in each row: packing's outputs, static shapes
            ids = input_ids.scatter(1, slot, input_ids)
        elif mask is not None:  # run the real tokens only, each row as one packed sequence
            ids, cu_seqlens = pack_rows(input_ids, mask)
            max_seqlen = int(mask.sum(dim=1).max())
        x = self.embed(ids)  # (B, T, D)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        states, shared = [], {}  # shared: values one layer hands to later ones (RWKV-7's value residual)
        for i, block in enumerate(self.blocks):
            state = None if cache is None else cache.states[i]
            if recompute:  # keep x only; the block runs again in the backward pass
                x, state = torch.utils.checkpoint.checkpoint(block, x, state, cu_seqlens, max_seqlen, None, shared,
                                                             use_reentrant=False)
            else:
                x, state = block(x, state, cu_seqlens, max_seqlen, None, shared)
            states.append(state)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        if slot is not None:
            logits = unalign_rows(logits, slot, mask)
        elif mask is not None:
            logits = unpack_rows(logits, mask)
        if not return_cache:
            return logits, None
        length = T + (0 if cache is None else cache.length)
        new = LMCache(states, length=length, batch_size=n_seq, mixers=list(self.config.mixers))
        if cache is not None and cache.recording:
            new.recording = True
            new.window = cache.window + ([self._segment(cache.states, T, None)] if window == "step" else [])
        return logits, new

    def step_slots(self, tokens: torch.Tensor, states: list, state_indices: torch.Tensor) -> torch.Tensor:
        """One decoding token for N sessions whose states sit in per-layer pools, in place.

        Args:
            tokens: ``[N]`` token ids, one per session.
            states: one :class:`~fastweights.layers.FastWeightState` of pools per layer (memory
                ``[S, H, K, V]``, convolution ``[S, W − 1, C]`` or None), as
                :class:`~fastweights.models.pool.SessionPool` holds them.
            state_indices: ``[N]`` int64, the sessions' slots: distinct, in ``[0, S)`` (checked by
                the caller; fast-weight mixers with the fused step only).

        Returns:
            logits ``[N, vocab]``; each session's state advanced at its slot. Equal to
            :meth:`forward` of the token with those sessions' states as an N-row cache (the
            same step arithmetic; no state is gathered or copied back).
        """
        x = self.embed(tokens.view(-1, 1))  # [N, 1, D]
        shared = {}
        for block, state in zip(self.blocks, states):
            x = block.step_slots(x, state, state_indices, shared)
        return self.lm_head(self.norm(x))[:, -1]

    def _window_mode(self, keep_window, cache, T: int, cu_seqlens, mask, return_cache: bool) -> Optional[str]:
        """``"window"`` (the padded window form, :meth:`_forward_window`), ``"step"`` (a one-token step
        kept as a segment of a recording cache's window) or ``None`` (no window)."""
        if keep_window is not None and not isinstance(keep_window, bool):
            raise TypeError(f"LM: `keep_window` must be true, false or None, got {keep_window!r}")
        if keep_window is False:
            if cache is not None and cache.recording:
                raise ValueError("LM: `keep_window`=False on a recording cache; commit() it first (or stop recording)")
            return None
        possible = cache is not None and cu_seqlens is None and mask is None and return_cache
        if keep_window and not possible:
            why = ("no `cache` (a window rolls back to one)" if cache is None else
                   "`cu_seqlens`" if cu_seqlens is not None else "padding in `attention_mask`" if mask is not None
                   else "`return_cache`=False")
            raise ValueError(f"LM: `keep_window`=True needs a cache to read, all T tokens real and a returned cache; got {why}")
        if not possible:
            if cache is not None and cache.recording:
                raise ValueError("LM: a recording cache can only read real tokens without `cu_seqlens` (a window)")
            return None
        if keep_window or T > 1:
            return "window"
        return "step" if cache.recording else None

    def _segment(self, before: list, tokens: int, keeps) -> Segment:
        return Segment(before, tokens, keeps, self, self.window_width, self.window_chunk_from)

    def _forward_window(self, input_ids: torch.Tensor, cache: LMCache) -> Tuple[torch.Tensor, LMCache]:
        """A verify window: the T tokens padded to P rows (:mod:`fastweights.models.window`)."""
        B, T = input_ids.shape
        P = padded_width(T, self.window_width)
        ids = torch.cat([input_ids, input_ids.new_zeros(B, P - T)], dim=1) if P > T else input_ids
        x = self.embed(ids)  # (B, P, D)
        states, keeps, shared = [], [], {}
        for block, state in zip(self.blocks, cache.states):
            x, state, keep = block.forward_window(x, state, T, self.window_chunk_from, shared)
            states.append(state)
            keeps.append(keep)
        logits = self.lm_head(self.norm(x[:, :T]))  # (B, T, V)
        segment = self._segment(cache.states, T, keeps)
        window = (cache.window if cache.recording else []) + [segment]
        return logits, LMCache(states, length=cache.length + T, batch_size=B, mixers=list(self.config.mixers),
                               window=window, recording=cache.recording)

    def _forward_context_parallel(self, input_ids, cache, attention_mask, cu_seqlens, return_cache, cp_group):
        """:meth:`forward` on this rank's slice of a sequence split over ``cp_group`` -> ``(logits, None)``."""
        from ..ops.context_parallel import agree_on_slice, check_cp_group

        _, world = check_cp_group("LM", cp_group)

        def local() -> None:
            self._check_ids(input_ids)
            if cache is not None or attention_mask is not None:
                which = "cache" if cache is not None else "attention_mask"
                raise ValueError(f"LM: `{which}` cannot be given with `cp_group` (context parallelism trains on "
                                 f"slices of sequences; pack padded rows with `cu_seqlens`)")
            if return_cache:
                raise ValueError("LM: `return_cache` must be False with `cp_group` (no decode cache is built "
                                 "from slices of a sequence)")
            total = world * input_ids.shape[1]
            if self.has_softmax and total > self.config.max_seq_len:
                raise ValueError(f"LM: `input_ids` holds {total} tokens over the {world} ranks of `cp_group`, "
                                 f"more than `max_seq_len`={self.config.max_seq_len} of this model")

        agree_on_slice("LM", cp_group, "input_ids", input_ids, cu_seqlens, local)
        x = self.embed(input_ids)  # (B, L, D)
        recompute = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        shared = {}
        for block in self.blocks:
            if recompute:  # the recomputation repeats the block's collectives, in the same order on every rank
                x, _ = torch.utils.checkpoint.checkpoint(block, x, None, cu_seqlens, None, cp_group, shared,
                                                         use_reentrant=False)
            else:
                x, _ = block(x, None, cu_seqlens, None, cp_group, shared)
        return self.lm_head(self.norm(x)), None

    @staticmethod
    def _mask(attention_mask, batch: int, length: int, cache: Optional[LMCache]) -> Optional[torch.Tensor]:
        """The checked bool mask of this call's T tokens, or None when all are real."""
        if attention_mask is None:
            return None
        past = 0 if cache is None else cache.length
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and attention_mask.shape[0] == batch:
            if past and attention_mask.shape[1] == past + length:
                attention_mask = attention_mask[:, past:]
            elif attention_mask.shape[1] != length:
                also = f" or [B, L + T] = [{batch}, {past + length}]" if past else ""
                raise ValueError(
                    f"LM: `attention_mask` must have shape [B, T] = [{batch}, {length}]{also}, got {list(attention_mask.shape)}"
                )
        return check_attention_mask("LM", attention_mask, batch, length)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        return_cache: bool = False,
        attention_mask: Optional[torch.Tensor] = None,
        prompt_lookup: Optional[int] = None,
        draft: Optional["LM"] = None,
    ):
        """Continue each prompt by ``max_new_tokens`` sampled tokens.

        Prefills the prompt once (chunk ops), then feeds one token at a time with the
        cache (recurrent ops): memory per step is the cache, constant for fast-weight
        mixers.

        Args:
            input_ids: ``(B, T)`` or ``(T,)`` prompt token ids (T <= ``max_seq_len`` when the
                model has a softmax layer).
            max_new_tokens: how many tokens to add (>= 0).
            temperature: softmax temperature; 0 means greedy (argmax).
            top_k: sample only among the k most likely tokens.
            generator: a ``torch.Generator`` for reproducible sampling.
            return_cache: also return the :class:`LMCache` (it has read every token but the last).
            attention_mask: ``(B, T)``, 0 at the pads of left-padded prompts: each row then
                continues exactly as it would alone.
            prompt_lookup: k: greedy speculative decoding, proposing up to k tokens per round by
                prompt lookup (:mod:`fastweights.models.speculative`); needs ``temperature=0``
                and one prompt. The tokens are greedy decoding's.
            draft: a smaller LM of the same vocabulary proposing 4 tokens per round (as above).

        Returns:
            ``(B, T + max_new_tokens)`` token ids (``(T + max_new_tokens,)`` for a 1-D
            prompt), and the cache if ``return_cache``.
        """
        squeeze = isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1
        if squeeze:
            input_ids = input_ids[None]
        self._check_ids(input_ids, "prompt")
        if self.has_softmax and input_ids.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"LM.generate: the prompt has {input_ids.shape[1]} tokens, more than the model allows "
                f"(`max_seq_len`={self.config.max_seq_len}); shorten it"
            )
        check_int("LM.generate", "max_new_tokens", max_new_tokens, minimum=0)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
                or temperature < 0:
            raise ValueError(f"LM.generate: `temperature` must be a finite number >= 0 (0: greedy), got {temperature!r}")
        need = input_ids.shape[0] * (input_ids.shape[1] + max_new_tokens) * input_ids.element_size()
        if need > _physical_memory():
            raise ValueError(f"LM.generate: `max_new_tokens`={max_new_tokens} needs {need:.3g} bytes for the token ids "
                             f"alone, more than this machine's {_physical_memory():.3g} bytes of memory")
        if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
            raise ValueError(f"LM.generate: `top_k` must be a positive int or None, got {top_k!r}")
        if attention_mask is not None and attention_mask.dim() == 1 and squeeze:
            attention_mask = attention_mask[None]
        if prompt_lookup is not None or draft is not None:
            from .speculative import speculative_generate

            if temperature != 0:
                raise ValueError(f"LM.generate: speculative decoding (`prompt_lookup`/`draft`) is greedy; "
                                 f"pass `temperature`=0, got {temperature!r}")
            if attention_mask is not None and not bool(attention_mask.bool().all()):
                raise ValueError("LM.generate: speculative decoding takes one unpadded prompt; `attention_mask` has pads")
            ids, cache, _ = speculative_generate(self, input_ids, max_new_tokens, prompt_lookup=prompt_lookup, draft=draft)
            ids = ids[0] if squeeze else ids
            return (ids, cache) if return_cache else ids
        logits, cache = self(input_ids, attention_mask=attention_mask)  # prefill: chunk form
        t0 = input_ids.shape[1]
        ids = input_ids.new_empty(input_ids.shape[0], t0 + max_new_tokens)  # written in place, one column a step
        ids[:, :t0] = input_ids
        for i in range(max_new_tokens):
            token = self._sample(logits[:, -1], temperature, top_k, generator)  # (B, 1)
            ids[:, t0 + i: t0 + i + 1] = token
            if i + 1 < max_new_tokens:
                logits, cache = self(token, cache)  # one step: each layer's fused decoding step
        ids = ids[0] if squeeze else ids
        return (ids, cache) if return_cache else ids

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_k: Optional[int], generator) -> torch.Tensor:
        """``logits (B, V)`` -> next token ids ``(B, 1)``."""
        if temperature == 0:
            return logits.argmax(-1, keepdim=True)
        logits = logits.float() / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=generator)
