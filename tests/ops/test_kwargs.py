"""Unknown keyword arguments are refused (TypeError, with "did you mean" when one is close);
the pass-through names that transformers and fla send are accepted and change nothing."""

from __future__ import annotations

import warnings

import pytest
import torch

import fastweights.ops as ops
from fastweights.ops._fla_compat import PASS_THROUGH

B, T, H, K = 1, 12, 2, 8


def inputs(gated=False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(3))
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    gate = -torch.rand(B, T, H, generator=g, dtype=torch.float64)
    return (q, k, v, gate, beta) if gated else (q, k, v, beta)


DELTA = ["recurrent_delta_rule", "parallel_delta_rule", "chunk_delta_rule"]
GATED = ["recurrent_gated_delta_rule", "parallel_gated_delta_rule", "chunk_gated_delta_rule",
         "fused_recurrent_gated_delta_rule"]


def call(name, **kw):
    gated = "gated" in name
    args = inputs(gated)
    if name == "fused_recurrent_gated_delta_rule":  # fla's positional order (q, k, v, g, gk, gv, beta)
        q, k, v, g, beta = args
        return getattr(ops, name)(q, k, v, g, beta=beta, **kw)
    return getattr(ops, name)(*args, **kw)


@pytest.mark.parametrize("name", DELTA + GATED)
def test_a_misspelt_cu_seqlens_is_a_type_error_that_names_the_right_one(name):
    cu = torch.tensor([0, 5, 12])
    with pytest.raises(TypeError, match=r"cu_seqlen\b.*did you mean `cu_seqlens`"):
        call(name, cu_seqlen=cu)


@pytest.mark.parametrize("name", DELTA + GATED)
def test_an_unknown_name_far_from_any_is_refused_without_a_guess(name):
    with pytest.raises(TypeError, match="unexpected keyword argument `frobnicate`") as e:
        call(name, frobnicate=3)
    assert "did you mean" not in str(e.value)


@pytest.mark.parametrize("name", DELTA + GATED)
def test_pass_through_names_are_accepted_silently_and_change_nothing(name):
    want = call(name, output_final_state=True)
    extras = {n: None for n in PASS_THROUGH}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = call(name, output_final_state=True, **extras)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_close_misspellings_of_other_arguments():
    for wrong, right in [("intial_state", "initial_state"), ("output_final_states", "output_final_state"),
                         ("chunksize", "chunk_size"), ("use_qk_l2_norm_in_kernel", "use_qk_l2norm_in_kernel")]:
        with pytest.raises(TypeError, match=f"did you mean `{right}`"):
            call("chunk_delta_rule", **{wrong: 1})
