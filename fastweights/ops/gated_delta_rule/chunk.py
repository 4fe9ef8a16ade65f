"""The gated delta rule, chunk form: the WY/UT algorithm with cumulative decays.

Inside a chunk, with b_r = g_1 + ... + g_r and Γ[r, i] = exp(b_r − b_i):

    A  = tril(diag(β) (K Kᵀ ⊙ Γ), −1),   T = (I + A)⁻¹ diag(β)
    W  = T (K ⊙ e^b),  U = T V,   U' = U − W h
    O  = scale · (Q ⊙ e^b) h + scale · tril(Q Kᵀ ⊙ Γ) U'
    h ← e^{b_C} h + (K ⊙ e^{b_C − b})ᵀ U'

``delta_rule/wy.py`` derives these lines from the recurrence; the solver is the
plain rule's (``delta_rule/chunk.py``) with g given.
"""

from __future__ import annotations



from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..delta_rule.chunk import CHUNK_DELTA_RULE
from ..step import gated_delta_rule_step

#: The gated delta rule's chunk op: the plain rule's solvers and kernels, with g given.
CHUNK_GATED_DELTA_RULE = OpSpec(
    "chunk_gated_delta_rule", Rule.DELTA, Form.CHUNK, torch=CHUNK_DELTA_RULE.torch, cpu=CHUNK_DELTA_RULE.cpu,
    triton=True, low_products=True, reads_bf16_inputs=True, single_backward=True, fused_finite_check=True,
    step=gated_delta_rule_step,
)


#: The public function moved to api.py (its old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.gated_delta_rule.api", "chunk_gated_delta_rule")
