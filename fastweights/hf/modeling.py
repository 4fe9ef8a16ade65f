"""The fastweights LM as a transformers model: config, causal LM, cache.

Glossary (code name -> meaning):

- :class:`FastWeightsConfig`: a ``PretrainedConfig`` whose fields are exactly
  :class:`~fastweights.models.LMConfig`'s (generated from it, so the two cannot drift),
  ``model_type = "fastweights"``.
- :class:`FastWeightsForCausalLM`: ``PreTrainedModel`` + ``GenerationMixin`` around one
  :class:`~fastweights.models.LM` (``self.model``); state-dict keys are ``model.<LM key>``.
- :class:`FastWeightsCache`: a transformers ``Cache`` holding the LM's
  :class:`~fastweights.models.lm.LMCache`: per layer the fast-weight state ``[B, H, K, V]``
  and convolution state, or a softmax layer's KV rows.

Shapes: ``input_ids``/``attention_mask``/``labels`` ``[B, T]``; logits ``[B, T, vocab]``.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import List, Optional

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..config import is_int
from ..layers import AttentionState, FastWeightState
from ..models import LM, LMConfig
from ..models.lm import LMCache
from ..ops import KVCache

__all__ = ["FastWeightsConfig", "FastWeightsForCausalLM", "FastWeightsCache", "MODEL_TYPE", "WeightsMismatchError",
           "load_pretrained"]

MODEL_TYPE = "fastweights"

# Defaults for LMConfig's required fields (a transformers config must be constructible
# with no arguments): a tiny byte-level model.
_REQUIRED_DEFAULTS = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4}


def _config_namespace() -> dict:
    """Class body of :class:`FastWeightsConfig`: one annotated field per LMConfig field."""
    hints = typing.get_type_hints(LMConfig)
    ns: dict = {"__annotations__": {}}
    for f in dataclasses.fields(LMConfig):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = dataclasses.field(default_factory=f.default_factory)  # type: ignore[misc]
        else:
            default = _REQUIRED_DEFAULTS[f.name]
        ns["__annotations__"][f.name] = hints[f.name]
        ns[f.name] = default
    ns["__annotations__"]["tie_word_embeddings"] = bool
    ns["tie_word_embeddings"] = True
    return ns


class _FastWeightsConfigBase:
    """Methods of :class:`FastWeightsConfig` (its fields come from :class:`LMConfig`)."""

    model_type = MODEL_TYPE
    # transformers' generic names for the sizes, read by its utilities
    attribute_map = {
        "hidden_size": "d_model", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
        "max_position_embeddings": "max_seq_len",
    }

    def __post_init__(self, **kwargs):
        # One switch for tying: transformers reads tie_word_embeddings, the LM tie_embeddings.
        if "tie_word_embeddings" in kwargs:
            self.tie_embeddings = bool(kwargs.pop("tie_word_embeddings"))
        self.tie_word_embeddings = self.tie_embeddings
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        """Called by transformers' config validation: LMConfig's checks, with its messages."""
        super().validate_architecture()
        self.to_lm_config()

    def to_lm_config(self) -> LMConfig:
        """The :class:`LMConfig` these fields describe (validated)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(LMConfig)}
        return LMConfig.from_dict(values, source="FastWeightsConfig")

    @classmethod
    def from_lm_config(cls, config: LMConfig, **kwargs) -> "FastWeightsConfig":
        """The transformers config of an :class:`LMConfig` (``kwargs``: extra transformers
        fields such as ``bos_token_id``)."""
        return cls(**config.to_dict(), **kwargs)


FastWeightsConfig = type("FastWeightsConfig", (_FastWeightsConfigBase, PretrainedConfig), {
    **_config_namespace(),
    "__module__": __name__,
    "__doc__": """transformers config of :class:`FastWeightsForCausalLM`: the fields of
    :class:`~fastweights.models.LMConfig` (same names, defaults and checks), plus
    transformers' own (``bos_token_id``, ``use_cache``, ...). ``tie_word_embeddings``
    mirrors ``tie_embeddings``.

    Example::

        >>> cfg = FastWeightsConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4,
        ...                         mixer=["deltanet", "softmax"])
        >>> cfg.to_lm_config().mixers
        ['deltanet', 'softmax']
    """,
})


