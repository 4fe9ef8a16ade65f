"""Route transformers models that call fla's gated delta rule to fastweights' ops.

transformers' linear-attention models (Qwen3-Next, ...) decorate their pure-torch
fallbacks with ``use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")``
and ``(..."fused_recurrent_gated_delta_rule", "fla")``: at import time the decorator
binds fla's Triton kernel if fla imports, else the slow torch loop. On a machine
without a GPU (or without fla) neither is what one wants. :func:`use_fastweights_kernels`
rebinds both names, in every model module already imported and in every one imported
afterwards, to :func:`fastweights.ops.chunk_gated_delta_rule` and
:func:`fastweights.ops.recurrent_gated_delta_rule`, which take fla's call form
(:mod:`fastweights.ops._fla_compat`). No network access, no ``kernels`` package.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from typing import Callable, Dict, List, Optional, Tuple

from ..ops import chunk_gated_delta_rule, recurrent_gated_delta_rule

__all__ = ["use_fastweights_kernels", "KERNELS"]

#: transformers' kernel name -> our op.
KERNELS: Dict[str, Callable] = {
    "chunk_gated_delta_rule": chunk_gated_delta_rule,
    "fused_recurrent_gated_delta_rule": recurrent_gated_delta_rule,
}
# transformers' fallbacks name the tensors differently from fla / us.
_RENAME = {"query": "q", "key": "k", "value": "v"}

_originals: Dict[Tuple[str, str], Callable] = {}  # (module, attribute) -> what was there
_factory_original: Optional[Callable] = None


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
    return name if name in KERNELS else None


def _routed(name: str, fallback: Callable) -> Callable:
    """A function with ``fallback``'s signature that runs our op for kernel ``name``."""
    op, signature = KERNELS[name], inspect.signature(fallback)

    @functools.wraps(fallback)
    def run(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        call = {}
        for arg, value in bound.arguments.items():
            if signature.parameters[arg].kind is inspect.Parameter.VAR_KEYWORD:
                call.update(value)
            else:
                call[_RENAME.get(arg, arg)] = value
        return op(**call)

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
    """Make transformers' gated-delta-rule models run on fastweights' ops (or undo it).

    Rebinds, in every imported ``transformers.models.*`` module, each function decorated
    as kernel ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` to our op,
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
                    original = _factory_original(name, "fla")(value.__wrapped__)
                if original is not None:
                    setattr(module, attr, original)
                    restored.append(f"{mod_name}.{attr}")
        _originals.clear()
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
            return lambda torch_function: _routed(func_name, torch_function)

        hub.use_kernel_func_from_hub_with_fallback = factory
        integrations.use_kernel_func_from_hub_with_fallback = factory
    changed = []
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("transformers.models.") and module is not None:
            changed += _patch_module(module)
    return changed
