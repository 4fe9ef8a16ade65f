"""The gated delta rule, parallel form: one T×T decay-weighted UT transform.

The solver is shared with the plain rule (``delta_rule/parallel.py``); with
``g`` given, A and the causal scores carry Γ[r, i] = exp(b_r − b_i), and the
reads and writes of h_0 carry e^{b_r} and e^{b_T − b_i} (``delta_rule/wy.py``).
"""

from __future__ import annotations



from .._moved import moved_names
from .._spec import Form, OpSpec, Rule
from ..delta_rule.parallel import delta_rule_parallel
from ..step import gated_delta_rule_step


#: The op, declared once (``fastweights/ops/_spec.py``).
PARALLEL_GATED_DELTA_RULE = OpSpec("parallel_gated_delta_rule", Rule.DELTA, Form.PARALLEL, torch=delta_rule_parallel, step=gated_delta_rule_step)


#: The public function moved to api.py (its old path still works, with a DeprecationWarning).
__getattr__ = moved_names(__name__, "fastweights.ops.gated_delta_rule.api", "parallel_gated_delta_rule")
