"""Route transformers models that call fla's (and causal-conv1d's) kernels to fastweights.

transformers' linear-attention models decorate their pure-torch fallbacks with
``use_kernel_func_from_hub_with_fallback(name, package)``: at import time the decorator
binds the hub kernel if it imports, else the slow torch code. On a machine without a GPU
(or without fla) neither is what one wants. :func:`use_fastweights_kernels` rebinds these
names, in every model module already imported and in every one imported afterwards, to
our ops, which take fla's call form (:mod:`fastweights.ops._fla_compat`,
:mod:`fastweights.ops.kda.fla`). No network access, no ``kernels`` package.

=================================  ==========================================  ===========================
kernel name (package)              our function                                models (transformers 5.x)
=================================  ==========================================  ===========================
``chunk_gated_delta_rule`` (fla)   :func:`~fastweights.ops.chunk_gated_delta_rule`  qwen3_next, qwen3_5,
``fused_recurrent_gated_delta_     :func:`~fastweights.ops.recurrent_gated_delta_   qwen3_5_moe, olmo_hybrid
rule`` (fla)                       rule`
``chunk_kda`` (fla)                :func:`~fastweights.ops.chunk_kda`           kimi_linear
``fused_recurrent_kda`` (fla)      :func:`~fastweights.ops.recurrent_kda`       kimi_linear
``causal_conv1d_fn``,              :func:`causal_conv1d_fn` /                   all of the above
``causal_conv1d_update``           :func:`causal_conv1d_update` below, on
(causal_conv1d)                    :func:`fastweights.layers.causal_conv1d`
=================================  ==========================================  ===========================

Speculative decoding: while routed, these models' linear-attention cache layers roll their
recurrent state back by replaying the accepted tokens, so ``generate(prompt_lookup_num_tokens=k)``
and ``generate(assistant_model=...)`` run on them (:mod:`fastweights.hf.rollback`).

OLMo-hybrid sends β = 2·sigmoid(·) ∈ [0, 2] when its config has ``linear_allow_neg_eigval``,
without saying so to the kernel (fla's kernels do not check β). Our ops check β ∈ [0, 1]
unless told that negative eigenvalues are meant, so the routed OLMo-hybrid functions pass
``allow_neg_eigval=True`` (:data:`MODEL_OPTIONS`): β is still checked, against [0, 2].
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..layers import causal_conv1d
from ..ops import chunk_gated_delta_rule, chunk_kda, recurrent_gated_delta_rule, recurrent_kda
from .rollback import install as install_rollback, note_call, uninstall as uninstall_rollback

__all__ = ["use_fastweights_kernels", "torch_fallbacks", "KERNELS", "causal_conv1d_fn", "causal_conv1d_update"]

_ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}
# transformers' per-call kwargs that reach the convolution fallbacks and change nothing
# (``seq_idx`` / ``cu_seq_lens_q`` mark packed sequences: refused when given, see _check_conv_kwargs)
_CONV_PASS_THROUGH = frozenset({"position_ids", "cache_position", "use_cache", "output_attentions",
                                "output_hidden_states", "output_router_logits", "return_dict", "past_key_values",
                                "position_embeddings", "logits_to_keep", "num_items_in_batch", "cu_seq_lens_k",
                                "max_length_q", "max_length_k"})


def _activation(name: str, activation):
    if activation not in _ACTIVATIONS:
        raise ValueError(f"{name}: unsupported `activation` {activation!r}; expected None, 'silu' or 'swish'")
    return _ACTIVATIONS[activation]


def _check_conv_kwargs(name: str, kwargs: dict) -> None:
    """transformers' per-call keywords pass; anything else that is set is refused by name (transformers'
    torch fallback ignores e.g. ``seq_idx`` and would mix packed sequences silently)."""
    for key, value in kwargs.items():
        if key not in _CONV_PASS_THROUGH and value is not None and value is not False:
            raise ValueError(f"{name}: `{key}` is not supported by fastweights' short convolution "
                             f"(packed sequences and carried states: run one sequence per row)")


def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     activation: Optional[str] = None, **kwargs) -> torch.Tensor:
    """causal-conv1d's ``causal_conv1d_fn`` call form on :func:`fastweights.layers.causal_conv1d`:
    ``hidden_states [B, D, T]``, ``weight [D, W]`` -> ``[B, D, T]`` in the input dtype (zeros before
    the start; ``activation`` None or silu). Computed in the weight's dtype, as transformers' fallback."""
    act = _activation("causal_conv1d_fn", activation)
    _check_conv_kwargs("causal_conv1d_fn", kwargs)
    x = hidden_states.to(weight.dtype).transpose(1, 2)
    y = causal_conv1d(x, weight, bias)
    y = y if act is None else act(y)
    return y.transpose(1, 2).to(hidden_states.dtype)


def causal_conv1d_update(hidden_states: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, activation: Optional[str] = None, **kwargs) -> torch.Tensor:
    """causal-conv1d's ``causal_conv1d_update``: ``hidden_states [B, D, T]`` continue from ``conv_state
    [B, D, S]`` (S >= W − 1 earlier inputs, updated in place to the last S inputs) -> ``[B, D, T]``."""
    name = "causal_conv1d_update"
    act = _activation(name, activation)
    _check_conv_kwargs(name, kwargs)
    width, state_len = weight.shape[-1], conv_state.shape[-1]
    if state_len < width - 1:
        raise ValueError(f"{name}: `conv_state` must hold at least W − 1 = {width - 1} inputs, got {state_len}")
    x = hidden_states.to(weight.dtype)
    state = conv_state[:, :, state_len - (width - 1):].to(weight.dtype).transpose(1, 2)
    y = causal_conv1d(x.transpose(1, 2), weight, bias, state)
    conv_state.copy_(torch.cat([conv_state.to(weight.dtype), x], dim=-1)[:, :, -state_len:])
    y = y if act is None else act(y)
    return y.transpose(1, 2).to(hidden_states.dtype)


#: transformers' kernel name -> our function.
KERNELS: Dict[str, Callable] = {
    "chunk_gated_delta_rule": chunk_gated_delta_rule,
    "fused_recurrent_gated_delta_rule": recurrent_gated_delta_rule,
    "chunk_kda": chunk_kda,
    "fused_recurrent_kda": recurrent_kda,
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
}
#: The hub package each kernel name is decorated with (to decorate a fallback anew on restore).
PACKAGES = {"causal_conv1d_fn": "causal_conv1d", "causal_conv1d_update": "causal_conv1d"}
#: Options our op is given for one model family: ``(module name suffix, kernel) -> keywords``.
MODEL_OPTIONS: Dict[Tuple[str, str], dict] = {
    ("modeling_olmo_hybrid", "chunk_gated_delta_rule"): {"allow_neg_eigval": True},
    ("modeling_olmo_hybrid", "fused_recurrent_gated_delta_rule"): {"allow_neg_eigval": True},
}
# transformers' fallbacks name the tensors differently from fla / us.
_RENAME = {"query": "q", "key": "k", "value": "v"}

_originals: Dict[Tuple[str, str], Callable] = {}  # (module, attribute) -> what was there
_factory_original: Optional[Callable] = None


@contextlib.contextmanager
def torch_fallbacks(module, names):
    """Inside the block, ``module``'s decorated kernel functions ``names`` are transformers' own
    pure-torch fallbacks (the ``__wrapped__`` function the hub decorator was given), whatever
    the decorator bound (fla's GPU kernels when fla is installed, or our ops); restored after.
    The reference a routed model is compared and timed against."""
    decorated = {n: getattr(module, n) for n in names}
    try:
        for n, fn in decorated.items():
            setattr(module, n, getattr(fn, "__wrapped__", fn))
        yield
    finally:
        for n, fn in decorated.items():
            setattr(module, n, fn)


def _kernel_name(fn) -> Optional[str]:
    """The kernel name a transformers fallback wrapper was decorated with, or None.

    The decorator's inner function closes over ``func_name``; read it from the closure
    (no call, no import of the kernel)."""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or closure is None or "func_name" not in code.co_freevars:
        return None
    try:
        name = closure[code.co_freevars.index("func_name")].cell_contents
    except ValueError:  # empty cell
        return None
    if name not in KERNELS:
        return None
    return name if _fits(name, getattr(fn, "__wrapped__", None)) else None


def _fits(name: str, fallback) -> bool:
    """Whether our function can take every argument of transformers' ``fallback`` for kernel
    ``name``: the convolution kernels are routed only where the fallback's parameters are
    ones ours has (some models' fallbacks take packed-sequence or state arguments that ours do not)."""
    if name not in PACKAGES:
        return True
    try:
        params = inspect.signature(fallback).parameters.values()
    except (TypeError, ValueError):
        return False
    ours = inspect.signature(KERNELS[name]).parameters
    return all(p.name in ours for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD)


def _routed(name: str, fallback: Callable) -> Callable:
    """A function with ``fallback``'s signature that runs our op for kernel ``name``."""
    op, signature = KERNELS[name], inspect.signature(fallback)
    options = MODEL_OPTIONS.get((getattr(fallback, "__module__", "").rsplit(".", 1)[-1], name), {})

    @functools.wraps(fallback)
    def run(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        call = dict(options)
        for arg, value in bound.arguments.items():
            if signature.parameters[arg].kind is inspect.Parameter.VAR_KEYWORD:
                call.update(value)
            else:
                call[_RENAME.get(arg, arg)] = value
        result = op(**call)
        if name not in PACKAGES:  # a memory op: note how to replay it (rollback.py: speculative decoding)
            note_call(op, call, result)
        return result

    run.fastweights_kernel = name
    return run


def _patch_module(module) -> List[str]:
    done = []
    for attr, value in list(vars(module).items()):
        name = _kernel_name(value)
        if name is None:
            continue
        key = (module.__name__, attr)
        _originals.setdefault(key, value)
        setattr(module, attr, _routed(name, value.__wrapped__))
        done.append(f"{module.__name__}.{attr}")
    return done


def use_fastweights_kernels(enable: bool = True) -> List[str]:
    """Make transformers' gated-delta-rule and KDA models run on fastweights' ops (or undo it).

    Rebinds, in every imported ``transformers.models.*`` module, each function decorated
    as one of the kernels of :data:`KERNELS` (module docstring) to our function,
    and patches transformers' decorator so that modules imported later are routed too.
    ``enable=False`` restores what was there. Returns the ``module.attribute`` names changed.

    Example::

        >>> import fastweights.hf
        >>> fastweights.hf.use_fastweights_kernels()
        ['transformers.models.qwen3_next.modeling_qwen3_next.torch_chunk_gated_delta_rule', ...]
    """
    global _factory_original
    hub = importlib.import_module("transformers.integrations.hub_kernels")
    integrations = importlib.import_module("transformers.integrations")
    if not enable:
        restored = []
        for mod_name, module in list(sys.modules.items()):
            if not mod_name.startswith("transformers.models.") or module is None:
                continue
            for attr, value in list(vars(module).items()):
                name = getattr(value, "fastweights_kernel", None)
                if name is None:
                    continue
                # patched here: put the original back; imported after the patch: decorate anew
                original = _originals.get((mod_name, attr))
                if original is None and _factory_original is not None:
                    original = _factory_original(name, PACKAGES.get(name, "fla"))(value.__wrapped__)
                if original is not None:
                    setattr(module, attr, original)
                    restored.append(f"{mod_name}.{attr}")
        _originals.clear()
        uninstall_rollback()
        if _factory_original is not None:
            hub.use_kernel_func_from_hub_with_fallback = _factory_original
            integrations.use_kernel_func_from_hub_with_fallback = _factory_original
            _factory_original = None
        return restored

    if _factory_original is None:
        original = hub.use_kernel_func_from_hub_with_fallback
        _factory_original = original

        @functools.wraps(original)
        def factory(func_name: str, package: str, internal_path: Optional[str] = None):
            decorate = original(func_name, package, internal_path)
            if func_name not in KERNELS:
                return decorate
            return lambda torch_function: (_routed(func_name, torch_function) if _fits(func_name, torch_function)
                                           else decorate(torch_function))

        hub.use_kernel_func_from_hub_with_fallback = factory
        integrations.use_kernel_func_from_hub_with_fallback = factory
    changed = []
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("transformers.models.") and module is not None:
            changed += _patch_module(module)
    install_rollback()  # assisted generation: the routed models' caches roll back by replay
    return changed
