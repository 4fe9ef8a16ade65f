"""fla's GatedDeltaNet2, GatedDeltaProduct and RWKV7Attention layers against ours, with fla's weights
loaded into ours (``load_fla_state_dict``).

fla's layers cannot run on a CPU as they are (Triton kernels), so each fla layer's own ``forward``
runs with those pieces replaced by pure torch: the memory ops by fla's naive references
(``naive_recurrent_gdn2``, ``naive_recurrent_gated_delta_product``, ``dplr_recurrence``), RWKV-7's
fused helpers by fla's own ``*_ref`` twins (``token_shift_ref``, ``torch_addcmul_rwkv7``,
``k_update_ref``, ``gate_output_correction_ref``), and the short convolution and gated norm by
our reading of fla's modules. fla's naive references compute in fp32: ours is held to fp32's
precision (1e-5 relative to the output's size).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from fastweights.layers import DeltaProduct, GatedDeltaNet2, RWKV7Attention, load_fla_state_dict

pytest.importorskip("fla.layers", reason="flash-linear-attention not installed (test-only oracle)")
import fla.layers.gated_deltaproduct as fla_dp
import fla.layers.gdn2 as fla_gdn2
import fla.layers.rwkv7 as fla_rwkv7
from fla.modules.token_shift import token_shift_ref
from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product
from fla.ops.gdn2.naive import naive_recurrent_gdn2
from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence
from fla.ops.rwkv7.fused_addcmul import torch_addcmul_rwkv7
from fla.ops.rwkv7.fused_k_update import k_update_ref
from fla.ops.rwkv7.gate_output_correction import gate_output_correction_ref

pytestmark = pytest.mark.usefixtures("one_thread")


def l2norm(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def conv_forward(self, x, cache=None, output_final_state=False, cu_seqlens=None, **_):
    w = self.weight  # [C, 1, W]: causal depthwise, then silu
    y = F.conv1d(F.pad(x.transpose(1, 2), (w.shape[-1] - 1, 0)), w, self.bias, groups=w.shape[0]).transpose(1, 2)
    return (F.silu(y) if self.activation in ("silu", "swish") else y), None


def gated_norm_forward(self, x, g=None, *args, **kwargs):
    y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
    act = torch.sigmoid if self.activation == "sigmoid" else F.silu
    return (y * act(g.float()) if g is not None else y).to(x.dtype)


def torch_pieces(layer, monkeypatch):
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = getattr(layer, name, None)
        if conv is not None:
            monkeypatch.setattr(conv, "forward", conv_forward.__get__(conv))
    monkeypatch.setattr(layer.o_norm, "forward", gated_norm_forward.__get__(layer.o_norm))


def naive_gdn2(q, k, v, g, b, w, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
               cu_seqlens=None, **_):
    assert cu_seqlens is None
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    return naive_recurrent_gdn2(q, k, v, g, b, w, initial_state=initial_state, output_final_state=output_final_state)


def naive_delta_product(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                        num_householder=1, use_qk_l2norm_in_kernel=False, **_):
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.float()), l2norm(k.float())
    return naive_recurrent_gated_delta_product(q, k, v.float(), None if g is None else g.float(), beta,
                                               q.shape[-1] ** -0.5, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                               output_final_state=output_final_state, num_householder=num_householder)


def naive_rwkv7(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None, **_):
    assert cu_seqlens is None
    head_first = [t.transpose(1, 2) for t in (r, k, v, a, b, w)]
    r_, k_, v_, a_, b_, w_ = head_first  # dplr_recurrence reads q · K^−0.5: undo it for RWKV-7's scale
    o, h = dplr_recurrence(r_ * scale * r.shape[-1] ** 0.5, k_, v_, a_, b_, w_, initial_state, output_final_state)
    return o.transpose(1, 2), h


def rwkv7_token_shift(x, cu_seqlens=None, output_cache=False, cache=None, **_):
    assert cache is None
    return token_shift_ref(x, cu_seqlens), x[:, -1]


def finite(layer):
    with torch.no_grad():  # fla may draw log(0) in its A_log init; keep it finite
        for p in layer.parameters():
            if not torch.isfinite(p).all():
                p.copy_(torch.randn_like(p))


def compare(case, theirs, ours, x, *fla_args, **fla_kw):
    with torch.no_grad():
        theirs.train()  # fla's chunk path (no cache)
        y_fla = theirs(x, *fla_args, **fla_kw)[0]
        y_ours = ours(x)[0]
    err = (y_ours - y_fla).abs().max().item()
    scale = y_fla.abs().max().item()
    print(f"{case}: max |ours - fla layer| = {err:.2e} (max |y| = {scale:.2e})")
    assert err <= 1e-5 * max(1.0, scale)


GDN2_CASES = {
    "gdn2": dict(hidden_size=32, num_heads=2, head_dim=16),
    "gdn2-neg-no-conv": dict(hidden_size=48, num_heads=4, head_dim=12, allow_neg_eigval=True, use_short_conv=False),
    "gdn2-grouped-value-heads": dict(hidden_size=32, num_heads=2, head_dim=8, num_v_heads=4),
}


@pytest.mark.parametrize("case", list(GDN2_CASES))
def test_fla_gdn2_weights_give_fla_outputs(case, monkeypatch):
    spec = GDN2_CASES[case]
    torch.manual_seed(0)
    theirs = fla_gdn2.GatedDeltaNet2(**spec, norm_eps=1e-5)
    finite(theirs)
    monkeypatch.setattr(fla_gdn2, "chunk_gdn2", naive_gdn2)
    torch_pieces(theirs, monkeypatch)
    ours = GatedDeltaNet2(**spec, fla_gate=True, norm_eps=1e-5, chunk_size=8)
    load_fla_state_dict(ours, theirs.state_dict())
    compare(case, theirs, ours, torch.randn(2, 21, spec["hidden_size"]))
    with pytest.raises(ValueError, match="build ours with `fla_gate`=True"):
        load_fla_state_dict(GatedDeltaNet2(**spec, norm_eps=1e-5), theirs.state_dict())


DP_CASES = {
    "deltaproduct-2-no-conv": dict(hidden_size=32, num_heads=2, head_dim=16, expand_v=1.0, num_householder=2,
                                   allow_neg_eigval=False, use_short_conv=False),  # (fla's default is True, ours False)
    "deltaproduct-3-neg-no-conv": dict(hidden_size=24, num_heads=2, head_dim=12, expand_v=1.0, num_householder=3,
                                       allow_neg_eigval=True, use_short_conv=False),
    "deltaproduct-1-conv-expand-v": dict(hidden_size=32, num_heads=4, head_dim=8, expand_v=2.0, num_householder=1,
                                         allow_neg_eigval=False),
}


@pytest.mark.parametrize("case", list(DP_CASES))
def test_fla_gated_delta_product_weights_give_fla_outputs(case, monkeypatch):
    spec = DP_CASES[case]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fla_dp.GatedDeltaProduct(**spec, norm_eps=1e-5, use_forget_gate=True)
    finite(theirs)
    monkeypatch.setattr(fla_dp, "chunk_gated_delta_product", naive_delta_product)
    torch_pieces(theirs, monkeypatch)
    ours = DeltaProduct(**spec, norm_eps=1e-5, chunk_size=8)
    load_fla_state_dict(ours, theirs.state_dict())
    compare(case, theirs, ours, torch.randn(2, 19, spec["hidden_size"]))


def test_fla_delta_product_with_convolved_steps_is_refused():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fla_dp.GatedDeltaProduct(hidden_size=32, num_heads=2, head_dim=16, num_householder=2, use_forget_gate=True)
    with pytest.raises(ValueError, match="convolves all 2 steps' keys and values"):
        load_fla_state_dict(DeltaProduct(hidden_size=32, num_heads=2, head_dim=16, num_householder=2), theirs.state_dict())


RWKV7_RANKS = dict(decay_low_rank_dim=8, a_low_rank_dim=8, v_low_rank_dim=6, gate_low_rank_dim=10)


@pytest.mark.parametrize("head_dim", [16, 12])
def test_fla_rwkv7_weights_give_fla_outputs(head_dim, monkeypatch):
    """Two fla layers (layer_idx 0 and 1: the second mixes in the first one's values) against ours."""
    for name, ref in (("token_shift", rwkv7_token_shift), ("fused_addcmul_rwkv7", torch_addcmul_rwkv7),
                      ("fused_k_rwkv7", k_update_ref), ("gate_output_correction", gate_output_correction_ref),
                      ("chunk_rwkv7", naive_rwkv7)):
        monkeypatch.setattr(fla_rwkv7, name, ref)
    torch.manual_seed(0)
    x = torch.randn(2, 21, 48)
    shared, v_first = {}, None
    for idx in (0, 1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = fla_rwkv7.RWKV7Attention(hidden_size=48, head_dim=head_dim, layer_idx=idx, num_hidden_layers=2,
                                               **RWKV7_RANKS)
        with torch.no_grad():  # fla zeroes o_proj and the low-rank maps' first halves at init: perturb everything
            for p in theirs.parameters():
                p.add_(0.1 * torch.randn_like(p))
        ours = RWKV7Attention(hidden_size=48, head_dim=head_dim, layer_idx=idx, num_hidden_layers=2, chunk_size=8,
                              **RWKV7_RANKS)
        load_fla_state_dict(ours, theirs.state_dict())
        with torch.no_grad():
            theirs.train()
            y_fla, _, _, v_first = theirs(x, v_first=v_first)
            y_ours, _ = ours(x, value_residual=shared)
        err = (y_ours - y_fla).abs().max().item()
        scale = y_fla.abs().max().item()
        print(f"rwkv7 K={head_dim} layer {idx}: max |ours - fla layer| = {err:.2e} (max |y| = {scale:.2e})")
        assert err <= 1e-5 * max(1.0, scale)
        assert (shared["v_first"] - v_first).abs().max() <= 1e-5 * max(1.0, v_first.abs().max().item())


def test_loader_names_what_does_not_fit():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = fla_rwkv7.RWKV7Attention(hidden_size=48, head_dim=16, layer_idx=1, num_hidden_layers=2, **RWKV7_RANKS)
    with pytest.raises(ValueError, match=r"unexpected \['v_lora.down.weight', 'v_lora.up.bias', 'v_lora.up.weight'\]"):
        load_fla_state_dict(RWKV7Attention(48, head_dim=16, layer_idx=0, **RWKV7_RANKS), theirs.state_dict())
    with pytest.raises(TypeError, match="`layer` must be a DeltaNet"):
        load_fla_state_dict(torch.nn.Linear(2, 2), theirs.state_dict())


def test_gdn2_with_fla_gate_decodes_what_it_prefills():
    """The fla-gated GDN-2 (no fused step) decodes through the recurrent op: equal to its prefill (float64)."""
    torch.manual_seed(0)
    layer = GatedDeltaNet2(24, 2, fla_gate=True, chunk_size=8).double()
    with torch.no_grad():
        layer.gate_bias.normal_()
    assert not layer.fused_step
    x = torch.randn(2, 17, 24, dtype=torch.float64)
    y, _ = layer(x)
    _, state = layer(x[:, :11])
    steps = []
    for t in range(11, 17):
        y_t, state = layer(x[:, t:t + 1], state)
        steps.append(y_t)
    err = (torch.cat(steps, 1) - y[:, 11:]).abs().max().item()
    print(f"fla-gated GDN-2 decode vs prefill: {err:.1e}")
    assert err <= 1e-12
    with pytest.raises(ValueError, match="`fla_gate`=True needs the output gate"):
        GatedDeltaNet2(24, 2, fla_gate=True, use_output_gate=False)
