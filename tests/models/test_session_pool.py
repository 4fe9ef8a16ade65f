"""The session pool (continuous batching) and the serving benchmark's quick run.

A batch of sessions at shuffled slots decodes exactly what each session decodes alone
(float64: ≤ 1e-12; the LM's projections are batched matmuls, so not bitwise across batch
sizes); admitting and releasing reuse slots without touching the others; the benchmark's
tiny run produces every table (no speed is asserted: timings belong to the benchmark).
"""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.run import main as run_benchmarks
from fastweights.models import LM, LMConfig, fork_cache
from fastweights.models.pool import SessionPool

VOCAB = 37
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mixer", ["deltanet", ["gated_deltanet", "kda", "linear"], ["gdn2", "deltaproduct"], ["rwkv7", "deltanet", "rwkv7"]])
def test_pool_sessions_equal_each_session_alone(mixer):
    n_layers = len(mixer) if isinstance(mixer, list) else 2
    torch.manual_seed(0)
    model = LM(LMConfig(vocab_size=VOCAB, d_model=32, n_layers=n_layers, n_heads=2, mixer=mixer)).double().eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in (3, 17, 9)]
    pool = SessionPool(model, slots=6)
    with torch.no_grad():
        caches = [model(p)[1] for p in prompts]
        filler = pool.admit(fork_cache(caches[0]))  # a session that stays idle in slot 0
        slots = [pool.admit(fork_cache(c)) for c in caches]
        before = pool.memory[0][filler].clone()
        pool.release(slots[0])
        slots[0] = pool.admit(fork_cache(caches[0]))  # slot reuse
        order = torch.tensor([slots[2], slots[0], slots[1]])
        tokens = torch.randint(0, VOCAB, (3,), generator=gen)
        alone = [caches[2], caches[0], caches[1]]
        for _ in range(3):
            logits = pool.step(tokens, order)
            for i in range(3):
                ref, alone[i] = model(tokens[i].view(1, 1), alone[i])
                assert (logits[i] - ref[0, -1]).abs().max().item() <= 1e-12
            tokens = logits.argmax(-1)
        assert torch.equal(pool.memory[0][filler], before)
    with pytest.raises(ValueError, match=r"SessionPool.step: `slots` must name live sessions"):
        pool.step(tokens[:1], torch.tensor([5]))
    with pytest.raises(ValueError, match=r"SessionPool.step: `state_indices` names slot 1 more than once"):
        pool.step(tokens[:2], torch.tensor([1, 1]))


@pytest.mark.parametrize("mixer", ["deltanet", "gated_deltanet"])
def test_pool_step_works_at_the_slots_bitwise(mixer, monkeypatch):
    """On the CPU the delta rules' pool step runs the compiled kernel at the slots: no state is
    gathered (a gather would raise here), the idle slots keep their bytes, and one session in
    the pool (fp32) decodes bitwise what it decodes alone (the same matmul shapes and update)."""
    from fastweights.ops import state_pool
    from fastweights.ops.cpu import kernels_for

    torch.manual_seed(2)
    model = LM(LMConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, mixer=mixer)).eval()
    if kernels_for(next(model.parameters())) is None:
        pytest.skip("the compiled CPU kernels are not built here")
    gen = torch.Generator().manual_seed(3)
    pool = SessionPool(model, slots=5)
    with torch.no_grad():
        caches = [model(torch.randint(0, VOCAB, (1, n), generator=gen))[1] for n in (7, 1, 12)]
    slots = [pool.admit(fork_cache(c)) for c in caches]  # 0, 1, 2; slots 3, 4 stay empty
    idle = [m[3:].clone() for m in pool.memory]

    def no_gather(*args, **kwargs):
        raise AssertionError("the pool step gathered the states")

    monkeypatch.setattr(state_pool, "gather_states", no_gather)
    token, alone = torch.tensor([5]), fork_cache(caches[1])
    with torch.no_grad():
        for _ in range(4):
            logits = pool.step(token, torch.tensor([slots[1]]))
            ref, alone = model(token.view(1, 1), alone)
            assert torch.equal(logits[0], ref[0, -1])
            token = logits.argmax(-1)
        for i, s in enumerate(alone.states):
            assert torch.equal(pool.memory[i][slots[1]], s.memory[0]) and torch.equal(pool.conv[i][slots[1]], s.conv[0])
        batch = pool.step(torch.tensor([1, 2, 3]), torch.tensor([slots[2], slots[0], slots[1]]))
    assert batch.shape == (3, VOCAB) and bool(torch.isfinite(batch).all())
    for i in range(len(pool.memory)):
        assert torch.equal(pool.memory[i][3:], idle[i])


def test_pool_refuses_softmax_and_a_full_pool():
    model = LM(LMConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, mixer=["deltanet", "softmax"]))
    with pytest.raises(ValueError, match=r"SessionPool: mixers .* include softmax"):
        SessionPool(model, 4)
    model = LM(LMConfig(vocab_size=VOCAB, d_model=32, n_layers=1, n_heads=2, mixer="deltanet"))
    pool = SessionPool(model, 1)
    with torch.no_grad():
        cache = model(torch.randint(0, VOCAB, (1, 4)))[1]
    pool.admit(cache)
    with pytest.raises(ValueError, match=r"all 1 slots are taken"):
        pool.admit(cache)


def test_serving_benchmark_quick(tmp_path):
    out = tmp_path / "serving.json"
    run_benchmarks(["serving", "--quick", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [r["sessions"] for r in result["throughput"]] == [1, 2, 4, 8]
    assert all(r["tokens_per_s"] > 0 for r in result["throughput"])
    for row in result["memory"]:  # measured bytes are what the calculator predicts
        assert row["deltanet_pool_bytes"] == row["deltanet_pool_bytes_calculator"]
        assert abs(row["softmax_one_session_bytes"] - row["softmax_one_session_bytes_calculator"]) <= 64
    assert result["ttft"]["same_first_token"]
    assert result["arrivals"]["admitted"] > 0 and result["arrivals"]["decoded_tokens"] > 0
