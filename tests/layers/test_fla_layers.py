"""fla's DeltaNet / GatedDeltaNet layers against ours, with fla's weights loaded into ours.

fla's layers cannot run on a CPU as they are (their short convolution, output norm and
delta-rule ops are Triton kernels), so the fla layer's own ``forward`` runs with those
three pieces replaced by pure torch: the ops by fla's naive references
(``naive_recurrent_gated_delta_rule``, ``delta_rule_recurrence``, ``naive_gdn_gate``)
and the convolution and norm by our reading of fla's modules (a causal depthwise
conv1d + silu; RMSNorm(x)·weight·silu(gate)). Everything else — projections, the order
of conv and activations, β and g, grouped value heads, the state layout — is fla's code.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from fastweights.layers import DeltaNet, GatedDeltaNet, load_fla_state_dict

fla_layers = pytest.importorskip("fla.layers", reason="flash-linear-attention not installed (test-only oracle)")
import fla.layers.delta_net as fla_dn
import fla.layers.gated_deltanet as fla_gdn
from fla.ops.delta_rule.naive import delta_rule_recurrence
from fla.ops.gated_delta_rule.gate import naive_gdn_gate
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule


def l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def naive_gated_op(q, k, v, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                   use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, use_gate_in_kernel=False,
                   A_log=None, dt_bias=None, cu_seqlens=None, **_):
    assert cu_seqlens is None and not state_v_first or initial_state is None
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid() * (2 if allow_neg_eigval else 1)
    if use_gate_in_kernel:
        g = naive_gdn_gate(g, A_log, dt_bias)
    r = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    o, h = naive_recurrent_gated_delta_rule(q, k, v, beta, g, output_final_state=output_final_state)
    return o.to(v.dtype), (h.transpose(-1, -2) if (h is not None and state_v_first) else h)


def naive_delta_op(q, k, v, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                   cu_seqlens=None, **_):
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    o, h = delta_rule_recurrence(*(t.float().transpose(1, 2) for t in (q, k, v, beta)), output_final_state=output_final_state)
    return o.transpose(1, 2).to(v.dtype), h


def torch_pieces(layer, monkeypatch):
    """Replace the fla layer's Triton-only conv and norm by pure torch (module docstring)."""
    def conv_forward(self, x, cache=None, output_final_state=False, cu_seqlens=None, **_):
        w = self.weight  # [C, 1, W]
        y = F.conv1d(F.pad(x.transpose(1, 2), (w.shape[-1] - 1, 0)), w, self.bias, groups=w.shape[0]).transpose(1, 2)
        return (F.silu(y) if self.activation in ("silu", "swish") else y), None

    def norm_forward(self, x, g=None, *args, **kwargs):
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return (y * F.silu(g.float()) if g is not None else y).to(x.dtype)

    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = getattr(layer, name)
        monkeypatch.setattr(conv, "forward", conv_forward.__get__(conv))
    monkeypatch.setattr(layer.o_norm, "forward", norm_forward.__get__(layer.o_norm))
    if hasattr(layer, "_use_fused_qkv_conv"):
        monkeypatch.setattr(layer, "_use_fused_qkv_conv", lambda **_: False)