class WeightsMismatchError(ValueError):
    """A transformers folder whose weights do not match its config: tensors missing or unexpected."""


def _names(keys, most: int = 4) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:most]) + (f" and {len(keys) - most} more" if len(keys) > most else "")


def check_loading_info(info: dict, source) -> None:
    """Refuse a load that left tensors missing or unused (``info``: transformers' loading info)."""
    problems = []
    missing, unexpected = info.get("missing_keys") or (), info.get("unexpected_keys") or ()
    mismatched = [k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys") or ()]
    if missing:
        problems.append(f"{len(missing)} tensor(s) the config needs are missing from the weights: {_names(missing)} "
                        f"(a config with more layers, or an untied head, than the weights were saved with?)")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s) the model has no place for: {_names(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} tensor(s) of the wrong shape: {_names(mismatched)}")
    if problems:
        raise WeightsMismatchError(f"FastWeightsForCausalLM.from_pretrained({str(source)!r}): " + "; ".join(problems)
                                   + "; refusing to fill them with uninitialised memory")


def load_pretrained(folder) -> "FastWeightsForCausalLM":
    """:meth:`FastWeightsForCausalLM.from_pretrained` of a local folder, every failure a one-line
    ``ValueError`` naming the file (a missing, truncated or garbled weights file, a bad config)."""
    import os

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"{folder!r} is not a folder (expected a transformers folder written by save_pretrained)")
    try:
        return FastWeightsForCausalLM.from_pretrained(folder, local_files_only=True)
    except ValueError:
        raise
    except Exception as e:  # safetensors' and transformers' own error types for unreadable files
        text = " ".join(str(e).split()) or type(e).__name__
        weights = os.path.join(folder, "model.safetensors")
        what = weights if os.path.isfile(weights) else folder
        raise ValueError(f"cannot load {what}: {text} (a truncated or corrupt file?)") from None


