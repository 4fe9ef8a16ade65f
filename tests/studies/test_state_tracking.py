"""The state-tracking tasks (group word problems) and study: tables, labels, the study's files,
and — small, in the default run — the β-range separation on parity that the study exists to show."""

import csv
import itertools
import json

import pytest
import torch

from fastweights.studies import get_study
from fastweights.studies.state_tracking import StateTrackingConfig, parse_arm, run_state_tracking, train_state_tracking_model
from fastweights.tasks.state_tracking import TASKS, GroupWordProblem, make_state_tracking_task

ORDERS = {"parity": 2, "mod3": 3, "mod5": 5, "S3": 6, "A4": 12, "S4": 24, "A5": 60, "S5": 120}


@pytest.mark.parametrize("name", list(TASKS))
def test_tables_are_groups_of_the_right_order(name):
    """Closure, identity 0, inverses, associativity (all triples up to order 24, 3000 random ones above)."""
    task = make_state_tracking_task(name)
    t = task.table
    n = t.shape[0]
    assert n == ORDERS[name] == task.vocab_size
    ar = torch.arange(n)
    assert all(torch.equal(t[i].sort().values, ar) for i in range(n))  # each row a permutation (Latin square)
    assert torch.equal(t[0], ar) and torch.equal(t[:, 0], ar)
    assert bool(((t == 0).sum(1) == 1).all())  # one inverse each
    if n <= 24:
        triples = torch.tensor(list(itertools.product(range(n), repeat=3)))
    else:
        triples = torch.randint(0, n, (3000, 3), generator=torch.Generator().manual_seed(0))
    a, b, c = triples.unbind(1)
    assert torch.equal(t[t[a, b], c], t[a, t[b, c]])
    assert task.abelian == (name in ("parity", "mod3", "mod5"))


def test_labels_are_running_products():
    """Parity is the running sum mod 2; mod m the running sum mod m; S3's labels are the composed
    permutations themselves, folded by hand from the elements' tuples."""
    g = torch.Generator().manual_seed(3)
    b = make_state_tracking_task("parity").sample(5, 40, g)
    assert torch.equal(b.targets, b.inputs.cumsum(1) % 2)
    b = make_state_tracking_task("mod5").sample(5, 40, g)
    assert torch.equal(b.targets, b.inputs.cumsum(1) % 5)
    perms = list(itertools.permutations(range(3)))  # element i is perms[i] (lexicographic order)
    b = make_state_tracking_task("S3").sample(4, 30, g)
    for row_in, row_out in zip(b.inputs.tolist(), b.targets.tolist()):
        state = (0, 1, 2)
        for x, y in zip(row_in, row_out):
            state = tuple(perms[x][i] for i in state)  # "state, then x"
            assert perms[y] == state


def test_sampling_is_seeded_and_errors_name_the_argument():
    task = make_state_tracking_task("A4")
    one = task.sample(3, 9, torch.Generator().manual_seed(1))
    two = task.sample(3, 9, torch.Generator().manual_seed(1))
    assert torch.equal(one.inputs, two.inputs) and one.inputs.max() < 12
    with pytest.raises(ValueError, match="`length`"):
        task.sample(3, 0)
    with pytest.raises(ValueError, match="`task`"):
        make_state_tracking_task("S6")
    with pytest.raises(ValueError, match="identity"):
        GroupWordProblem("bad", torch.tensor([[1, 0], [0, 1]]))


def test_arms_parse_and_bad_arms_are_named():
    assert parse_arm("deltaproduct3[0,2]") == {"mixer": "deltaproduct", "n_householder": 3, "beta_range": "[0,2]"}
    assert parse_arm("deltanet[0,1]") == {"mixer": "deltanet", "n_householder": 1, "beta_range": "[0,1]"}
    assert parse_arm("linear") == {"mixer": "linear", "n_householder": None, "beta_range": None}
    for bad, words in (("deltanet", "range"), ("linear[0,2]", "no write strength"), ("deltaproduct[0,2]", "Householder"),
                       ("deltanet3[0,2]", "Householder"), ("mamba[0,1]", "unknown mixer"), ("deltanet[0,3]", "MIXER")):
        with pytest.raises(ValueError, match="`arms`") as e:
            StateTrackingConfig(arms=(bad,))
        assert words in str(e.value)
    with pytest.raises(ValueError, match="`tasks`"):
        StateTrackingConfig(tasks=("S7",))
    with pytest.raises(ValueError, match="`test_lengths`"):
        StateTrackingConfig(test_lengths=(0,))


