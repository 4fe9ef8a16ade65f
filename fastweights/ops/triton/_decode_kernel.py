"""Triton kernel of the one-token (gated) delta-rule step; imported lazily by ``decode.py``."""

from __future__ import annotations

import triton
import triton.language as tl

from ._tuning import autotuned


@triton.jit
def _delta_step_kernel(
    q, k, v, beta, g, state, o, scale, K, V,
    BK: tl.constexpr, BV: tl.constexpr, GATED: tl.constexpr,
):
    """One (batch·head, V-block): the state block is read once and written once, in place.

        h ← α h;  u = β (v − hᵀ k);  h ← h + k uᵀ;  o = scale · hᵀ q
    """
    i_bh = tl.program_id(0).to(tl.int64)  # B·H on axis 0 (axes 1 and 2 stop at 65,535); int64 offsets
    i_v = tl.program_id(1)
    r = tl.arange(0, BK)
    c = i_v * BV + tl.arange(0, BV)
    mr = r < K
    mc = c < V
    h_ptr = state + i_bh * K * V + r[:, None] * V + c[None, :]
    h = tl.load(h_ptr, mask=mr[:, None] & mc[None, :], other=0.0).to(tl.float32)
    k_t = tl.load(k + i_bh * K + r, mask=mr, other=0.0).to(tl.float32)
    q_t = tl.load(q + i_bh * K + r, mask=mr, other=0.0).to(tl.float32)
    v_t = tl.load(v + i_bh * V + c, mask=mc, other=0.0).to(tl.float32)
    b_t = tl.load(beta + i_bh).to(tl.float32)
    if GATED:
        h = h * tl.exp(tl.load(g + i_bh).to(tl.float32))
    u_t = b_t * (v_t - tl.sum(h * k_t[:, None], axis=0))
    h = h + k_t[:, None] * u_t[None, :]
    tl.store(h_ptr, h.to(state.dtype.element_ty), mask=mr[:, None] & mc[None, :])
    o_t = tl.sum(h * q_t[:, None], axis=0) * scale
    tl.store(o + i_bh * V + c, o_t.to(o.dtype.element_ty), mask=mc)


#: (num_warps, num_stages) the autotuner may pick (``benchmarks/triton_resources.py`` checks them).
CONFIGS = [(4, 1), (8, 1)]  # one or two warps spill at K = 128 (the [K, BV] state block is 4096 fp32)
PINNED = (4, 1)

# The kernel updates the state in place: the autotuner restores it between trials.
delta_step = autotuned(_delta_step_kernel, CONFIGS, PINNED, ["K", "V", "BV", "GATED"], restore_value=["state"])
