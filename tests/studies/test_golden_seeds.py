"""Golden tests: every worked example of the three seeds, asserted with the text's own numbers.

The examples are computed through ``fastweights.ops`` in ``fastweights/studies/worked_examples.py``
(the same table ``fastweights examples`` prints); the expected values there are
typed in from the texts.
"""

import pytest
import torch

from fastweights import ops
from fastweights.studies import worked_examples as examples

ALL = examples.all_examples()


@pytest.mark.parametrize("example", ALL, ids=[f"{e.seed}: {e.name}" for e in ALL])
def test_worked_example(example):
    if example.expected is not None:
        err = (example.computed - example.expected).abs().max().item()
        print(f"{example.seed} {example.name}: max |error| {err:.2e}")
        assert err <= example.tol
    if example.must_differ_from is not None:
        gap = (example.computed - example.must_differ_from).abs().max().item()
        print(f"{example.seed} {example.name}: differs by {gap:.2e}, as the text says")
        assert gap > 1e-6


def test_every_seed_is_covered():
    seeds = {e.seed.split()[0] for e in ALL}
    assert seeds == {"000", "001", "002"}
    assert len(ALL) >= 35


def test_streaming_equals_traversal_only_with_z():
    """Seed 000's exercise: assert streaming == traversal for every prefix; which assertion fails without z?"""
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
