"""The public one-token steps (``delta_rule_step``, ``gated_delta_rule_step``, ``linear_attn_step``)
equal the recurrent forms, token after token, and say what is wrong with bad input."""

import pytest
import torch

from fastweights import ops
from helpers import RULES, assert_close, make_inputs

SHAPES = [(1, 1, 8, 8), (3, 2, 60, 20), (2, 3, 16, 24)]  # (N, H, K, V): K != V, head size 60


def _steps(rule_name, x, **options):
    """Run the public step over every token of ``x`` (from its initial state); ``(o [N, T, H, V], h_T)``."""
    h, outputs = x["initial_state"], []
    for t in range(x["q"].shape[1]):
        tok = {name: x[name][:, t] for name in ("q", "k", "v", "beta", "g") if name in x}
        if rule_name == "gated_delta":
            o, h = ops.gated_delta_rule_step(tok["q"], tok["k"], tok["v"], tok["beta"], tok["g"], h)
        elif rule_name == "delta":
            o, h = ops.delta_rule_step(tok["q"], tok["k"], tok["v"], tok["beta"], h)
        else:
            q, k = tok["q"], tok["k"]
            if options.get("feature_map"):
                phi = ops.get_feature_map(options["feature_map"])
                q, k = phi(q), phi(k)
            o, h = ops.linear_attn_step(q, k, tok["v"], h, tok.get("g"), normalize=options.get("normalize", False))
        outputs.append(o)
    return torch.stack(outputs, dim=1), h


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("rule_name", ["delta", "gated_delta", "linear_decay", "linear_elu_normalized"])
def test_steps_equal_the_recurrent_form_in_float64(rule_name, shape):
    rule = RULES[rule_name]
    n, h, k, v = shape
    x = make_inputs(rule, n, 5, h, k, v, initial_state=True, seed=3)
    want_o, want_h = rule.reference(**x, output_final_state=True, **rule.options)
    options = dict(rule.options)
    got_o, got_h = _steps(rule_name, x, **options)
    assert_close("o", got_o, want_o, 1e-12)
    assert_close("state", got_h, want_h, 1e-12)


def test_inplace_writes_the_callers_state_and_the_default_does_not():
    x = make_inputs(RULES["delta"], 2, 1, 2, 8, 8, initial_state=True)
    args = (x["q"][:, 0], x["k"][:, 0], x["v"][:, 0], x["beta"][:, 0])
    state = x["initial_state"].clone()
    o, new = ops.delta_rule_step(*args, state)
    assert torch.equal(state, x["initial_state"]) and new.data_ptr() != state.data_ptr()
    o2, same = ops.delta_rule_step(*args, state, inplace=True)
    assert same is state and torch.equal(state, new) and torch.equal(o, o2)


def test_low_precision_inputs_read_out_in_their_dtype_with_an_fp32_state():
    x = make_inputs(RULES["gated_delta"], 2, 1, 2, 16, 16, initial_state=True)
    tok = {n: t[:, 0].to(torch.bfloat16) for n, t in x.items() if n != "initial_state"}
    state = x["initial_state"].float()
    o, h = ops.gated_delta_rule_step(tok["q"], tok["k"], tok["v"], tok["beta"], tok["g"], state)
    assert o.dtype == torch.bfloat16 and h.dtype == torch.float32


@pytest.mark.parametrize("call, message", [
    (lambda q, k, v, b, s: ops.delta_rule_step(q, k[..., :4], v, b, s), r"`q` and `k` must both have shape \[N, H, K\]"),
    (lambda q, k, v, b, s: ops.delta_rule_step(q, k, v, b[:, :1], s), r"`beta` must have shape \[N, H\] = \[2, 3\], got \[2, 1\]"),
    (lambda q, k, v, b, s: ops.delta_rule_step(q, k, v, b, s[..., :3]), r"`state` must have shape \[N, H, K, V\] = \[2, 3, 8, 5\]"),
    (lambda q, k, v, b, s: ops.delta_rule_step(q, k, v, b, s.half()), r"`state` must be float32 .* got torch.float16"),
    (lambda q, k, v, b, s: ops.delta_rule_step(q, k, v, b, s, backend="cuda"), r"unknown `backend` 'cuda'"),
    (lambda q, k, v, b, s: ops.gated_delta_rule_step(q, k, v, b, None, s), r"`g` must be a torch.Tensor"),
    (lambda q, k, v, b, s: ops.linear_attn_step(q, k, v, s, normalize=True), r"`state` must have shape \[N, H, K, V\] = \[2, 3, 8, 6\]"),
    (lambda q, k, v, b, s: ops.linear_attn_step(q, k, v.tolist(), s), r"`v` must be a torch.Tensor, got list"),
])
def test_bad_input_names_the_argument(call, message):
    q, k, v, b = torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 5), torch.rand(2, 3)
    s = torch.zeros(2, 3, 8, 5)
    with pytest.raises((ValueError, TypeError), match=message):
        call(q, k, v, b, s)
