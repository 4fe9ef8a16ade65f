"""The capacity study (docs/worked_examples.md §5): its claims, its seeds and its files, on small runs."""

import json

import numpy as np
import pytest
import torch

from fastweights.ops import chunk_delta_rule
from fastweights.studies.capacity import (
    PUBLISHED_HEADLINE,
    CapacityConfig,
    draw_cell,
    read_outs,
    recursive_least_squares,
    run_capacity,
    score_cell,
    weighted_least_squares,
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def small(**overrides):
    settings = dict(repetitions=8, dims=(8, 16), sweep_widths=(), loads=(0.5, 1, 2, 4, 8))
    settings.update(overrides)
    return CapacityConfig(**settings)


@pytest.fixture(scope="module")
def grid():
    """Recall of every arm on a small grid (8 repetitions, d = 8 and 16)."""
    config = small()
    return config, {(d, load): score_cell(config, d, load, config.arms) for d in config.dims for load in config.loads}


def test_softmax_keeps_perfect_top1(grid):
    config, scores = grid
    worst = min(float(s["softmax"]["overall"].min()) for s in scores.values())
    print("softmax: worst per-trial top-1 recall", worst)
    assert worst == 1.0


def test_delta_recall_falls_as_load_grows(grid):
    config, scores = grid
    for d in config.dims:
        curve = [float(scores[(d, load)]["delta"]["overall"].mean()) for load in config.loads]
        print(f"delta recall at d={d}:", np.round(curve, 3))
        assert all(a > b for a, b in zip(curve, curve[1:])), curve
        assert curve[0] > 0.9 and curve[-1] < 0.3


def test_gate_trades_ordinary_for_priority_recall(grid):
    config, scores = grid
    for d in config.dims:
        for load in (4, 8):
            s = scores[(d, load)]
            gain = s["selective"]["priority"].mean() - s["delta"]["priority"].mean()
            loss = s["delta"]["ordinary"].mean() - s["selective"]["ordinary"].mean()
            moved = abs(s["selective"]["overall"].mean() - s["delta"]["overall"].mean())
            print(f"d={d} N/d={load}: priority gain {gain:+.3f}, ordinary loss {loss:.3f}, overall moved {moved:.3f}")
            assert gain > 0.15 and loss > 0.05
            if load == 8:
                assert moved < 0.05  # "total recall barely moves"


def test_headline_is_close_to_the_reference():
    """The frozen protocol (30 repetitions, d = 8/16/32) on the held-out branch, protocol arms only."""
    config = CapacityConfig(arms=("delta", "selective"), sweep_widths=())
    result = run_capacity(config, progress=False)
    h = result["headline"]
    for name, published in PUBLISHED_HEADLINE.items():
        print(f"{name}: ours {h[name]['mean']:.3f} ± {h[name]['se']:.3f}, reference {published}")
        assert abs(h[name]["mean"] - published) < max(0.03, 4 * h[name]["se"])


def test_rls_equals_direct_weighted_least_squares():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 23, 6, generator=gen, dtype=torch.float64)
    values = torch.randn(3, 23, 5, generator=gen, dtype=torch.float64)
    for gamma, ridge in ((1.0, 1e-3), (0.9, 1e-2), (0.97, 0.5)):
        h_rls = recursive_least_squares(keys, values, gamma, ridge)
        h_direct = weighted_least_squares(keys, values, gamma, ridge)
        err = ((h_rls - h_direct).norm() / h_direct.norm()).item()
        print(f"γ={gamma} λ={ridge}: relative error of RLS against the direct solve {err:.2e}")
        assert err < 1e-9


def test_rls_interpolates_below_capacity_and_beats_delta_at_load_2(grid):
    config, scores = grid
    for d in config.dims:
        assert scores[(d, 1)]["rls"]["overall"].min() == 1.0  # N <= d: exact fit, every pair identified
        rls, delta = scores[(d, 2)]["rls"]["overall"].mean(), scores[(d, 2)]["delta"]["overall"].mean()
        print(f"d={d}, N/d=2: RLS {rls:.3f} vs delta {delta:.3f}")
        assert rls > delta + 0.1


def test_reads_write_nothing():
    """The read tokens (β = 0) return the final write state applied to each key."""
    config = small(repetitions=4)
    cell = draw_cell(config, 8, 2)
    keys, values = cell["keys"], cell["values"]
    r, n, _ = keys.shape
    beta = torch.full((r, n, 1), config.eta, dtype=torch.float64)
    _, h = chunk_delta_rule(keys[:, :, None], keys[:, :, None], values[:, :, None], beta, scale=1.0,
                            output_final_state=True)
    expected = torch.einsum("rkv,rnk->rnv", h[:, 0], keys)
    torch.testing.assert_close(read_outs("delta", cell, config), expected, rtol=1e-12, atol=1e-12)


