"""Kimi Delta Attention's public ops: each form is the family's one body (``fla.py``) under the form's
signature, handed its :class:`~.._spec.OpSpec`.

The forms' maths and specs are in ``recurrent.py``, ``parallel.py``, ``chunk.py``; a call descends
from here through the fla mapping (``fla.py``) to the one dispatcher and the form's solver, each
module once (docs/design.md, "The path of a call").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from .._forms import accepts_state_v_first, public_form
from .._spec import OpSpec
from .chunk import CHUNK_KDA
from .fla import FORM_SIGNATURE, run_kda
from .parallel import PARALLEL_KDA
from .recurrent import RECURRENT_KDA

__all__ = ["recurrent_kda", "parallel_kda", "chunk_kda", "fused_recurrent_kda", "recurrent_kda_as"]


def kda_form(spec: OpSpec, gv_supported: bool, doc: str):
    """The public op of ``spec`` (``recurrent_kda``, ``parallel_kda``, ``chunk_kda``): :func:`~.fla.run_kda`
    under :data:`~.fla.FORM_SIGNATURE` (``chunk_size`` on the chunk form only), with fla's ``state_v_first``."""
    return public_form(spec, run_kda, (gv_supported,), FORM_SIGNATURE, doc, __name__, state_v_first=True)


recurrent_kda = kda_form(RECURRENT_KDA, gv_supported=True, doc="""
    Kimi Delta Attention, one token at a time: the reference form (module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (HV a multiple of H: grouped value heads).
        g: ``[B, T, HV, K]``, the per-key-channel log decay, α_t = exp(g_t) ∈ (0, 1]
            (``g <= 0``; fla's name). ``gk=`` is the same argument under
            ``fused_recurrent_gated_delta_rule``'s name; give one. ``None``: no decay.
        beta: ``[B, T, HV]`` write strengths in [0, 1] ([0, 2] with ``allow_neg_eigval``);
            ``None``: β = 1.
        scale: ``None`` means ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` fp32 (fp64 for fp64 inputs).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: ``qk_norm="l2"`` (fla's spelling).
        use_gate_in_kernel, A_log, dt_bias, lower_bound: ``g`` is the raw gate input and the
            decay is ``−exp(A_log)·softplus(g + dt_bias)`` (``A_log [HV]``, ``dt_bias [HV·K]``), or
            ``lower_bound·sigmoid(exp(A_log)·(g + dt_bias))`` with a ``lower_bound`` (fla's formulas).
        use_beta_sigmoid_in_kernel, allow_neg_eigval: β = sigmoid(beta) (×2 with allow_neg_eigval).
        cu_seqlens, cu_seqlens_cpu, max_seqlen: N packed sequences (B = 1), as in
            :func:`~fastweights.ops.recurrent_delta_rule`.
        gv: ``[B, T, HV, V]`` per-value-channel log decay (h ← diag(α) h diag(exp(gv)) before
            the write); only this form (and its aliases) accepts it.
        qk_norm: ``None``, ``"l2"`` or ``"sum"``.
        **kwargs: fla's hints (``safe_gate``, ``disable_recompute``, ``use_graph``, ...,
            ignored), ``state_v_first``; see :mod:`fastweights.ops.kda.fla`.

    Returns:
        ``(o [B, T, HV, V] in the input dtype, final_state [N, HV, K, V] or None)``.

    Example::

        >>> B, T, H, K, V = 2, 100, 4, 32, 48
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K))   # per-channel log decays
        >>> o, h = recurrent_kda(q, k, v, g, torch.rand(B, T, H), use_qk_l2norm_in_kernel=True,
        ...                      output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([2, 100, 4, 48]), torch.Size([2, 4, 32, 48]))
""")


@accepts_state_v_first
def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: Optional[float] = None,
    cu_seqlens: Optional[torch.LongTensor] = None,
    **kwargs,
):
    """Alias of :func:`~fastweights.ops.recurrent_kda` with fla 0.6.0's signature and positional
    order ``(q, k, v, g, beta, A_log, dt_bias, scale, ...)``; ``state_v_first`` as in fla."""
    return recurrent_kda_as("fused_recurrent_kda")(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        lower_bound=lower_bound, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias, **kwargs,
    )


@functools.lru_cache(maxsize=None)
def recurrent_kda_as(alias: str):
    """:func:`recurrent_kda` under an alias's name (``fused_recurrent_kda``, ``fused_recurrent_gated_delta_rule``
    with ``gk``/``gv``), so that its errors name the function the caller called."""
    return kda_form(dataclasses.replace(RECURRENT_KDA, name=alias), gv_supported=True, doc=recurrent_kda.__doc__)


parallel_kda = kda_form(PARALLEL_KDA, gv_supported=False, doc="""
    Kimi Delta Attention as one T×T UT transform (O(T²·K) work, O(T²) memory; module docstring).

    Equivalent to :func:`~fastweights.ops.recurrent_kda`: same arguments and returns, except
    that ``gv`` is refused. Differentiable by autograd, double
    backward included.
""")


chunk_kda = kda_form(CHUNK_KDA, gv_supported=False, doc="""
    Kimi Delta Attention, chunkwise parallel: the fast path for training (module docstring).

    Equivalent to :func:`~fastweights.ops.recurrent_kda` (same arguments and returns; see its
    docstring), to ~1e-12 relative in float64, with fla 0.6.0's name and positional order
    ``(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, ...)``.
    ``gv`` is refused (the recurrent form has it).

    Args beyond the reference's:
        chunk_size: C, tokens per chunk (any positive int; fla allows 32 or 64). The
            intra-chunk work is O(T·C·(K + V) + T·16·K) per head; the loop has T/C steps.
            ``None`` (the default, as for every chunk op and layer) runs
            :func:`fastweights.ops.default_chunk_size` of K and the device.
        backend: ``"auto"`` (the compiled CPU kernels for CPU tensors, PyTorch elsewhere),
            ``"torch"`` (the PyTorch code) or ``"cpu"``, as in :func:`~fastweights.ops.chunk_delta_rule`.

    Gradients reach q, k, v, beta, g and initial_state through a hand-written backward
    (README.md in this folder) that keeps the inputs and the T/C chunk-entry states and
    recomputes the rest; double backward is not supported (use the parallel form).
    Under ``torch.autocast`` it computes in fp32 and returns the inputs' dtype.

    Example::

        >>> B, T, H, K, V = 2, 1000, 4, 64, 64
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> g = -torch.rand(B, T, H, K) * 7          # α down to 1e-3 per token and channel
        >>> o, h = chunk_kda(q, k, v, g, torch.rand(B, T, H), use_qk_l2norm_in_kernel=True,
        ...                  output_final_state=True, chunk_size=128)
""")
