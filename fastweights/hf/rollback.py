"""Speculative decoding on transformers' own linear-attention hybrids, routed onto fastweights' ops.

transformers (5.24) refuses assisted generation (``prompt_lookup_num_tokens``,
``assistant_model``) for its "stateful" models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Kimi
Linear, OLMo-hybrid, ...): after verifying k drafted tokens the cache must be put back to
the state after the accepted ones, and a recurrent state cannot be cut like a KV cache. Its
linear-attention cache layers already keep the short convolution's past while recording
(``activate_past_recording``) and cut it on ``crop(-n)``; only the recurrent state is missing.

While :func:`~fastweights.hf.kernels.use_fastweights_kernels` routes those models, every
recurrent state they hand to the cache comes from one of our ops, so the cache can roll it
back the way TensorRT-LLM does (and fastweights' own cache: ``fastweights/models/window.py``),
by replaying the accepted tokens:

- the routed op notes its call (its inputs and its final state) before the model stores the
  final state with ``update_recurrent_state``; a recording layer keeps the state that entered
  its window and the calls of the window, matched to the stored state by identity;
- ``crop(-n)`` rebuilds the state after the kept tokens: whole calls contribute their final
  state as computed; the call cut by the rollback is run again by the same op on its first
  tokens, from the state before it; then the window closes (the kept inputs are freed), so
  the cache is back to its constant size after every verify;
- ``is_croppable`` is True for such a layer, and the models' ``_is_stateful`` flag is lowered
  while routed.

Without routing (or after ``use_fastweights_kernels(False)``) transformers' classes are as
they were. A recording layer whose state did not come from a routed op (transformers' torch
fallback, a hub kernel) stays uncroppable, and a crop of it raises as before.
"""

from __future__ import annotations

import sys
from typing import Callable, Dict, List, Optional

import torch

__all__ = ["install", "uninstall", "note_call"]

#: The last routed call: ``(final state, op, keyword arguments, number of tokens)``.
_last: Optional[tuple] = None
_saved: Dict[tuple, object] = {}  # (class, attribute) -> what was there before install
_stateful: List[type] = []        # model classes whose ``_is_stateful`` was lowered
_TOKEN_ARGS = ("q", "k", "v", "g", "beta", "gk", "gv")  # the per-token inputs, [B, T, ...]


def note_call(op: Callable, call: dict, result) -> None:
    """Called by a routed kernel after it ran: remember how to replay a prefix of this call."""
    global _last
    if not isinstance(result, tuple) or len(result) < 2 or result[1] is None:
        _last = None
        return
    q = call.get("q")
    tokens = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    _last = None if tokens is None or call.get("cu_seqlens") is not None else (result[1], op, dict(call), tokens)


def _replay(record: tuple, h: Optional[torch.Tensor], tokens: int) -> torch.Tensor:
    """The state after the first ``tokens`` tokens of a recorded call, from ``h`` (its initial state)."""
    _, op, call, _ = record
    args = {k: (v[:, :tokens] if k in _TOKEN_ARGS and isinstance(v, torch.Tensor) else v) for k, v in call.items()}
    args["initial_state"], args["output_final_state"] = h, True
    with torch.no_grad():
        return op(**args)[1]


def _update_recurrent_state(original):
    def update_recurrent_state(self, recurrent_states, state_idx: int = 0, **kwargs):
        if getattr(self, "record_past", False):
            windows = self.__dict__.setdefault("_fw_windows", {})
            if state_idx not in windows:  # the window opens: keep the state entering it (None: zeros)
                before = (self.recurrent_states[state_idx].clone()
                          if self.is_recurrent_states_initialized[state_idx] else None)
                windows[state_idx] = {"start": before, "calls": [], "ok": True}
            window = windows[state_idx]
            if _last is not None and _last[0] is recurrent_states:
                window["calls"].append(_last)
            else:
                window["ok"] = False
        return original(self, recurrent_states, state_idx, **kwargs)

    update_recurrent_state.fastweights_rollback = True
    return update_recurrent_state


def _is_croppable(original):
    def is_croppable(self) -> bool:
        windows = self.__dict__.get("_fw_windows")
        if self.record_past and windows and all(w["ok"] for w in windows.values()):
            return True
        return original.fget(self)

    return property(is_croppable)


def _crop(original):
    def crop(self, tokens_to_remove: int):
        windows = self.__dict__.get("_fw_windows")
        if not windows or not all(w["ok"] for w in windows.values()) or tokens_to_remove > 0:
            return original(self, tokens_to_remove)
        if any(self.is_conv_states_initialized.values()):
            original(self, tokens_to_remove)  # the convolution's past: transformers' own cut
        remove = abs(int(tokens_to_remove))
        for state_idx, window in windows.items():
            total = sum(rec[3] for rec in window["calls"])
            if remove > total:
                raise ValueError(f"crop: `tokens_to_remove`={tokens_to_remove} is more than the {total} token(s) "
                                 f"read since the last crop")
            keep, h = total - remove, window["start"]
            for rec in window["calls"]:
                if keep <= 0:
                    break
                h = rec[0] if keep >= rec[3] else _replay(rec, h, keep)
                keep -= rec[3]
            if h is None:  # nothing kept at all: the state before the window was empty
                self.recurrent_states[state_idx].zero_()
            else:
                self.recurrent_states[state_idx].copy_(h)
        self._fw_windows = {}  # the window closes: its inputs are freed

    crop.fastweights_rollback = True
    return crop


def install() -> None:
    """Patch transformers' linear-attention cache layers and lower ``_is_stateful`` of the routed models."""
    from transformers import cache_utils

    mixin, layer = cache_utils.LinearAttentionCacheLayerMixin, cache_utils.LinearAttentionLayer
    if (layer, "update_recurrent_state") in _saved:
        return
    from transformers import modeling_utils

    base = modeling_utils.PreTrainedModel
    for cls, name, make in ((layer, "update_recurrent_state", _update_recurrent_state), (mixin, "crop", _crop),
                            (mixin, "is_croppable", _is_croppable), (base, "post_init", _post_init)):
        original = cls.__dict__[name]
        _saved[(cls, name)] = original
        setattr(cls, name, make(original))
    lower_stateful()


def _post_init(original):
    """Models built after routing (their module imported later): lower the flag when one is made."""
    def post_init(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        lower_stateful()
        return out

    return post_init


def lower_stateful() -> None:
    """``_is_stateful = False`` on the model classes of every routed transformers module imported so far."""
    for mod_name, module in list(sys.modules.items()):
        if not mod_name.startswith("transformers.models.") or module is None:
            continue
        if not any(getattr(v, "fastweights_kernel", None) for v in vars(module).values()):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__dict__.get("_is_stateful") is True and value not in _stateful:
                value._is_stateful = False
                _stateful.append(value)


def uninstall() -> None:
    """Undo :func:`install`."""
    for (cls, name), original in _saved.items():
        setattr(cls, name, original)
    _saved.clear()
    for cls in _stateful:
        cls._is_stateful = True
    _stateful.clear()