CASES = {
    "gated-grouped-values": dict(kind="gated", hidden_size=48, num_heads=2, head_dim=12, expand_v=1.5, num_v_heads=4),
    "gated-plain-heads": dict(kind="gated", hidden_size=32, num_heads=4, head_dim=8, expand_v=1.0),
    "gated-neg-eigval-no-gate": dict(kind="gated", hidden_size=32, num_heads=2, head_dim=16, expand_v=2.0,
                                     allow_neg_eigval=True, use_gate=False),
    "deltanet": dict(kind="delta", hidden_size=32, num_heads=2),
    "deltanet-gate": dict(kind="delta", hidden_size=40, num_heads=4, use_gate=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fla_layer_weights_give_fla_outputs(case, monkeypatch):
    spec = dict(CASES[case])
    kind = spec.pop("kind")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "gated":
            theirs = fla_gdn.GatedDeltaNet(**spec, norm_eps=1e-5)
            monkeypatch.setattr(fla_gdn, "chunk_gated_delta_rule", naive_gated_op)
            monkeypatch.setattr(fla_gdn, "fused_recurrent_gated_delta_rule", naive_gated_op)
        else:
            theirs = fla_dn.DeltaNet(**spec, norm_eps=1e-5)
            monkeypatch.setattr(fla_dn, "chunk_delta_rule", naive_delta_op)
            monkeypatch.setattr(fla_dn, "fused_recurrent_delta_rule", naive_delta_op)
    with torch.no_grad():  # fla draws A_log in [0, 16] with log(0) possible; keep it finite
        for p in theirs.parameters():
            if not torch.isfinite(p).all():
                p.copy_(torch.randn_like(p))
    torch_pieces(theirs, monkeypatch)
    ours_cls = GatedDeltaNet if kind == "gated" else DeltaNet
    extra = {"use_gate": spec.pop("use_gate")} if "use_gate" in spec else ({} if kind == "gated" else {"use_gate": False})
    ours = ours_cls(**spec, **extra, norm_eps=1e-5, chunk_size=8)
    load_fla_state_dict(ours, theirs.state_dict())

    x = torch.randn(2, 21, spec["hidden_size"])
    with torch.no_grad():
        theirs.train()  # the chunk path of fla's layer (no cache)
        y_fla = theirs(x)[0]
        y_ours, state = ours(x)
    err = (y_ours - y_fla).abs().max().item()
    scale = y_fla.abs().max().item()
    print(f"{case}: max |ours - fla layer| = {err:.2e} (max |y| = {scale:.2e})")
    assert err <= 1e-5 * max(1.0, scale)
    hv = spec.get("num_v_heads", spec["num_heads"])
    assert state.memory.shape[:2] == (2, hv)


def test_fla_names_and_ours_build_the_same_layer():
    a = GatedDeltaNet(hidden_size=48, num_heads=2, head_dim=12, expand_v=2, num_v_heads=4, use_gate=False, conv_size=3)
    b = GatedDeltaNet(48, 2, head_dim=12, expand_v=2, num_v_heads=4, use_output_gate=False, conv_size=3)
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}
    assert a.g_proj is None and a.v_proj.weight.shape == (96, 48) and a.A_log.shape == (4,)
    with pytest.raises(ValueError, match="contradicts"):
        DeltaNet(64, 4, hidden_size=32)
    with pytest.raises(TypeError, match="`expand_k`"):
        DeltaNet(hidden_size=32, num_heads=2, expand_k=1.0)
    with pytest.raises(ValueError, match="num_v_heads"):
        GatedDeltaNet(hidden_size=32, num_heads=4, num_v_heads=6)


def test_loader_names_what_does_not_fit():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fla_gdn.GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=16, expand_v=2.0)
    with pytest.raises(ValueError, match="shapes"):
        load_fla_state_dict(GatedDeltaNet(hidden_size=32, num_heads=2), theirs.state_dict())
    with pytest.raises(ValueError, match="missing"):
        load_fla_state_dict(GatedDeltaNet(hidden_size=32, num_heads=2, head_dim=16, expand_v=2.0),
                            {k: v for k, v in theirs.state_dict().items() if k != "A_log"})


@pytest.mark.parametrize("mode", ["chunk", "fused_recurrent"])
@pytest.mark.parametrize("kind", ["gated", "delta"])
def test_fla_layers_run_on_our_ops(kind, mode, monkeypatch):
    """The drop-in: fla's own DeltaNet / GatedDeltaNet layers with our ops bound to fla's
    names (gated: use_gate_in_kernel, A_log/dt_bias, beta sigmoid, state_v_first=True,
    grouped value heads) give what they give on fla's naive ops."""
    from fastweights import ops

    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "gated":
            layer = fla_gdn.GatedDeltaNet(hidden_size=48, num_heads=2, head_dim=12, expand_v=1.5, num_v_heads=4)
            module, names = fla_gdn, ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule")
            naive, mine = naive_gated_op, (ops.chunk_gated_delta_rule, ops.fused_recurrent_gated_delta_rule)
        else:
            layer = fla_dn.DeltaNet(hidden_size=48, num_heads=4)
            module, names = fla_dn, ("chunk_delta_rule", "fused_recurrent_delta_rule")
            naive, mine = naive_delta_op, (ops.chunk_delta_rule, ops.fused_recurrent_delta_rule)
    with torch.no_grad():
        for p in layer.parameters():
            if not torch.isfinite(p).all():
                p.copy_(torch.randn_like(p))
    torch_pieces(layer, monkeypatch)
    layer.train(mode == "chunk")  # fla's layer picks its op: chunk in training, fused_recurrent in eval
    x = torch.randn(2, 19, 48)
    outs = []
    for fns in ((naive, naive), mine):
        for name, fn in zip(names, fns):
            monkeypatch.setattr(module, name, fn)
        with torch.no_grad():
            outs.append(layer(x)[0])
    err = (outs[0] - outs[1]).abs().max().item()
    print(f"fla {kind} layer, {mode}: max |our ops - fla naive ops| = {err:.2e}")
    assert err < 1e-5
