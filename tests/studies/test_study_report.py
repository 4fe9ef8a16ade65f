"""Studies lose nothing when something goes wrong late (a failure late in a run): the JSON and CSV are
written before any plot, a missing matplotlib skips the plots with one line, every finished cell is
saved at once, Ctrl-C leaves the partial results, and ``--resume`` continues from them."""

from __future__ import annotations

import json
import sys

import pytest

from fastweights.cli import main as cli_main
from fastweights.studies import mqar
from fastweights.studies._report import CellCache, pyplot, save_figure, save_result

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--d-model", "16", "--cells", "16:2", "--vocab-size", "32", "--lrs", "1e-3", "--seeds", "1", "--short-conv",
        "off", "--max-steps", "3", "--workers", "1", "--quiet"]  # one process: the test counts the calls


def draw(result, out):
    fig = pyplot().figure()
    return [save_figure(fig, out / "figure.png")]


def test_missing_matplotlib_skips_the_plots_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    lines, result = [], {"table": [{"a": 1, "b": 2.5}], "files": []}
    save_result(result, tmp_path, "demo", result["table"], ["a", "b"], draw, log=lines.append)
    print(lines)
    assert json.loads((tmp_path / "demo.json").read_text())["table"] == [{"a": 1, "b": 2.5}]
    assert (tmp_path / "demo.csv").read_text() == "a,b\n1,2.5\n"
    assert len(lines) == 1 and "plots skipped" in lines[0] and "fastweights[plots]" in lines[0]
    assert result["files"] == [str(tmp_path / "demo.csv"), str(tmp_path / "demo.json")]


def test_an_interrupt_while_plotting_leaves_the_numbers(tmp_path):
    def interrupted(result, out):
        raise KeyboardInterrupt

    result = {"table": [{"a": 1}], "files": []}
    with pytest.raises(KeyboardInterrupt):
        save_result(result, tmp_path, "demo", result["table"], ["a"], interrupted)
    assert json.loads((tmp_path / "demo.json").read_text())["table"] == [{"a": 1}]
    assert (tmp_path / "demo.csv").exists()


def test_the_plots_are_listed_once_drawn(tmp_path):
    result = {"table": [], "files": []}
    save_result(result, tmp_path, "demo", [], ["a"], draw)
    assert json.loads((tmp_path / "demo.json").read_text())["files"][-1] == str(tmp_path / "figure.png")


def test_ctrl_c_leaves_the_finished_cells_and_resume_continues_exactly(tmp_path, monkeypatch, capsys):
    """A 3-cell MQAR sweep interrupted in its third cell keeps the first two; --resume trains only
    the third, and the table equals an uninterrupted run's."""
    out = tmp_path / "study"
    real, calls = mqar.train_mqar_model, []

    def interrupt_third(*args):
        calls.append(args[0])
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the third cell
        return real(*args)

    monkeypatch.setattr(mqar, "train_mqar_model", interrupt_third)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["study", "mqar", *TINY, "--mixers", "deltanet", "linear", "gated_deltanet", "--out", str(out)])
    assert exit_info.value.code == 130 and "interrupted" in capsys.readouterr().err
    partial = json.loads((out / "mqar.partial.json").read_text())
    assert len(partial["cells"]) == 2 and not (out / "mqar.json").exists()

    monkeypatch.setattr(mqar, "train_mqar_model", lambda *a: calls.append(a[0]) or real(*a))
    assert cli_main(["study", "mqar", *TINY, "--mixers", "deltanet", "linear", "gated_deltanet", "--out", str(out),
                     "--resume"]) == 0
    assert calls == ["deltanet", "linear", "gated_deltanet", "gated_deltanet"]  # only the missing cell again
    assert not (out / "mqar.partial.json").exists()
    resumed = json.loads((out / "mqar.json").read_text())["table"]
    whole = mqar.run_mqar(mqar.MQARConfig(mixers=("deltanet", "linear", "gated_deltanet"), d_models=(16,),
                                          cells=((16, 2),), vocab_size=32, lrs=(1e-3,), seeds=1, short_conv=(False,),
                                          max_steps=3, workers=1), progress=False)["table"]
    strip = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert strip(resumed) == strip(whole)


def test_resume_refuses_partial_results_of_another_config(tmp_path):
    cache = CellCache(tmp_path, "demo", {"steps": 3}, resume=False)
    assert cache.get((1, "a"), lambda: {"x": (1, 2)}) == {"x": [1, 2]}  # the JSON form, fresh or resumed
    assert CellCache(tmp_path, "demo", {"steps": 3}, resume=True).get((1, "a"), lambda: 1 / 0) == {"x": [1, 2]}
    with pytest.raises(ValueError, match=r"demo.partial.json holds cells computed with another config \(differs in steps\)"):
        CellCache(tmp_path, "demo", {"steps": 4}, resume=True)
    (tmp_path / "demo.partial.json").write_text("[")
    with pytest.raises(ValueError, match="is not a partial result file"):
        CellCache(tmp_path, "demo", {"steps": 3}, resume=True)
