"""Measure how far each fast form is from the recurrent reference, in float64.

Prints, for every rule and form, the maximum relative error (‖x − x_ref‖/‖x_ref‖)
of outputs, final states and gradients over the awkward shapes of the test
suite. Usage: ``python -m benchmarks.run form_errors [--json PATH]``.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the test suite's shapes and forms
from helpers import RULES, call, make_inputs, rel_err

from fastweights.config import atomic_write_text, flag

SHAPES = [(2, 1, 2, 8, 8, 16), (2, 63, 2, 60, 20, 16), (1, 100, 3, 16, 24, 32), (2, 257, 2, 12, 10, 64), (3, 100, 1, 60, 60, 64)]


def measure():
    rows = []
    for rule in RULES.values():
        for form in rule.forms[1:]:
            worst = dict(output=0.0, state=0.0, grad=0.0)
            for B, T, H, K, V, C in SHAPES:
                x = make_inputs(rule, B, T, H, K, V, initial_state=True, requires_grad=True)
                o_r, h_r = call(rule.reference, rule, x, output_final_state=True)
                o, h = call(form, rule, x, output_final_state=True, chunk_size=C)
                do, dh = torch.randn_like(o_r), torch.randn_like(h_r)
                leaves = list(x.values())
                g_r = torch.autograd.grad((o_r * do).sum() + (h_r * dh).sum(), leaves)
                g = torch.autograd.grad((o * do).sum() + (h * dh).sum(), leaves)
                worst["output"] = max(worst["output"], rel_err(o, o_r))
                worst["state"] = max(worst["state"], rel_err(h, h_r))
                worst["grad"] = max(worst["grad"], max(rel_err(a, b) for a, b in zip(g, g_r)))
            rows.append(dict(rule=rule.name, form=form.__name__, **worst))
    return rows


@dataclass
class Config:
    json: Optional[str] = field(default=None, metadata=flag(help="also write the rows here"))


def main(config: Config) -> int:
    rows = measure()
    print(f"{'rule':24} {'form':28} {'output':>9} {'state':>9} {'grads':>9}   (max relative error vs recurrent, float64)")
    for r in rows:
        print(f"{r['rule']:24} {r['form']:28} {r['output']:9.1e} {r['state']:9.1e} {r['grad']:9.1e}")
    if config.json:
        atomic_write_text(config.json, json.dumps(rows, indent=2))
    return 0
