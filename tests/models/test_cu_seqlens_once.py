"""The LM checks ``cu_seqlens`` once per forward: the offsets are read to the host once, and every
layer's op finds them checked (with their host copy) instead of reading them again."""

import pytest
import torch

from fastweights import ops
from fastweights.models import LM, LMConfig
from fastweights.ops import _checks


@pytest.fixture
def counted(monkeypatch):
    calls = []
    real = _checks._check_offsets
    monkeypatch.setattr(_checks, "_check_offsets", lambda *a: calls.append(a[0]) or real(*a))
    return calls


def test_one_offsets_check_per_lm_forward(counted):
    model = LM(LMConfig(vocab_size=32, d_model=32, n_layers=4, n_heads=2,
                        mixer=["deltanet", "gated_deltanet", "linear", "softmax"]))
    ids = torch.randint(0, 32, (1, 40))
    cu = torch.tensor([0, 10, 25, 40])
    logits, _ = model(ids, cu_seqlens=cu)
    print(f"offsets checks in one forward of a 4-layer hybrid: {counted}")
    assert counted == ["LM"]
    host = ops.checked_cu_seqlens_cpu(cu)
    assert host is not None and host.device.type == "cpu" and host.tolist() == [0, 10, 25, 40]
    separate = torch.cat([model(ids[:, a:b])[0] for a, b in ((0, 10), (10, 25), (25, 40))], dim=1)
    assert torch.allclose(logits, separate, atol=1e-5)


def test_changed_or_new_offsets_are_checked_again(counted):
    x = [torch.randn(1, 12, 2, 8) for _ in range(3)]
    beta = torch.rand(1, 12, 2)
    cu = torch.tensor([0, 5, 12])
    ops.chunk_delta_rule(*x, beta, cu_seqlens=cu)
    ops.chunk_delta_rule(*x, beta, cu_seqlens=cu)
    assert counted == ["chunk_delta_rule"]  # the second call found them checked
    cu[1] = 7  # an in-place change bumps the tensor's version: checked again
    ops.chunk_delta_rule(*x, beta, cu_seqlens=cu)
    assert len(counted) == 2
    cu[1] = 13  # and a bad change is still refused
    with pytest.raises(ValueError, match="`cu_seqlens` must be strictly increasing"):
        ops.chunk_delta_rule(*x, beta, cu_seqlens=cu)
    with pytest.raises(ValueError, match="must end at the sequence length T=11"):
        ops.chunk_delta_rule(*(t[:, :11] for t in x), beta[:, :11], cu_seqlens=torch.tensor([0, 5, 12]))