class FastWeightsCache(Cache):
    """transformers ``Cache`` around the LM's :class:`~fastweights.models.lm.LMCache`.

    Per layer: a :class:`~fastweights.layers.FastWeightState` (fast-weight memory
    ``[B, H, K, V]`` and convolution state ``[B, W − 1, C]``) or a softmax layer's
    :class:`~fastweights.ops.KVCache` (rows ``[B, H, L, ·]`` and per-row lengths).
    ``reorder_cache`` (beam search) and the batch selections work for every mixer.
    ``crop(-n)`` removes the last n tokens of the open verify window, for every mixer
    (:mod:`fastweights.models.window`): so transformers' assisted generation and prompt
    lookup run on every fastweights model. ``activate_past_recording`` (called by
    transformers for assisted generation) makes every forward part of the window until the
    next ``crop``, which rolls back and then commits.
    """

    is_compileable = False

    def __init__(self, mixers: List[str], lm_cache: Optional[LMCache] = None) -> None:
        super().__init__(layers=[])
        self.mixers = list(mixers)
        self.lm_cache = lm_cache
        self.record_past = False
        self.recurrent_states_to_keep = 0  # transformers 5.25+: the rollback window it asked for

    @property
    def is_croppable(self) -> bool:
        """transformers' check before assisted decoding: every layer can roll back a window."""
        return True

    def activate_past_recording(self, recurrent_states_to_keep: Optional[int] = None) -> None:
        """Keep every forward in the window (one-token steps too) until the next :meth:`crop`.

        ``recurrent_states_to_keep`` is how many past steps transformers (5.25 and later) may roll
        back; this cache keeps the whole window until :meth:`crop`, so any count is served. It is
        recorded for :meth:`get_recurrent_states_to_keep`."""
        self.record_past = True
        if recurrent_states_to_keep is not None:
            self.recurrent_states_to_keep = max(int(recurrent_states_to_keep), self.recurrent_states_to_keep)
        if self.lm_cache is not None:
            self.lm_cache.recording = True

    def get_recurrent_states_to_keep(self, layer_idx: Optional[int] = None) -> int:
        """How many past steps a rollback may undo (transformers' cache API): 0 unless recording."""
        return self.recurrent_states_to_keep if self.record_past else 0

    def __len__(self) -> int:
        return len(self.mixers)

    def __repr__(self) -> str:
        return f"FastWeightsCache(mixers={self.mixers}, length={self.get_seq_length()})"

    @property
    def is_linear(self) -> List[bool]:
        # transformers reads this to decide whether a cache knows how many tokens it read (it then
        # feeds only the tokens after them, as for a KV cache). Ours counts every layer's tokens
        # (get_seq_length), fast-weight layers included, so no layer is "linear" in that sense.
        return [False] * len(self.mixers)

    @property
    def is_sliding(self) -> List[bool]:
        return [False] * len(self.mixers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.lm_cache is None else self.lm_cache.length

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        self.lm_cache = None

    def _map_rows(self, pick) -> None:
        """Apply ``pick`` (a function of a ``[B, ...]`` tensor) to every state's batch rows."""
        if self.lm_cache is None:
            return
        self.lm_cache.commit()  # a window's rows would not follow the selection
        states = []
        for s in self.lm_cache.states:
            if isinstance(s, KVCache):
                states.append(KVCache(pick(s.keys), pick(s.values), pick(s.lengths)))
            elif isinstance(s, AttentionState):  # softmax with a short convolution
                states.append(AttentionState(KVCache(pick(s.kv.keys), pick(s.kv.values), pick(s.kv.lengths)), pick(s.conv)))
            elif isinstance(s, FastWeightState):
                states.append(FastWeightState(pick(s.memory), None if s.conv is None else pick(s.conv)))
            else:
                raise TypeError(f"FastWeightsCache: unexpected layer state {type(s).__name__}")
        batch = states[0].lengths.shape[0] if isinstance(states[0], (KVCache, AttentionState)) else states[0].memory.shape[0]
        self.lm_cache = dataclasses.replace(self.lm_cache, states=states, batch_size=batch)

    def fork(self, n: int = 1, dtype: Optional[torch.dtype] = None) -> "FastWeightsCache":
        """A new cache of ``n`` sessions continuing from this one's (a prefix read once, one sequence):
        :func:`~fastweights.models.prefix.fork_cache` of a :func:`~fastweights.models.prefix.store_prefix`
        copy (``dtype=torch.bfloat16``: the fast-weight memories rounded once, docs/serving.md). Pass it
        as ``generate(prompt + turn, cache=prefix.fork())``: only the turn's tokens are read."""
        from ..models.prefix import fork_cache, store_prefix

        if self.lm_cache is None:
            raise ValueError("FastWeightsCache.fork: the cache is empty; run the prefix through the model first")
        stored = store_prefix(self.lm_cache, dtype)
        state_dtype = next((s.memory.dtype for s in self.lm_cache.states if hasattr(s, "memory")), torch.float32)
        return FastWeightsCache(self.mixers, fork_cache(stored, n, state_dtype=state_dtype))

    def commit(self) -> None:
        """Close the open window (:meth:`~fastweights.models.lm.LMCache.commit`)."""
        if self.lm_cache is not None:
            self.lm_cache.commit()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b of the new cache is row ``beam_idx[b]`` of the old one."""
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' rollback: ``crop(-n)`` forgets the last n tokens read (n at most the open
        window's), then commits the window; ``crop(0)`` only commits. A positive value (the
        legacy "keep this many tokens") is refused, as transformers' own caches refuse it.
        A bad value raises naming ``tokens_to_remove`` and leaves the cache as it was."""
        if not is_int(tokens_to_remove):
            raise TypeError(f"FastWeightsCache.crop: `tokens_to_remove` must be an int <= 0, got {tokens_to_remove!r}")
        if tokens_to_remove > 0:
            raise ValueError(
                f"FastWeightsCache.crop: `tokens_to_remove` must be <= 0 (crop(-n) removes the last n tokens, as "
                f"transformers' caches take it), got {tokens_to_remove}"
            )
        if self.lm_cache is None:
            if tokens_to_remove:
                raise ValueError(f"FastWeightsCache.crop: the cache is empty; cannot remove {-tokens_to_remove} token(s)")
            return
        try:
            self.lm_cache.rollback(-tokens_to_remove)
        except ValueError as err:
            raise ValueError(f"FastWeightsCache.crop(`tokens_to_remove`={tokens_to_remove}): {err}") from None
        self.lm_cache.commit()


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """Next-token cross entropy: logits at t predict ``labels`` at t + 1; label −100 is ignored.

    With ``num_items_in_batch`` (passed by ``Trainer`` under gradient accumulation) the
    sum is divided by it, so accumulated steps average over all tokens.
    """
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[:, 1:].reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
    return total / torch.as_tensor(num_items_in_batch, device=total.device, dtype=total.dtype)


class FastWeightsForCausalLM(PreTrainedModel, GenerationMixin):
    """The fastweights :class:`~fastweights.models.LM` as a transformers causal LM.

    ``forward(input_ids, attention_mask=None, cache=None, use_cache=None, labels=None)``
    returns ``CausalLMOutputWithPast(loss, logits, cache)``. ``attention_mask`` (1 = token,
    0 = pad; left padding for generation) is honoured by every mixer: each row gives what
    it gives alone. ``generate``, ``Trainer``, ``save_pretrained``/``from_pretrained``
    (safetensors, tied embeddings) and ``gradient_checkpointing_enable()`` work as for any
    transformers model.

    Example::

        >>> import fastweights.hf  # registers the "fastweights" model type
        >>> from transformers import AutoModelForCausalLM
        >>> model = AutoModelForCausalLM.from_config(fastweights.hf.FastWeightsConfig(mixer="gated_deltanet"))
        >>> out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False)
    """

    config_class = FastWeightsConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _tied_weights_keys = {"model.lm_head.weight": "model.embed.weight"}

    def __init__(self, config) -> None:
        super().__init__(config)
        self.model = LM(config.to_lm_config())
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, output_loading_info: bool = False, **kwargs):
        """``PreTrainedModel.from_pretrained``, refusing incomplete weights, then every
        parameter copied into its own allocation.

        Refused with a :class:`WeightsMismatchError` (a ``ValueError``) naming them:
        tensors the config needs that the folder lacks (a config asking for more layers,
        or an untied head, than the weights were saved with) and tensors the model has no
        place for. transformers would call the missing ones "newly initialized", but
        with this model they hold whatever memory they were given; a load either
        reproduces the saved model exactly or fails.

        The copy: the loaded tensors sit at arbitrary offsets of the file's buffer, and
        vectorized reductions over unaligned memory round differently (5e-17 in float64),
        so without it a round trip would change logits in the last bit."""
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        # transformers does not list a tied weight that is absent under both of its names
        # (model.embed.weight with a tied head): it stays a meta tensor. Any tensor still on the
        # meta device was never loaded, so it counts as missing, named like the others.
        never_loaded = {name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta}
        if never_loaded:
            info = {**info, "missing_keys": set(info.get("missing_keys") or ()) | never_loaded}
        check_loading_info(info, args[0] if args else kwargs.get("pretrained_model_name_or_path"))
        with torch.no_grad():
            for param in model.parameters():  # a tied weight is one Parameter: copied once
                param.data = param.data.clone()
        return (model, info) if output_loading_info else model

    # transformers: which cache generate() starts with: not a DynamicCache, ours (below).
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """transformers' hook: start ``generate`` with an empty :class:`FastWeightsCache` (assisted
        decoding needs one before the first forward, to switch on its past recording)."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        if model_kwargs.get("cache") is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = FastWeightsCache(self.config.to_lm_config().mixers)
            if getattr(generation_config, "is_assistant", False):
                model_kwargs["cache"].activate_past_recording()

    def _prefill_then_window(self, input_ids, attention_mask, window: int):
        """``input_ids [B, T]`` read as a prefill of ``T − window`` tokens and then a verify window
        of the last ``window`` (so that crop can remove up to that many): ``(logits, LMCache)``."""
        head = max(input_ids.shape[1] - window, 1)
        mask = attention_mask
        if mask is not None and mask.shape[1] != input_ids.shape[1]:
            mask = mask[:, -input_ids.shape[1]:]
        if mask is not None and not bool(mask[:, head:].bool().all()):  # pads among the last tokens: no window
            return self.model(input_ids, attention_mask=mask)
        first, cache = self.model(input_ids[:, :head], attention_mask=None if mask is None else mask[:, :head])
        cache.recording = True
        rest, cache = self.model(input_ids[:, head:], cache, keep_window=True)
        return torch.cat([first, rest], dim=1), cache

    def _init_weights(self, module) -> None:
        # The LM initializes itself (its own scheme, scaled output projections); transformers
        # calls this for modules whose weights were not loaded.
        if isinstance(module, LM):
            module.reset_parameters()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value) -> None:
        self.model.embed = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, value) -> None:
        self.model.lm_head = value

    @property
    def lm(self) -> LM:
        """The wrapped :class:`~fastweights.models.LM`."""
        return self.model

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        cache: Optional[FastWeightsCache] = None,
        use_cache: Optional[bool] = None,
        labels: Optional[torch.LongTensor] = None,
        logits_to_keep: int = 0,
        inputs_embeds: Optional[torch.Tensor] = None,
        past_key_values: Optional[FastWeightsCache] = None,
        return_dict: Optional[bool] = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``input_ids [B, T]`` -> ``CausalLMOutputWithPast(loss, logits [B, T, vocab], cache)``.

        Args:
            attention_mask: ``[B, T]`` or, with a cache, ``[B, L + T]`` (transformers' form):
                1 for real tokens, 0 for padding. Logits at pads are 0.
            cache: the :class:`FastWeightsCache` of the previous call (``past_key_values``
                is accepted as its older name).
            use_cache: return a cache (default: ``config.use_cache`` outside training).
            labels: ``[B, T]`` targets aligned with ``input_ids`` (shifted inside); −100 ignored.
            logits_to_keep: return only the last n positions' logits (0 = all).
            kwargs: transformers' pass-through arguments (``num_items_in_batch`` is used
                by the loss; ``position_ids``, ``cache_position``, ... are not needed).
        """
        if inputs_embeds is not None:
            raise ValueError("FastWeightsForCausalLM: `inputs_embeds` is not supported; pass `input_ids`")
        if input_ids is None:
            raise ValueError("FastWeightsForCausalLM: `input_ids` is required")
        if cache is None:
            cache = past_key_values
        if cache is not None and not isinstance(cache, FastWeightsCache):
            raise TypeError(
                f"FastWeightsForCausalLM: `cache` must be a FastWeightsCache (as returned by this model), "
                f"got {type(cache).__name__}"
            )
        if use_cache is None:
            use_cache = bool(getattr(self.config, "use_cache", True)) and not self.training
        lm_cache = None if cache is None else cache.lm_cache
        recording = use_cache and cache is not None and cache.record_past
        if recording and lm_cache is None and input_ids.shape[1] > 1:
            # transformers' first assisted step: prompt and candidates in one call, then crop(-n) of the
            # candidates (logits_to_keep − 1 of them); an assistant's prompt, then crop(-n) of its proposals
            # and of the prompt's last token. So: the prompt, then its last tokens as a window.
            logits, new_cache = self._prefill_then_window(input_ids, attention_mask, max(logits_to_keep - 1, 1))
            if logits_to_keep:
                logits = logits[:, -logits_to_keep:]
        else:
            if recording and lm_cache is not None:
                lm_cache.recording = True
            logits, new_cache = self.model(input_ids, lm_cache, attention_mask=attention_mask, return_cache=use_cache)
            if recording and new_cache is not None:
                new_cache.recording = True
        loss = None if labels is None else causal_lm_loss(logits, labels, kwargs.get("num_items_in_batch"))
        if use_cache:
            cache = cache if cache is not None else FastWeightsCache(self.config.to_lm_config().mixers)
            cache.lm_cache = new_cache
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)
