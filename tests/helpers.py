"""Shared test helpers: the rule table, random inputs and error measures.

Every rule is listed once with its forms; the first form is the recurrent
reference. Tests build inputs with :func:`make_inputs` and call any form with
keyword arguments, so one test body covers every rule and form.
"""

from __future__ import annotations

import inspect
import os
import shutil
from dataclasses import dataclass, field
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F

from fastweights import ops

#: Whether this machine can build the compiled CPU kernels (a C++ compiler on the path).
HAS_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None


@dataclass(frozen=True)
class Rule:
    name: str
    forms: Tuple[Callable, ...]  # (recurrent reference, parallel, chunk)
    beta: bool = False
    g: bool = False
    options: Dict = field(default_factory=dict)  # extra keyword arguments for every form

    @property
    def reference(self) -> Callable:
        return self.forms[0]

    def state_dims(self, k_dim: int, v_dim: int) -> Tuple[int, int]:
        phi = ops.get_feature_map(self.options.get("feature_map"))
        return phi.output_dim(k_dim), v_dim + int(self.options.get("normalize", False))


LINEAR = (ops.recurrent_linear_attn, ops.parallel_linear_attn, ops.chunk_linear_attn)
DELTA = (ops.recurrent_delta_rule, ops.parallel_delta_rule, ops.chunk_delta_rule)
GATED = (ops.recurrent_gated_delta_rule, ops.parallel_gated_delta_rule, ops.chunk_gated_delta_rule)

RULES = {
    r.name: r
    for r in (
        Rule("linear", LINEAR),
        Rule("linear_decay", LINEAR, g=True),
        Rule("linear_elu_normalized", LINEAR, g=True, options=dict(feature_map="elu", normalize=True)),
        Rule("delta", DELTA, beta=True),
        Rule("delta_l2", DELTA, beta=True, options=dict(qk_norm="l2")),
        Rule("gated_delta", GATED, beta=True, g=True),
    )
}