def test_study_writes_its_contract(tmp_path):
    """A tiny sweep: the JSON has ``train_max_length`` and ``results`` rows with the contract's keys,
    one row per (task, arm, test length); the CSV has the same rows; resume reuses every run."""
    cfg = StateTrackingConfig(tasks=("parity", "S3"), arms=("linear", "deltanet[0,2]"), train_max_length=8,
                              test_lengths=(8, 16), d_model=16, seeds=2, max_steps=3, warmup_steps=1, batch_size=4,
                              test_size=8, workers=1)
    result = run_state_tracking(cfg, out_dir=str(tmp_path), progress=False, plots=False)
    data = json.loads((tmp_path / "state_tracking.json").read_text())
    assert data["train_max_length"] == 8
    assert len(data["results"]) == 2 * 2 * 2
    for row in data["results"]:
        assert {"task", "mixer", "beta_range", "n_householder", "test_length", "seq_accuracy", "seq_accuracy_se",
                "token_accuracy", "seeds"} <= set(row)
        assert 0 <= row["seq_accuracy"] <= row["token_accuracy"] <= 1 and row["seeds"] == 2
    assert {r["beta_range"] for r in data["results"]} == {None, "[0,2]"}
    with open(tmp_path / "state_tracking.csv") as f:
        assert len(list(csv.DictReader(f))) == len(data["results"])
    again = run_state_tracking(cfg, out_dir=str(tmp_path), progress=False, plots=False, resume=True)
    assert again["results"] == result["results"]


