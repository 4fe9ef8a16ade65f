"""Long inputs through the chunk form, fed in pieces that carry the state.

The state's energy has an exact mean recursion. With a unit key k drawn at
random (independent of the state), a value entry v ~ N(0, 1) and write
strength β, one delta-rule write changes each state column x (K entries) by

    E‖x'‖² = (1 − E[β(2 − β)] / K) · E‖x‖² + E[β²]

so the per-entry energy ‖h‖²_F / (K·V) settles at E[β²] / E[β(2 − β)]:
1/2 for β ~ U(0, 1), 2 for β ~ U(0, 2), β/(2 − β) for a constant β < 2. At
β = 2 the write is a reflection (I − 2kkᵀ is orthogonal) and the energy grows
like a random walk, 4t/K per entry after t tokens; above 2 it grows
exponentially. ``fastweights/ops/delta_rule/README.md`` ("The range of β") says
the same in words; these tests hold the chunk path to those numbers.
"""

import sys

import pytest
import torch

from fastweights import ops


def stream(beta_of, tokens, piece, K=16, V=16, H=8, seed=0, dtype=torch.float32):
    """Feed ``tokens`` random tokens in pieces; return the mean per-entry energy after each piece."""
    gen = torch.Generator().manual_seed(seed)
    h, energy = None, []
    for _ in range(tokens // piece):
        q, k = (torch.randn(1, piece, H, K, generator=gen, dtype=dtype) for _ in range(2))
        v = torch.randn(1, piece, H, V, generator=gen, dtype=dtype)
        beta = beta_of(torch.rand(1, piece, H, generator=gen, dtype=dtype))
        with torch.no_grad():
            _, h = ops.chunk_delta_rule(q, k, v, beta, qk_norm="l2", initial_state=h, output_final_state=True,
                                        allow_neg_eigval=True)
        energy.append(float(h.double().square().sum((-1, -2)).mean()) / (K * V))
    return energy


def settled(energy):
    return sum(energy[len(energy) // 2:]) / (len(energy) - len(energy) // 2)


@pytest.mark.parametrize(
    "beta_of,theory",
    [
        pytest.param(lambda u: u, 0.5, id="beta~U(0,1)"),
        pytest.param(lambda u: 2 * u, 2.0, id="beta~U(0,2)"),
        pytest.param(lambda u: torch.full_like(u, 1.9), 19.0, id="beta=1.9"),
    ],
)
def test_state_energy_settles_where_the_theory_says(beta_of, theory):
    energy = stream(beta_of, tokens=4096, piece=256)
    late, early = settled(energy), sum(energy[2:8]) / 6
    print(f"per-entry energy by piece: {[round(e, 3) for e in energy]}; settled {late:.3f}, theory {theory}")
    assert abs(late - theory) <= 0.2 * theory
    assert max(energy) <= 1.5 * theory
    assert late <= 1.2 * early  # a plateau, not a slow climb


def test_beta_two_is_a_random_walk():
    """β = 2 reflects: nothing is forgotten, and the energy grows by 4/K per entry per token."""
    energy = stream(lambda u: torch.full_like(u, 2.0), tokens=4096, piece=512)
    print(f"per-entry energy by piece: {[round(e) for e in energy]}; theory 4t/K = {4 * 4096 / 16:.0f} at the end")
    assert abs(energy[-1] - 4 * 4096 / 16) <= 0.15 * 4 * 4096 / 16
    assert energy[-1] > 6 * energy[0]


def test_beta_above_two_diverges_exactly_as_the_recurrence_does():
    """β > 2: eigenvalue 1 − β < −1 along each key; the chunk form follows the recurrence up."""
    gen = torch.Generator().manual_seed(1)
    T, H, K, V = 256, 4, 16, 16
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    beta = torch.full((1, T, H), 2.2, dtype=torch.float64)
    energies = []
    for t in (64, 128, 256):
        args = (q[:, :t], k[:, :t], v[:, :t], beta[:, :t])
        with ops.value_checks(False):  # β = 2.2 is outside [0, 2] on purpose
            _, h = ops.chunk_delta_rule(*args, qk_norm="l2", output_final_state=True, chunk_size=32)
            _, h_ref = ops.recurrent_delta_rule(*args, qk_norm="l2", output_final_state=True)
        assert ((h - h_ref).norm() / h_ref.norm()).item() < 1e-10
        energies.append(float(h.square().sum()) / (H * K * V))
    print(f"per-entry energy after 64, 128, 256 tokens: {energies}")
    assert energies[2] / energies[1] > 5 and energies[1] / energies[0] > 2


@pytest.mark.parametrize("low,high", [(0.0, 1.0), (0.0, 2.0), (1.9, 1.99)], ids=["(0,1)", "(0,2)", "(1.9,1.99)"])
def test_chunk_form_stays_exact_for_beta_up_to_two(low, high):
    """The UT transform needs no β < 1: I + A is unit triangular for any β. In fp32 the chunk
    form's error grows as β → 2 (nothing decays inside a chunk), documented in README.md."""
    gen = torch.Generator().manual_seed(2)
    T, H, K, V = 300, 4, 16, 16
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    beta = low + (high - low) * torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    opts = dict(qk_norm="l2", output_final_state=True, allow_neg_eigval=True)
    o_ref, h_ref = ops.recurrent_delta_rule(q, k, v, beta, **opts)
    o, h = ops.chunk_delta_rule(q, k, v, beta, **opts)
    o32, h32 = ops.chunk_delta_rule(q.float(), k.float(), v.float(), beta.float(), **opts)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    print(f"float64 {rel(o, o_ref):.1e}; fp32 output {rel(o32, o_ref):.1e}, state {rel(h32, h_ref):.1e}")
    assert rel(o, o_ref) < 1e-10 and rel(h, h_ref) < 1e-10
    assert rel(o32, o_ref) < 1e-5 and rel(h32, h_ref) < 1e-5


def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def stream_with_memory(tokens, piece, H, K, V, seed=3):
    """Stream under no_grad; return (final state, outputs of the last piece, resident bytes after each piece)."""
    gen = torch.Generator().manual_seed(seed)
    h, rss, o = None, [], None
    for _ in range(tokens // piece):
        q, k = (torch.randn(1, piece, H, K, generator=gen) for _ in range(2))
        v = torch.randn(1, piece, H, V, generator=gen)
        beta = torch.rand(1, piece, H, generator=gen)
        with torch.no_grad():
            o, h = ops.chunk_delta_rule(q, k, v, beta, qk_norm="l2", initial_state=h, output_final_state=True)
        rss.append(resident_bytes())
    return h, o, rss


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_streaming_in_pieces_equals_one_pass_in_flat_memory():
    """32,768 tokens in 16 pieces: the carried state gives the one-pass result, and memory stays flat."""
    tokens, piece, H, K, V = 32768, 2048, 2, 32, 32
    h, o_last, rss = stream_with_memory(tokens, piece, H, K, V)
    gen = torch.Generator().manual_seed(3)
    parts = [[torch.randn(1, piece, H, K, generator=gen), torch.randn(1, piece, H, K, generator=gen),
              torch.randn(1, piece, H, V, generator=gen), torch.rand(1, piece, H, generator=gen)]
             for _ in range(tokens // piece)]
    whole = [torch.cat([p[i] for p in parts], dim=1) for i in range(4)]
    with torch.no_grad():
        o_all, h_all = ops.chunk_delta_rule(*whole, qk_norm="l2", output_final_state=True)
    err_h = ((h - h_all).norm() / h_all.norm()).item()
    err_o = ((o_last - o_all[:, -piece:]).norm() / o_all[:, -piece:].norm()).item()
    growth = (max(rss[2:]) - rss[1]) / 2**20
    print(f"pieces vs one pass: state {err_h:.1e}, last outputs {err_o:.1e}; resident growth after piece 2: {growth:.1f} MiB")
    assert err_h < 1e-5 and err_o < 1e-5
    assert growth < 16


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_one_million_tokens_in_bounded_memory():
    """The benchmark's long run (``python -m benchmarks.run chunk_speed --long``) as a test: 1,000,000 tokens,
    B = 1, H = 4, K = V = 64, pieces of 15,625; resident memory without a trend, state energy settled."""
    tokens, piece, H, K, V = 1_000_000, 15_625, 4, 64, 64
    h, _, rss = stream_with_memory(tokens, piece, H, K, V)
    half = len(rss) // 2
    first, second = max(rss[:half]) / 2**20, max(rss[half:]) / 2**20
    energy = float(h.double().square().sum((-1, -2)).mean()) / (K * V)
    print(f"1M tokens: peak resident {first:.0f} MiB over the first 500k tokens, {second:.0f} MiB over the last; "
          f"per-entry state energy {energy:.3f} (theory 0.5 for beta ~ U(0, 1))")
    # The resident size swings by a piece's transients (~250 MiB here, allocator-held), but has no trend.
    assert second <= first + 64
    assert abs(energy - 0.5) < 0.25
