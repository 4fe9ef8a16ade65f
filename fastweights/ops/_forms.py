"""The outer shell of the public forms: fla's ``state_v_first``, and the forms of a family whose
forms share one body (KDA, GDN-2, DeltaProduct, DPLR).

:func:`accepts_state_v_first` wraps a gated op so that fla's transposed state layout is undone at
the boundary and the op itself only sees ours.

Such a family writes its fla mapping once, as a body ``run_<family>(spec, ..., q, k, v, ...)`` in
its ``fla.py``; :func:`public_form` makes each form's public function from it, in the family's
``api.py``. A call enters here first, then the body, then the dispatcher (docs/design.md, "The
path of a call").
"""

from __future__ import annotations

import functools
import inspect

import torch

from ._checks import STATE_V_FIRST
from ._fla_compat import unknown_keyword
from ._spec import Form, OpSpec

__all__ = ["accepts_state_v_first", "public_form"]


def accepts_state_v_first(op):
    """Decorator for the gated ops: fla's ``state_v_first`` (or ``transpose_state_layout``)
    = True means the caller's states are ``[N, HV, V, K]``; transpose the initial state in
    and the final state out, so the op itself only sees our ``[N, HV, K, V]``."""

    @functools.wraps(op)
    def wrapper(*args, **kwargs):
        v_first = bool(kwargs.pop("state_v_first", False)) | bool(kwargs.pop("transpose_state_layout", False))
        if not v_first:
            return op(*args, **kwargs)
        bound = inspect.signature(op).bind_partial(*args, **kwargs)
        h0 = bound.arguments.get("initial_state")
        if isinstance(h0, torch.Tensor) and h0.dim() == 4:
            bound.arguments["initial_state"] = h0.transpose(-1, -2)
        # the checks quote a wrong initial_state in the caller's [N, HV, V, K] (not traceable: eager only)
        token = None if torch.compiler.is_compiling() else STATE_V_FIRST.set(True)
        try:
            o, h, *states = op(*bound.args, **bound.kwargs)
        finally:
            if token is not None:
                STATE_V_FIRST.reset(token)
        return (o, None if h is None else h.transpose(-1, -2), *(x.transpose(-1, -2) for x in states))

    return wrapper


def public_form(spec: OpSpec, body, leading: tuple, signature: inspect.Signature, doc: str, module: str,
                state_v_first: bool = False):
    """The public op of ``spec`` for a family whose forms share one body (KDA, GDN-2, DeltaProduct,
    DPLR): ``body(spec, *leading, *args, **kwargs)`` under ``signature`` (the body's, after ``spec``
    and ``leading``), named ``spec.name``, documented by ``doc``, living in ``module`` (the family's
    ``api.py``), with fla's ``state_v_first`` when asked.

    Only a chunk form takes ``chunk_size``: a recurrent or parallel form drops it from its signature
    (parameters after it become keyword-only, so no positional argument lands in its place) and
    refuses it as an unknown keyword."""
    chunked = spec.form is Form.CHUNK
    limit = None
    if not chunked:
        params = list(signature.parameters.values())
        names = [p.name for p in params]
        at = names.index("chunk_size")
        if params[at].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            limit = at
        rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else p
                for p in params[at + 1:]]
        signature = signature.replace(parameters=params[:at] + rest)

    def form(*args, **kwargs):
        if not chunked:
            if "chunk_size" in kwargs:
                raise unknown_keyword(spec.name, "chunk_size", signature.parameters)
            if limit is not None and len(args) > limit:
                raise TypeError(f"{spec.name}() takes at most {limit} positional arguments ({len(args)} given)")
        return body(spec, *leading, *args, **kwargs)

    form.__name__ = form.__qualname__ = spec.name
    form.__doc__ = inspect.cleandoc(doc)
    form.__signature__ = signature
    form.__module__ = module
    return accepts_state_v_first(form) if state_v_first else form