def test_study_figures(tmp_path):
    """With plots, the resumed sweep draws the per-task curves and, having two arms, the arm x
    (task, length) grid; both are PNG files the JSON lists."""
    pytest.importorskip("matplotlib")
    cfg = StateTrackingConfig(tasks=("parity", "mod3"), arms=("linear", "deltanet[0,2]"), train_max_length=8,
                              test_lengths=(8, 16), d_model=16, seeds=1, max_steps=2, warmup_steps=1, batch_size=4,
                              test_size=8, workers=1)
    result = run_state_tracking(cfg, out_dir=str(tmp_path), progress=False, plots=True)
    for name in ("state_tracking.png", "state_tracking_grid.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert any(f.endswith(name) for f in result["files"])
    run_state_tracking(StateTrackingConfig(**{**cfg.__dict__, "arms": ("linear",)}),
                       out_dir=str(tmp_path / "one"), progress=False, plots=True)
    assert not (tmp_path / "one" / "state_tracking_grid.png").exists() and (tmp_path / "one" / "state_tracking.png").exists()


def test_study_is_registered_with_quick_and_full():
    module = get_study("state-tracking")
    assert module.Config is StateTrackingConfig
    full = StateTrackingConfig.full()
    assert set(full.tasks) == set(TASKS) and max(full.test_lengths) >= 8 * full.train_max_length
    assert "deltaproduct4[0,2]" in full.arms and "softmax" in full.arms


def test_reflections_track_parity_and_projections_do_not():
    """The study's claim, small: one DeltaNet layer with β ∈ [0, 2] learns parity (every position of every
    sequence right at its training length, 90 % of positions at 4× it after only 400 steps; 300 left it
    at 0.89 on one CPU, as rounding differs per CPU; the quick study's 800 steps reach whole sequences
    there); with β ∈ [0, 1] it stays at chance (no β ≤ 1 step
    can flip a sign)."""
    cfg = StateTrackingConfig(train_max_length=16, test_lengths=(16, 64), max_steps=400, test_size=128, seeds=1, workers=1)
    reflect = train_state_tracking_model("parity", "deltanet[0,2]", cfg, seed=0)["by_length"]
    project = train_state_tracking_model("parity", "deltanet[0,1]", cfg, seed=0)["by_length"]
    print("β in [0,2]:", reflect, "\nβ in [0,1]:", project)
    assert reflect["16"]["seq_accuracy"] >= 0.95 and reflect["64"]["token_accuracy"] >= 0.9
    assert project["16"]["seq_accuracy"] <= 0.05 and project["64"]["token_accuracy"] <= 0.6


@pytest.mark.slow
def test_quick_study_separates_the_beta_ranges_on_parity(tmp_path):
    """The quick default (what ``fastweights study state-tracking --quick`` runs): DeltaNet [0,2] ≥ 0.95
    sequence accuracy at 4× the training length; DeltaNet [0,1] and linear attention near 0."""
    result = run_state_tracking(StateTrackingConfig(), out_dir=str(tmp_path), progress=False)
    at = {r["arm"]: r["seq_accuracy"] for r in result["results"] if r["task"] == "parity" and r["test_length"] == 256}
    print(at)
    assert at["deltanet[0,2]"] >= 0.95 and at["deltanet[0,1]"] <= 0.05 and at["linear"] <= 0.05


def test_length_curriculum_ramps_to_the_training_length():
    """``curriculum_start`` L₀: step 0 trains at L₀, the length grows linearly to ``train_max_length``
    at half of ``max_steps`` and stays; 0 (the default) trains at ``train_max_length`` throughout.
    A start above the training length is refused, naming the argument."""
    from fastweights.studies.state_tracking import training_length

    plain = StateTrackingConfig(train_max_length=64, max_steps=100)
    assert {training_length(s, plain) for s in range(100)} == {64}
    ramp = StateTrackingConfig(train_max_length=64, max_steps=100, curriculum_start=4)
    lengths = [training_length(s, ramp) for s in range(100)]
    print(lengths[:3], lengths[24:27], lengths[48:52])
    assert lengths[0] == 4 and lengths[25] == 34 and lengths[50:] == [64] * 50
    assert all(a <= b for a, b in zip(lengths, lengths[1:]))
    with pytest.raises(ValueError, match="`curriculum_start`"):
        StateTrackingConfig(train_max_length=16, curriculum_start=17)
    with pytest.raises(ValueError, match="`curriculum_start`"):
        StateTrackingConfig(curriculum_start=-1)


def test_flags_build_the_config():
    """The options a longer run needs (layers, width, steps, lr, batch, warm-up, curriculum) come from
    the command line into the config, and ``--full`` keeps them as overrides."""
    from fastweights.cli import build_parser
    from fastweights.studies import state_tracking

    def parse(*flags):
        return state_tracking.config_from_args(build_parser().parse_args(["study", "state-tracking", *flags]))

    assert parse() == StateTrackingConfig()
    got = parse("--tasks", "S3", "--arms", "deltaproduct1[0,2]", "deltaproduct2[0,2]", "--n-layers", "2", "--d-model",
                "64", "--max-steps", "3000", "--lr", "1e-3", "--batch-size", "64", "--warmup-steps", "200",
                "--curriculum-start", "8", "--qk-activation", "identity")
    assert got == StateTrackingConfig(tasks=("S3",), arms=("deltaproduct1[0,2]", "deltaproduct2[0,2]"), n_layers=2,
                                      d_model=64, max_steps=3000, lr=1e-3, batch_size=64, warmup_steps=200,
                                      curriculum_start=8, qk_activation="identity")
    assert parse("--full", "--curriculum-start", "8") == StateTrackingConfig.full(curriculum_start=8)
    from fastweights.studies.state_tracking import build_model

    model = build_model("S3", "deltaproduct2[0,2]", got)  # the activation reaches the layers
    assert model.config.qk_activation == "identity" and model.config.n_layers == 2 and model.config.d_model == 64


def test_curriculum_run_keeps_the_contract(tmp_path):
    """A tiny two-layer run with the curriculum: the JSON contract is the same, and the curriculum
    changes what is trained (another final loss than the same run without it)."""
    base = dict(tasks=("S3",), arms=("deltaproduct2[0,2]",), train_max_length=12, test_lengths=(12, 24), d_model=16,
                n_layers=2, seeds=1, max_steps=6, warmup_steps=2, batch_size=4, test_size=8, workers=1)
    with_ramp = run_state_tracking(StateTrackingConfig(**base, curriculum_start=2), out_dir=str(tmp_path),
                                   progress=False, plots=False)
    without = run_state_tracking(StateTrackingConfig(**base), progress=False, plots=False)
    data = json.loads((tmp_path / "state_tracking.json").read_text())
    assert data["train_max_length"] == 12 and data["config"]["curriculum_start"] == 2
    for row in data["results"]:
        assert {"task", "mixer", "beta_range", "n_householder", "test_length", "seq_accuracy", "seq_accuracy_se",
                "token_accuracy", "seeds"} <= set(row)
        assert row["n_householder"] == 2 and row["beta_range"] == "[0,2]"
    assert with_ramp["runs"][0]["train_loss"] != without["runs"][0]["train_loss"]
