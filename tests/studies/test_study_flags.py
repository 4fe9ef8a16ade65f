"""The studies' flags come from their config dataclasses (``fastweights.config.flag``): each flag
combination must build the same config as the study's constructor would with those settings."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from fastweights.cli import build_parser
from fastweights.config import NESTED_FLAGS, add_declared_arguments, config_from_declared, flag
from fastweights.studies import capacity, costs, mqar, retrieval
from fastweights.studies.capacity import CapacityConfig
from fastweights.studies.costs import CostsConfig
from fastweights.studies.mqar import LRS, MQARConfig
from fastweights.studies.retrieval import MemoryTrainConfig, RetrievalConfig


def parse(study, *flags):
    module = {"capacity": capacity, "costs": costs, "retrieval": retrieval, "mqar": mqar}[study]
    return module.config_from_args(build_parser().parse_args(["study", study, *flags]))


def test_capacity_flags():
    assert parse("capacity") == CapacityConfig()
    assert parse("capacity", "--full") == CapacityConfig.full()
    assert parse("capacity", "--branch", "dev1", "--repetitions", "5", "--gamma", "0.9", "--root-seed", "3") == \
        CapacityConfig(branch="dev1", repetitions=5, gamma=0.9, root_seed=3)
    assert parse("capacity", "--widths", "4", "8") == CapacityConfig(sweep_widths=(4, 8))
    assert parse("capacity", "--full", "--widths", "16") == CapacityConfig.full(sweep_widths=(16,))


def test_costs_flags():
    assert parse("costs") == CostsConfig()
    assert parse("costs", "--full") == CostsConfig.full()
    # --value-dim follows --head-dim unless given (0 also means "the head dim", as before)
    assert parse("costs", "--head-dim", "64") == CostsConfig(head_dim_k=64, head_dim_v=64)
    assert parse("costs", "--head-dim", "64", "--value-dim", "32") == CostsConfig(head_dim_k=64, head_dim_v=32)
    assert parse("costs", "--value-dim", "96") == CostsConfig(head_dim_v=96)
    assert parse("costs", "--value-dim", "0") == CostsConfig()
    got = parse("costs", "--dtype", "float16", "--weights", "--d-model", "512", "--d-ff", "1024",
                "--vocab-size", "100", "--weight-dtype", "float32")
    assert got == CostsConfig(kv_dtype="float16", weights=True, d_model=512, d_ff=1024, vocab_size=100,
                              weight_dtype="float32")
    assert got.state_dtype == "float16"  # the state follows the KV cache's dtype unless --state-dtype
    assert parse("costs", "--layers", "4", "--heads", "2", "--softmax-layers", "0", "--budget-gib", "1.5",
                 "--state-dtype", "float32") == \
        CostsConfig(layers=4, heads=2, softmax_layers=0, budget_gib=1.5, state_dtype="float32")


def test_retrieval_flags():
    assert parse("retrieval") == RetrievalConfig()
    assert parse("retrieval", "--full") == RetrievalConfig.full()
    assert parse("retrieval", "--d-key", "16", "--max-steps", "10", "--seeds", "2", "--threads", "2") == \
        RetrievalConfig(train=MemoryTrainConfig(d_key=16, max_steps=10), seeds=2, threads=2)
    full = RetrievalConfig.full()
    got = parse("retrieval", "--full", "--projections", "tied", "--d-key", "8")
    assert got.train == MemoryTrainConfig(**{**vars(full.train), "projections": "tied", "d_key": 8})
    assert got.sizes == full.sizes and got.threads is None  # the rest of --full stands


def test_mqar_flags():
    assert parse("mqar") == MQARConfig()
    assert parse("mqar", "--full") == MQARConfig.full()
    assert parse("mqar", "--d-model", "32", "64", "--mixers", "deltanet", "softmax", "--short-conv", "both") == \
        MQARConfig(d_models=(32, 64), mixers=("deltanet", "softmax"), short_conv=(False, True))
    assert parse("mqar", "--short-conv", "off", "--cells", "64:4", "128:8") == \
        MQARConfig(short_conv=(False,), cells=((64, 4), (128, 8)))
    assert parse("mqar", "--vocab-size", "256", "--lrs", "0.01", "0.001", "--seeds", "1", "--max-steps", "5",
                 "--threads", "2", "--workers", "1", "--patience", "0") == \
        MQARConfig(vocab_size=256, lrs=(0.01, 0.001), seeds=1, max_steps=5, threads=2, workers=1, patience=None)
    got = parse("mqar", "--full", "--patience", "7", "--short-conv", "on")
    assert got == MQARConfig.full(patience=7, short_conv=(True,)) and got.lrs == LRS


# study, its flags => what the one line must name. Unparsable values get argparse's line (exit
# code 2); parsed but refused ones one ValueError line (the study command prints it and exits).
BAD_VALUES = """
capacity --gamma x => argument --gamma:
capacity --branch nope => argument --branch:
costs --dtype int3 => argument --dtype:
costs --head-dim x => argument --head-dim:
retrieval --projections x => argument --projections:
mqar --short-conv maybe => argument --short-conv:
mqar --d-model -4 => argument --d-model:
mqar --cells 12 => `--cells`
mqar --cells a:b => `--cells`
capacity --widths 0 => `sweep_widths`
costs --layers 0 => `layers`
retrieval --d-key 0 => `d_key`
""".strip().splitlines()


@pytest.mark.parametrize("row", BAD_VALUES)
def test_bad_values_are_one_line_naming_the_flag(row, capsys):
    command, names = row.split(" => ")
    study, *flags = command.split()
    try:
        parse(study, *flags)
    except SystemExit as e:
        assert e.code == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
    except ValueError as e:
        line = str(e)
        assert "\n" not in line
    else:
        pytest.fail(f"{study} {flags} was accepted")
    assert names in line


def test_declared_flags_generator():
    """The generator on its own: renamed flags, a parser, a derived default, a nested config, order."""

    @dataclass
    class Inner:
        width: int = field(default=8, metadata=flag(type=int, help="inner width"))
        depth: int = 2

    @dataclass
    class Outer:
        keys: int = field(default=4, metadata=flag("--k", type=int, help="keys"))
        values: int = field(default=4, metadata=flag("--v", type=int, default_from="keys", help="values"))
        names: tuple = field(default=("a",), metadata=flag(nargs="+", parse=tuple, help="names"))
        inner: Inner = field(default_factory=Inner, metadata=NESTED_FLAGS)
        seed: int = 0

    parser = argparse.ArgumentParser()
    add_declared_arguments(parser, Outer, order=("inner.width",))
    assert [a.option_strings[0] for a in parser._actions[1:]] == ["--width", "--k", "--v", "--names"]
    build = lambda *a, **fixed: config_from_declared(parser.parse_args(list(a)), Outer, **fixed)
    assert build() == Outer()
    assert build("--k", "6") == Outer(keys=6, values=6)
    assert build("--k", "6", "--v", "3", "--names", "x", "y") == Outer(keys=6, values=3, names=("x", "y"))
    assert build("--width", "16", seed=5) == Outer(inner=Inner(width=16), seed=5)
    preset = lambda **kw: Outer(**{"inner": Inner(depth=9), **kw})
    assert config_from_declared(parser.parse_args(["--width", "3"]), Outer, preset) == Outer(inner=Inner(width=3, depth=9))
