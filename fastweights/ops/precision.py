"""Opt-in bf16 products for the delta rules' and KDA's forms (fp32 accumulation, fp32 state).

By default every op computes in fp32 whatever its inputs (docs/design.md, "Numerics"):
bf16/fp16 inputs are cast up once and the state is fp32. On a CPU with bf16 matrix
units (AVX512-BF16, AMX) a bf16 matrix product runs at several times the fp32 rate, so
a forward may instead feed the products bf16 *operands* (each product accumulates in
fp32; its result is rounded to bf16 once) while the state, the decays and the
triangular solve stay fp32. That is this mode:

    with fastweights.ops.bf16_products():
        o, h = chunk_gated_delta_rule(q_bf16, k_bf16, v_bf16, g, beta, output_final_state=True)

It applies only when all of these hold: the mode is on, the op's inputs are bfloat16
(as ``torch.autocast(dtype=torch.bfloat16)`` hands them from its projections), the op is
a delta rule (``chunk_`` or ``recurrent_``/``fused_recurrent_`` form, plain or gated) or KDA
(``chunk_kda``, ``recurrent_kda``/``fused_recurrent_kda``), and no backward follows (grad mode
off or no input requires grad: training keeps the fp32 path and its hand-written backward). Otherwise the op
computes in fp32 exactly as without the mode.

The mode is leave to use bf16 products, not an order (as ``torch.set_float32_matmul_precision``
is): on a CPU where they do not pay (:func:`fastweights.ops.cpu.bf16_unit` False: the compiled
kernels' ISA path is ``avx2`` or ``portable``, or, without them, a CPU without a bf16 unit: x86
without AVX512-BF16, Arm without FEAT_BF16, any other CPU),
a bf16 product is an fp32 product of rounded operands, slower and less accurate (on an AVX2-only
AMD EPYC the bf16 kernels ran 0.85-0.93x the fp32 forward, the PyTorch chunk path 5-6x slower than
without the mode: torch's bf16 matmul ran 1.0-1.3 GFLOP/s there against 86 in fp32), so the chunk
ops compute bf16 inputs as they do without the mode there, bitwise. The recurrent forms keep the
mode's bf16 operands everywhere (the reference the chunk forms are judged against).

Accuracy (tested in ``tests/ops/test_cpu_speed.py``): with bf16 operands the final state
carries bf16-level error (~1e-3 relative) instead of fp32-level (~1e-7); the output,
which is returned in bf16 anyway, moves from ~0.3 % to ~0.5 % relative error. Under
the mode the recurrent form uses bf16 operands too, so the two forms can be compared
at the same precision, and the chunk form stays within 2× of the recurrence's error.
KDA's chunk form (compiled CPU kernel ``chunk_kda_bf16.cpp``) rounds its decayed rows
``Q e^b``, ``K e^b``, ``K e^{−b}`` to bf16 once each; where the kernel is not available
(another device, kernels off) it runs its fp32 forward on the widened inputs instead
(tested in ``tests/ops/test_cpu_kda_bf16.py``).

Why it is not the default for bf16 inputs in inference: without the mode those inputs are
computed in fp32, and against that (the same inputs' recurrence) bf16 products roughly double
the output's error and raise the state's from ~1e-7 to ~3e-3 — more than the 2× the error rule
allows (measured in ``fastweights/ops/cpu/README.md``, "bf16 inputs"). Plain bf16 inputs instead
go to the compiled fp32 kernel unconverted, widened as it gathers each chunk.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

import torch

_state = threading.local()


def bf16_products_enabled() -> bool:
    """Whether :func:`bf16_products` / :func:`set_bf16_products` switched the mode on (this thread)."""
    return getattr(_state, "enabled", False)


def set_bf16_products(enabled: bool) -> None:
    """Switch the bf16-products mode on or off for this thread (see the module docstring)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"set_bf16_products: `enabled` must be a bool, got {type(enabled).__name__}")
    _state.enabled = enabled


@contextlib.contextmanager
def bf16_products(enabled: bool = True) -> Iterator[None]:
    """A context in which the delta rules' and KDA's inference forwards on bf16 inputs use bf16 products."""
    previous = bf16_products_enabled()
    set_bf16_products(enabled)
    try:
        yield
    finally:
        _state.enabled = previous


def product_dtype(input_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The operand dtype of an op's products for inputs of ``input_dtype``: bfloat16 under the
    mode for bf16 inputs, else None (fp32/fp64 operands, the default)."""
    if input_dtype == torch.bfloat16 and bf16_products_enabled():
        return torch.bfloat16
    return None


# -- torch.autocast: the ops compute in fp32 whatever autocast would do (docs/design.md, section 6) --


def autocast_off(device: torch.device):
    """A context in which ``torch.autocast`` does not apply on ``device`` (a no-op where it is not
    on: nothing to turn off, and an autocast context costs tens of microseconds a call once the
    caches are cold, on every op's path).

    The equivalent of ``torch.amp.custom_fwd(cast_inputs=...)`` for any device type,
    usable inside ``torch.compile`` and inside custom ops' implementations (which a
    compiled graph may call while the user's autocast region is active).
    """
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def check_autocast(op: str, device: torch.device, **tensors: Optional[torch.Tensor]) -> None:
    """Refuse float64 tensors inside an active ``torch.autocast`` region on ``device``."""
    if not torch.amp.is_autocast_available(device.type) or not torch.is_autocast_enabled(device.type):
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
            raise TypeError(
                f"{op}: `{name}` is float64 inside torch.autocast(device_type={device.type!r}, "
                f"dtype={torch.get_autocast_dtype(device.type)}); expected float32, bfloat16 or float16 there. "
                f"Autocast never lowers float64, so this is a float64 computation inside a mixed-precision "
                f"region: run it outside autocast, or cast `{name}` to float32."
            )
