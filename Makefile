# Two commands set up a fresh machine and do the work:
#   make demo   -- the main job on its embedded default
#   make test   -- the test suite
# Both create .venv on first use. torch==2.13.0 is installed before anything
# asks for a bare `torch`: with nothing installed, a bare requirement pulls a
# multi-GB CUDA build.
# make bench runs benchmarks from the checkout (NAMES="chunk_speed lm_speed";
# python -m benchmarks.run --list names them).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow bench setup clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,triton]'
	# test-only oracle of the fla drop-in tests (tests/*/test_fla_*.py); --no-deps keeps the
	# pinned torch. Those tests skip with a reason if this install fails (e.g. offline).
	-$(PY) -m pip install --quiet --no-deps flash-linear-attention==0.6.0 fla-core==0.6.0
	# a peer of the CPU benchmark (benchmarks/cpu_peers.py: Attention Gym's eager reference); optional
	-$(PY) -m pip install --quiet --no-deps attn-gym==0.0.17
	# the compiled CPU kernels, once (about 50 s on 2 cores); without a compiler the PyTorch path runs
	-$(PY) -m fastweights.ops.cpu
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/fastweights examples && $(VENV)/bin/fastweights demo

# The suite in TEST_WORKERS processes (pytest-xdist; default 2, a 2-core machine's count: the
# suite's many single-threaded tests and subprocess waits overlap, 383 s against 664 s serially on
# 2 cores). TEST_WORKERS=0 runs it in one process; "auto" takes one a core.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

NAMES ?= chunk_speed

bench: $(STAMP)
	$(PY) -m benchmarks.run $(NAMES)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
