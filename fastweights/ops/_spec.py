"""Each op declared once: an :class:`OpSpec` says what the op is, the dispatcher reads nothing else.

A spec holds what used to be read from the op's name (``recurrent_*``/``parallel_*``/``chunk_*``,
``*_linear_attn``) or from attributes set on its solver function: the rule (sum or delta), the
form, the PyTorch solver and the compiled CPU one (the chunk kernels per backend), whether the
Triton kernels run it, whether its solver takes bf16 product operands, whether it reads plain
bf16 inputs, whether it has a single backward only, and its one-token step. The public function
passes its spec to :func:`fastweights.ops._dispatch.run`; the name is only for messages.

A solver has the signature ``solver(q, k, v, beta, g, h0, scale, **tensors) -> (o, h_T)`` on
head-first compute-dtype tensors (``fastweights/ops/_frontend.py``); a chunk form's solver also takes
``chunk_size`` (by keyword), and only a chunk form's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional

__all__ = ["Form", "Rule", "OpSpec"]


class Form(enum.Enum):
    """How an op computes the recurrence (docs/design.md, section 4)."""

    RECURRENT = "recurrent"  # one token at a time: the reference
    PARALLEL = "parallel"  # all T tokens at once with [T, T] matrices
    CHUNK = "chunk"  # chunks of C tokens, the state carried across them


class Rule(enum.Enum):
    """What the state does with a token (docs/design.md, section 3)."""

    SUM = "sum"  # linear attention: h ← α h + φ(k) vᵀ (context parallelism carries a decayed sum)
    DELTA = "delta"  # the delta family: a transition (I − β k kᵀ, or a generalization) before the write


@dataclass
class OpSpec:
    """One op, declared once.

    Fields:
        name: the public function's name, for messages only (nothing parses it).
        rule, form: :class:`Rule`, :class:`Form`.
        torch: the PyTorch solver (backend ``"torch"``, and every device but the CPU).
        cpu: the solver that runs the compiled CPU kernels where they apply (backend ``"cpu"``, and
            ``"auto"`` on the CPU); None where the op has no compiled kernel.
        triton: whether the Triton chunk kernels run the op (``fastweights/ops/triton/``).
        low_products: the solvers take ``low=torch.bfloat16`` (bf16 product operands,
            :func:`fastweights.ops.bf16_products`).
        reads_bf16_inputs: the CPU solver widens plain bf16 q, k, v itself (no fp32 copy first).
        single_backward: the solvers have a hand-written backward with no double backward, so the
            compiled q/k L2 norm (no double backward either) may serve them.
        fused_finite_check: the CPU solver takes ``check_finite=<op name>`` and makes the finite
            check of q, k and v itself (the compiled kernel while it gathers the rows, else the
            same Python check), so the front end skips its separate passes over them.
        fused_decay_check: the CPU solver takes ``check_decay=<op name>`` and ``decay_name=<the
            caller's name for gk>`` and makes the checks of the per-channel log decay gk (finite,
            <= 0) itself (the compiled kernel as it reads the decays, else ``_checks.check_decay``),
            so the front end skips its passes over gk.
        step: the public one-token step of the rule (the decoding path), or None.
    """

    name: str
    rule: Rule
    form: Form
    torch: Callable
    cpu: Optional[Callable] = None
    triton: bool = False
    low_products: bool = False
    reads_bf16_inputs: bool = False
    single_backward: bool = False
    fused_finite_check: bool = False
    step: Optional[Callable] = None
    fused_decay_check: bool = False

    def backends(self) -> tuple:
        """The explicit backend choices this op runs (``"auto"`` always does)."""
        return ("torch",) + (("cpu",) if self.cpu is not None else ()) + (("triton",) if self.triton else ())
