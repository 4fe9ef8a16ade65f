"""Gated DeltaNet-2's public ops: each form is the family's one body (``fla.py``) under the form's
signature, handed its :class:`~.._spec.OpSpec`.

The forms' maths and specs are in ``recurrent.py``, ``parallel.py``, ``chunk.py``; a call descends
from here through the fla mapping (``fla.py``) to the one dispatcher and the form's solver, each
module once (docs/design.md, "The path of a call").
"""

from __future__ import annotations

from typing import Optional

import torch

from .._forms import public_form
from .._spec import OpSpec
from .chunk import CHUNK_GDN2
from .fla import FORM_SIGNATURE, run_gdn2
from .parallel import PARALLEL_GDN2
from .recurrent import RECURRENT_GDN2

__all__ = ["recurrent_gdn2", "parallel_gdn2", "chunk_gdn2", "fused_recurrent_gdn2"]


def gdn2_form(spec: OpSpec, doc: str):
    """The public op of ``spec`` (``recurrent_gdn2``, ``parallel_gdn2``, ``chunk_gdn2``): :func:`~.fla.run_gdn2`
    under :data:`~.fla.FORM_SIGNATURE` (``chunk_size`` on the chunk form only), with fla's ``state_v_first``."""
    return public_form(spec, run_gdn2, (), FORM_SIGNATURE, doc, __name__, state_v_first=True)


recurrent_gdn2 = gdn2_form(RECURRENT_GDN2, doc="""
    Gated DeltaNet-2, one token at a time: the reference form (module docstring).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]`` (HV a multiple of H: grouped value heads).
        g: ``[B, T, HV, K]`` per-key-channel log decay (``<= 0``); ``None``: no decay.
        b: ``[B, T, HV, K]`` erase gate in [0, 2]; w: ``[B, T, HV, V]`` write gate in [0, 1].
        scale: ``None`` means ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` fp32 (fp64 for fp64 inputs).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: ``qk_norm="l2"`` (fla's spelling).
        use_gate_in_kernel, A_log, dt_bias, lower_bound: ``g`` is the raw gate input, as in
            :func:`~fastweights.ops.chunk_kda` (:func:`~fastweights.ops.kda_gate`).
        cu_seqlens, cu_seqlens_cpu, max_seqlen: N packed sequences (B = 1).
        qk_norm: ``None``, ``"l2"`` or ``"sum"``.
        **kwargs: fla's hints (``safe_gate``, ``disable_recompute``, ignored), ``state_v_first``;
            see :mod:`fastweights.ops.gdn2.fla`.

    Returns:
        ``(o [B, T, HV, V] in the input dtype, final_state [N, HV, K, V] or None)``.

    Example::

        >>> B, T, H, K, V = 2, 100, 4, 32, 48
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, K))
        >>> b, w = 2 * torch.rand(B, T, H, K), torch.rand(B, T, H, V)
        >>> o, h = recurrent_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True, output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([2, 100, 4, 48]), torch.Size([2, 4, 32, 48]))
""")


def fused_recurrent_gdn2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    b: Optional[torch.Tensor] = None,
    w: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    lower_bound: Optional[float] = None,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
    **kwargs,
):
    """Alias of :func:`~fastweights.ops.recurrent_gdn2` with fla 0.6.0's signature and positional
    order ``(q, k, v, g, b, w, A_log, dt_bias, scale, ...)``; ``state_v_first`` as in fla.
    fla's serving arguments (``ssm_state_indices``, ``num_accepted_tokens``, ``inplace_final_state``,
    ``out``) are refused as unknown keywords."""
    return recurrent_gdn2(
        q, k, v, g, b, w, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        lower_bound=lower_bound, state_v_first=state_v_first, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
        **kwargs,
    )


parallel_gdn2 = gdn2_form(PARALLEL_GDN2, doc="""
    Gated DeltaNet-2 as one T×T UT transform (O(T²·K) work, O(T²) memory; module docstring).

    Equivalent to :func:`~fastweights.ops.recurrent_gdn2`: same arguments and returns
   . Differentiable by autograd, double backward included.
""")


chunk_gdn2 = gdn2_form(CHUNK_GDN2, doc="""
    Gated DeltaNet-2, chunkwise parallel: the fast path for training (module docstring).

    Equivalent to :func:`~fastweights.ops.recurrent_gdn2` (same arguments and returns; see
    its docstring), to ~1e-12 relative in float64, with fla 0.6.0's name and positional
    order ``(q, k, v, g, b, w, scale, initial_state, output_final_state,
    use_qk_l2norm_in_kernel, use_gate_in_kernel, cu_seqlens, ...)``.

    Args beyond the reference's:
        chunk_size: C, tokens per chunk (any positive int; fla's kernel requires 64).
        backend: ``"auto"`` (the compiled CPU kernels for CPU tensors, PyTorch elsewhere),
            ``"torch"`` (the PyTorch code) or ``"cpu"``, as in :func:`~fastweights.ops.chunk_kda`.

    Gradients reach q, k, v, g, b, w and initial_state through KDA's hand-written chunk
    backward (inputs and the T/C chunk-entry states kept, the rest recomputed); double
    backward is not supported (use the parallel form). Under ``torch.autocast`` it computes
    in fp32 and returns the inputs' dtype.

    Example::

        >>> B, T, H, K, V = 2, 1000, 4, 64, 64
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> g = -torch.rand(B, T, H, K) * 7          # α down to 1e-3 per token and channel
        >>> b, w = 2 * torch.rand(B, T, H, K), torch.rand(B, T, H, V)
        >>> o, h = chunk_gdn2(q, k, v, g, b, w, use_qk_l2norm_in_kernel=True, output_final_state=True)
""")
