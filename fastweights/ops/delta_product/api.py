"""(Gated) DeltaProduct's public ops: each form is the family's one body (``fla.py``) under the form's
signature, handed its :class:`~.._spec.OpSpec`.

The forms' maths and specs are in ``recurrent.py``, ``parallel.py``, ``chunk.py``; a call descends
from here through the fla mapping (``fla.py``) to the one dispatcher and the form's solver, each
module once (docs/design.md, "The path of a call").
"""

from __future__ import annotations

from .._forms import public_form
from .._spec import OpSpec
from .chunk import CHUNK_GATED_DELTA_PRODUCT
from .fla import FORM_SIGNATURE, run_delta_product
from .parallel import PARALLEL_GATED_DELTA_PRODUCT
from .recurrent import RECURRENT_GATED_DELTA_PRODUCT

__all__ = ["recurrent_gated_delta_product", "parallel_gated_delta_product", "chunk_gated_delta_product"]


def delta_product_form(spec: OpSpec, doc: str):
    """The public op of ``spec`` (``recurrent_/parallel_/chunk_gated_delta_product``):
    :func:`~.fla.run_delta_product` under :data:`~.fla.FORM_SIGNATURE` (``chunk_size`` on the chunk form only)."""
    return public_form(spec, run_delta_product, (), FORM_SIGNATURE, doc, __name__)


recurrent_gated_delta_product = delta_product_form(RECURRENT_GATED_DELTA_PRODUCT, doc="""
    (Gated) DeltaProduct, one token (n_h Householder steps) at a time: the reference form.

    Args (fla 0.6.0's ``chunk_gated_delta_product`` order):
        q: ``[B, T, H, K]``; k: ``[B, T·n_h, H, K]``; v: ``[B, T·n_h, H, V]`` (token t's
            sub-step j at t·n_h + j).
        g: ``[B, T, H]`` log decay per token (<= 0), ``None``: no decay (DeltaProduct).
        beta: ``[B, T·n_h, H]`` in [0, 1] ([0, 2] with ``allow_neg_eigval``); ``None``: 1.
        num_householder: n_h, Householder steps per token.
        scale: ``None`` means ``K ** -0.5``.
        initial_state: ``[N, H, K, V]`` fp32 (fp64 for fp64 inputs).
        output_final_state: also return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalize q and every k (fla's formula).
        cu_seqlens, cu_seqlens_cpu, max_seqlen: N packed sequences (B = 1), token offsets.
        allow_neg_eigval: β may lie in [0, 2].
        qk_norm: ``None``, ``"l2"`` or ``"sum"``.

    Returns:
        ``(o [B, T, H, V] in the input dtype, final_state [N, H, K, V] or None)``.

    Example::

        >>> B, T, H, K, V, n = 2, 100, 4, 32, 48, 2
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T * n, H, K), torch.randn(B, T * n, H, V)
        >>> g, beta = torch.nn.functional.logsigmoid(torch.randn(B, T, H)), 2 * torch.rand(B, T * n, H)
        >>> o, h = recurrent_gated_delta_product(q, k, v, g, beta, n, use_qk_l2norm_in_kernel=True,
        ...                                      allow_neg_eigval=True, output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([2, 100, 4, 48]), torch.Size([2, 4, 32, 48]))
""")


parallel_gated_delta_product = delta_product_form(PARALLEL_GATED_DELTA_PRODUCT, doc="""
    (Gated) DeltaProduct as one UT transform over all T·n_h sub-steps (O((T·n_h)²·K) work).

    Equivalent to :func:`~fastweights.ops.recurrent_gated_delta_product`: same arguments and
    returns. Differentiable by autograd, double backward included.
""")


chunk_gated_delta_product = delta_product_form(CHUNK_GATED_DELTA_PRODUCT, doc="""
    (Gated) DeltaProduct, chunkwise parallel: the fast path for training (module docstring),
    with fla 0.6.0's name and positional order ``(q, k, v, g, beta, num_householder, scale,
    initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, cu_seqlens_cpu)``.

    Equivalent to :func:`~fastweights.ops.recurrent_gated_delta_product` (same arguments and
    returns; see its docstring) to ~1e-12 relative in float64.

    Args beyond the reference's:
        chunk_size: C, tokens per chunk (each chunk's UT transform has C·n_h rows).

    Gradients reach q, k, v, g, beta and initial_state through KDA's hand-written chunk
    backward; double backward is not supported (use the parallel form).
""")