def make_inputs(
    rule: Rule,
    B: int,
    T: int,
    H: int,
    K: int,
    V: int,
    dtype=torch.float64,
    initial_state: bool = False,
    seed: int = 0,
    requires_grad: bool = False,
) -> Dict[str, torch.Tensor]:
    """Random inputs for ``rule``: unit keys, β in (0, 1), g in (-1, 0)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=rand(B, T, H, K), k=F.normalize(rand(B, T, H, K), dim=-1), v=rand(B, T, H, V))
    if rule.beta:
        x["beta"] = torch.sigmoid(rand(B, T, H))
    if rule.g:
        x["g"] = F.logsigmoid(rand(B, T, H) + 2.0)
    if initial_state:
        kd, vd = rule.state_dims(K, V)
        h0 = rand(B, H, kd, vd)
        if rule.options.get("normalize"):
            h0[..., -1] = h0[..., -1].abs() + 1.0  # a normalizer that came from positive features
        x["initial_state"] = h0
    x = {name: t.to(dtype) if name != "initial_state" else t for name, t in x.items()}
    if requires_grad:
        for t in x.values():
            t.requires_grad_(True)
    return x


def chunk_option(form: Callable, chunk_size: int) -> dict:
    """``{"chunk_size": chunk_size}`` for a form that takes one (a chunk form), ``{}`` for the others
    (the recurrent and parallel forms have no chunk length)."""
    return {"chunk_size": chunk_size} if "chunk_size" in inspect.signature(form).parameters else {}


def in_chunk_place(recurrent: Callable) -> Callable:
    """``recurrent`` callable as a layer calls its chunk op: with a ``chunk_size``, which a recurrent
    form has no use for (tests that swap a layer's chunk op for the recurrence)."""
    def op(*args, chunk_size=None, **kwargs):
        return recurrent(*args, **kwargs)
    return op


def call(form: Callable, rule: Rule, inputs: Dict[str, torch.Tensor], **kwargs):
    """``form`` on ``inputs`` with the rule's options; a ``chunk_size`` goes to the forms that take one."""
    if "chunk_size" in kwargs:
        kwargs.update(chunk_option(form, kwargs.pop("chunk_size")))
    return form(**inputs, **rule.options, **kwargs)


def bf16_op_inputs(op_name: str, seed: int = 9) -> Dict[str, torch.Tensor]:
    """bf16 q, k, v and fp32 β, g, initial state for ``chunk_delta_rule``, ``chunk_gated_delta_rule``
    or ``chunk_kda`` (per-channel log decays g [B, T, H, K] in (−0.3, 0)): B 2, T 70, H 2, K 32 ≠ V 24."""
    rule = RULES["delta" if op_name == "chunk_delta_rule" else "gated_delta"]
    x = make_inputs(rule, 2, 70, 2, 32, 24, initial_state=True, seed=seed)
    if op_name == "chunk_kda":
        x["g"] = -0.3 * torch.rand(2, 70, 2, 32, generator=torch.Generator().manual_seed(seed))
    return {n: (t.to(torch.bfloat16) if n in ("q", "k", "v") else t.float()) for n, t in x.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / max(‖b‖, tiny), in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    err = rel_err(got, want)
    print(f"{name}: relative error {err:.2e} (tolerance {tol:.0e})")
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"
    return err



def assert_decode_matches_forward(model, ids: torch.Tensor, prefix: int, end: int, tol: float = 1e-12) -> None:
    """An LM that prefills ``ids[:, :prefix]`` and then decodes ``ids[:, prefix:end]`` one token at a
    time from its cache gives the full forward's logits at those positions (within ``tol``)."""
    with torch.no_grad():
        full, _ = model(ids)
        _, cache = model(ids[:, :prefix])
        steps = []
        for t in range(prefix, end):
            out, cache = model(ids[:, t:t + 1], cache)
            steps.append(out)
    assert_close("LM decode from cache vs full forward (float64)", torch.cat(steps, 1), full[:, prefix:end], tol)

def saved_by_function(monkeypatch, fn):
    """Bytes every ``autograd.Function`` passes to ``ctx.save_for_backward`` while ``fn`` runs.

    Counts what the Function asks to keep, whatever the grad mode (under
    ``no_grad`` autograd's saved-tensor hooks never see it).
    """
    seen = []
    original = torch.autograd.function.FunctionCtx.save_for_backward

    def spy(ctx, *tensors):
        seen.extend(t.untyped_storage().nbytes() for t in tensors if t is not None)
        return original(ctx, *tensors)

    with monkeypatch.context() as patch:
        patch.setattr(torch.autograd.function.FunctionCtx, "save_for_backward", spy)
        fn()
    return sum(seen)


def record_calls(monkeypatch, module, name: str, record: Callable) -> list:
    """Wrap ``module.<name>`` (a compiled kernel: eager code and a compiled graph's custom op both
    look it up on the extension by name) so that each call appends ``record(args)`` to the list
    returned; TorchDynamo's caches are reset, so a graph traced earlier cannot skip the wrapper."""
    seen = []
    original = getattr(module, name)

    def recorded(*args):
        seen.append(record(args))
        return original(*args)

    monkeypatch.setattr(module, name, recorded)
    torch._dynamo.reset()
    return seen


def forward_backward(form: Callable, inputs: Dict[str, torch.Tensor], options=None, seed: int = 1):
    """Forward and backward of ``(o·do).sum() + (h_T·dh).sum()`` with seeded random ``do``, ``dh``:
    ``(o, h_T, {name: gradient})`` (``options``: further keywords of ``form``)."""
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in inputs.items()}
    o, h = form(**leaves, output_final_state=True, **(options or {}))
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)).sum()
    loss = loss + (h * torch.randn(h.shape, generator=gen, dtype=torch.float64).to(h.dtype)).sum()
    loss.backward()
    return o, h, {n: t.grad for n, t in leaves.items()}


def assert_all_close(label: str, got, want, tol: float, grad_tol: float) -> None:
    """:func:`assert_close` on the output, the final state and every gradient of two :func:`forward_backward` results."""
    o, h, grads = got
    o_ref, h_ref, g_ref = want
    assert_close(f"{label} o", o, o_ref, tol)
    assert_close(f"{label} h_T", h, h_ref, tol)
    for name in g_ref:
        assert_close(f"{label} d{name}", grads[name], g_ref[name], grad_tol)


def thread_and_batch_runs(op: Callable, x: Dict[str, torch.Tensor]):
    """``(one, two, alone)``: ``op(**x, output_final_state=True)`` without grad on one torch thread,
    on two, and on the first batch row alone (one thread); the caller's thread count is restored.
    For bitwise thread- and batch-invariance checks of a compiled kernel."""
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = op(**x, output_final_state=True)
            torch.set_num_threads(2)
            two = op(**x, output_final_state=True)
            torch.set_num_threads(1)
            alone = op(**{n: t[:1] for n, t in x.items()}, output_final_state=True)
    finally:
        torch.set_num_threads(threads)
    return one, two, alone