def test_softmax_zero_rows_keep_the_read_direction():
    config = small(repetitions=3, softmax_scale=2.0)  # a soft temperature, so the read is a real mixture
    cell = draw_cell(config, 8, 2)
    read = read_outs("softmax", cell, config)
    weights = torch.softmax(2.0 * torch.einsum("rnk,rmk->rnm", cell["keys"], cell["keys"]), dim=-1)
    direct = torch.einsum("rnm,rmv->rnv", weights, cell["values"])
    cos = torch.nn.functional.cosine_similarity(read, direct, dim=-1)
    assert cos.min().item() > 1 - 1e-12


def test_branches_are_disjoint_and_deterministic():
    cells = {b: draw_cell(small(branch=b), 8, 1) for b in ("dev1", "dev2", "heldout")}
    again = draw_cell(small(branch="dev1"), 8, 1)
    assert torch.equal(cells["dev1"]["keys"], again["keys"]) and torch.equal(cells["dev1"]["priority"], again["priority"])
    for a, b in (("dev1", "dev2"), ("dev1", "heldout"), ("dev2", "heldout")):
        assert not torch.allclose(cells[a]["keys"], cells[b]["keys"])
    other_root = draw_cell(small(root_seed=1), 8, 1)
    assert not torch.allclose(other_root["keys"], cells["heldout"]["keys"])
    # Adding widths never moves another cell's numbers.
    assert torch.equal(draw_cell(small(sweep_widths=(4, 32)), 8, 1)["keys"], cells["heldout"]["keys"])


def test_priority_count_and_shared_data():
    config = small(repetitions=5)
    cell = draw_cell(config, 16, 2)  # N = 32 -> 8 priority pairs per trial
    assert cell["priority"].sum(1).tolist() == [8] * 5
    assert torch.allclose(cell["keys"].norm(dim=-1), torch.ones(5, 32, dtype=torch.float64))


@pytest.mark.parametrize("bad, match", [
    (dict(branch="test"), "branch"),
    (dict(eta=0.0), "eta"),
    (dict(gamma=1.5), "gamma"),
    (dict(arms=("delta", "selective", "lstm")), "arms"),
    (dict(headline_load=3), "headline_load"),
    (dict(dims=(0,)), "dims"),
    (dict(repetitions=1), "repetitions"),
])
def test_bad_config_names_the_argument(bad, match):
    with pytest.raises(ValueError, match=match):
        CapacityConfig(**bad)


def test_rls_bad_input():
    with pytest.raises(ValueError, match="gamma"):
        recursive_least_squares(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), gamma=0.0)
    with pytest.raises(ValueError, match="keys"):
        recursive_least_squares(torch.zeros(1, 2, 3), torch.zeros(1, 4, 3))


def test_files_written(tmp_path):
    config = small(repetitions=3, dims=(8,), sweep_widths=(4, 8, 16, 32, 64), loads=(1, 8), headline_load=8)
    result = run_capacity(config, out_dir=tmp_path, progress=False)
    saved = json.loads((tmp_path / "capacity.json").read_text())
    assert set(PUBLISHED_HEADLINE) <= set(saved["headline"])
    assert saved["headline"]["priority_gain"]["published"] == 0.387
    assert len(saved["table"]) == 5 * 2 * len(config.arms)
    assert (tmp_path / "capacity.csv").read_text().startswith("d,load,N,arm,recall")
    for name in ("capacity_recall.png", "capacity_widths.png"):
        assert (tmp_path / name).stat().st_size > 1000
    assert result["width_sweep"]["widths"] == [4, 8, 16, 32, 64]


def test_command_line(tmp_path, capsys):
    from fastweights.cli import main

    assert main(["study", "capacity", "--repetitions", "2", "--widths", "4", "--out", str(tmp_path), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "priority_gain" in printed and "0.387" in printed
    saved = json.loads((tmp_path / "capacity.json").read_text())
    assert saved["config"]["branch"] == "heldout" and saved["config"]["repetitions"] == 2
    with pytest.raises(SystemExit):
        main(["study", "capacity", "--branch", "test"])
    with pytest.raises(SystemExit):
        main(["study", "attention"])


def test_unknown_study_names_the_argument():
    from fastweights.studies import STUDIES, get_study

    with pytest.raises(ValueError, match="study"):
        get_study("attention")
    for name in STUDIES:  # every study module has the command-line interface
        module = get_study(name)
        assert all(hasattr(module, a) for a in ("HELP", "Config", "run", "report", "add_arguments", "config_from_args"))
