"""The DPLR delta rule's (RWKV-7) public ops: each form is the family's one body (``fla.py``) under the form's
signature, handed its :class:`~.._spec.OpSpec`.

The forms' maths and specs are in ``recurrent.py``, ``parallel.py``, ``chunk.py``; a call descends
from here through the fla mapping (``fla.py``) to the one dispatcher and the form's solver, each
module once (docs/design.md, "The path of a call").
"""

from __future__ import annotations

from .._forms import public_form
from .._spec import OpSpec
from .chunk import CHUNK_DPLR_DELTA_RULE
from .fla import FORM_SIGNATURE, run_dplr
from .parallel import PARALLEL_DPLR_DELTA_RULE
from .recurrent import RECURRENT_DPLR_DELTA_RULE

__all__ = ["recurrent_dplr_delta_rule", "parallel_dplr_delta_rule", "chunk_dplr_delta_rule"]


def dplr_form(spec: OpSpec, needs_floor: bool, doc: str):
    """The public op of ``spec`` (``recurrent_/parallel_/chunk_dplr_delta_rule``): :func:`~.fla.run_dplr`
    under :data:`~.fla.FORM_SIGNATURE` (``chunk_size`` on the chunk form only)."""
    return public_form(spec, run_dplr, (needs_floor,), FORM_SIGNATURE, doc, __name__)


recurrent_dplr_delta_rule = dplr_form(RECURRENT_DPLR_DELTA_RULE, needs_floor=False, doc="""
    The DPLR delta rule, one token at a time: the reference form (module docstring).

    Args (fla 0.6.0's ``chunk_dplr_delta_rule`` order):
        q, k, a, b: ``[B, T, H, K]``; v: ``[B, T, H, V]``.
        gk: ``[B, T, H, K]`` per-key-channel log decay (<= 0); ``None``: no decay.
        scale: ``None`` means ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32 (fp64 for fp64 inputs).
        output_final_state: also return the state after the last token.
        cu_seqlens, cu_seqlens_cpu, max_seqlen: N packed sequences (B = 1).
        safe_gate, disable_recompute, lower_bound: fla's kernel hints, ignored.

    Returns:
        ``(o [B, T, H, V] in the input dtype, final_state [N, H, K, V] or None)``.
""")


parallel_dplr_delta_rule = dplr_form(PARALLEL_DPLR_DELTA_RULE, needs_floor=True, doc="""
    The DPLR delta rule as one T×T block (O(T²·K) work, O(T²) memory; module docstring).

    Equivalent to :func:`~fastweights.ops.recurrent_dplr_delta_rule`: same arguments and
    returns, with ``gk >= −80``. Differentiable by autograd.
""")


chunk_dplr_delta_rule = dplr_form(CHUNK_DPLR_DELTA_RULE, needs_floor=True, doc="""
    The DPLR delta rule, chunkwise parallel (module docstring), with fla 0.6.0's name and
    positional order ``(q, k, v, a, b, gk, scale, initial_state, output_final_state,
    cu_seqlens, cu_seqlens_cpu, safe_gate, chunk_size, disable_recompute, ...)``.

    Equivalent to :func:`~fastweights.ops.recurrent_dplr_delta_rule` (same arguments and
    returns) to ~1e-12 relative in float64, with ``gk >= −80``. ``chunk_size`` (C) is any
    positive int, ``None``: 64. Gradients reach q, k, v, a, b, gk and initial_state.
""")
