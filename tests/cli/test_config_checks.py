"""``fastweights.config.check_int``: the one integer check every config, task and op uses."""

import subprocess

import numpy as np
import pytest

from fastweights.config import check_int, check_ints, is_int


def test_ints_pass_and_bools_floats_and_small_values_do_not():
    assert is_int(3) and is_int(np.int64(3)) and not is_int(True) and not is_int(3.0)
    check_int("X", "n", 1)
    check_int("X", "n", 0, minimum=0)
    check_int("X", "n", None, none_ok=True)
    for bad, message in [(0, r"X: `n` must be a positive int, got 0"), (True, r"got True"), (2.0, r"got 2.0"),
                         (None, r"got None"), ("3", r"got '3'")]:
        with pytest.raises(ValueError, match=message):
            check_int("X", "n", bad)
    with pytest.raises(ValueError, match=r"^`seed` must be an int >= 0, got -1$"):
        check_int("", "seed", -1, minimum=0)
    with pytest.raises(TypeError, match=r"op: `m` must be a positive int or None, got 0"):
        check_int("op", "m", 0, none_ok=True, error=TypeError)
    with pytest.raises(ValueError, match=r"C: `widths` must hold positive ints, got \(4, 0\)"):
        check_ints("C", "widths", (4, 0))


def test_no_module_spells_the_integer_check_out_again():
    """The hand-written ``isinstance(x, bool) or not isinstance(x, int) ...`` test lives only in check_int."""
    found = subprocess.run(["git", "grep", "-nE", r"isinstance\([^)]*, bool\) or not isinstance\([^)]*, int\)", "--", "fastweights"],
                           capture_output=True, text=True).stdout.splitlines()
    leftover = [line for line in found if "(int, float)" not in line and "lab/params.py" not in line and "ops/_checks.py" not in line]
    assert leftover == []
