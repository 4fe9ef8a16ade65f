"""Golden tests: every worked example of docs/worked_examples.md, asserted with the numbers it states.

The examples are computed through ``fastweights.ops`` in ``fastweights/studies/worked_examples.py``
(the same table ``fastweights examples`` prints); the expected values there are the
hand-derived numbers of docs/worked_examples.md.
"""

import pytest
import torch

from fastweights import ops
from fastweights.studies import worked_examples as examples

ALL = examples.all_examples()


@pytest.mark.parametrize("example", ALL, ids=[f"{e.where}: {e.name}" for e in ALL])
def test_worked_example(example):
    if example.expected is not None:
        err = (example.computed - example.expected).abs().max().item()
        print(f"{example.where} {example.name}: max |error| {err:.2e}")
        assert err <= example.tol
    if example.must_differ_from is not None:
        gap = (example.computed - example.must_differ_from).abs().max().item()
        print(f"{example.where} {example.name}: differs by {gap:.2e}, as the docs say")
        assert gap > 1e-6


def test_every_section_is_covered():
    sections = {e.where.split()[0] for e in ALL}
    assert sections == {"§1", "§2", "§3", "§4"}
    assert len(ALL) >= 35


def test_streaming_equals_traversal_only_with_z():
    """The regression example's exercise: assert streaming == traversal for every prefix; which assertion fails without z?"""
    gen = torch.Generator().manual_seed(3)
    n, d = 30, 5
    keys, values, queries = (torch.randn(n, d, generator=gen, dtype=torch.float64) for _ in range(3))
    phi = ops.EluPlusOne()
    kernel = phi(queries) @ phi(keys).T  # [query t, key τ]
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    weights = kernel * mask
    traversal = (weights @ values) / weights.sum(1, keepdim=True)
    args = (queries[None, :, None], keys[None, :, None], values[None, :, None])
    with_z, state = ops.chunk_linear_attn(*args, feature_map="elu", normalize=True, eps=0.0, chunk_size=8, output_final_state=True)
    without_z, _ = ops.chunk_linear_attn(*args, feature_map="elu", scale=1.0, chunk_size=8)
    err = (with_z[0, :, 0] - traversal).abs().max().item()
    print(f"streaming vs traversal, every prefix: max |difference| {err:.3e}")
    assert err < 1e-13
    assert torch.allclose(state[0, 0, :, -1], phi(keys).sum(0)), "the extra state column is z = Σ φ(k)"
    # Without z the read is the unnormalized sum: the same assertion fails.
    with pytest.raises(AssertionError):
        assert (without_z[0, :, 0] - traversal).abs().max().item() < 1e-13


def test_earlier_names_still_resolve_with_a_warning():
    """Code written against ``fastweights.examples.seed_002()`` etc. keeps running."""
    for old, new in [("seed_002", "linear_attention_examples"), ("seed_001", "fast_weight_examples"),
                     ("seed_000", "regression_examples"), ("SEED_002_PAIRS", "LINEAR_PAIRS")]:
        with pytest.warns(DeprecationWarning, match=new):
            assert getattr(examples, old) is getattr(examples, new)
    with pytest.raises(AttributeError):
        _ = examples.seed_003
