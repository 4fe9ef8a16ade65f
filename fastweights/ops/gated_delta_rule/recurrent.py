"""The gated delta rule, recurrent form (reference).

    h_t = α_t (I − β_t k_t k_tᵀ) h_{t−1} + β_t k_t v_tᵀ,   α_t = exp(g_t) ≤ 1
    o_t = scale · h_tᵀ q_t

The decay fades every association a little (the "fading-memory solver
choice"), the delta step corrects only along k_t. The solver is shared with the
plain rule: :func:`fastweights.ops.delta_rule.recurrent.delta_rule_recurrence`.
"""

from __future__ import annotations



from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..delta_rule.recurrent import delta_rule_recurrence
from ..step import gated_delta_rule_step


#: The op, declared once (``fastweights/ops/_spec.py``).
RECURRENT_GATED_DELTA_RULE = OpSpec("recurrent_gated_delta_rule", Rule.DELTA, Form.RECURRENT,
                                    torch=delta_rule_recurrence, low_products=True, step=gated_delta_rule_step)


#: The public function moved to api.py (its old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.gated_delta_rule.api", "recurrent_gated_delta_rule")
