#!/usr/bin/env bash
# The package as a user gets it. Builds the wheel and the sdist from the checkout's tracked files,
# installs the wheel into a fresh virtual environment (not editable; torch from the same pin as
# `make setup`) and, from a folder outside the source tree, checks:
#   - `python -m fastweights.ops.cpu` builds the kernels from the installed sources (cold cache)
#     and the chunk ops take the compiled path;
#   - `fastweights examples` passes; `fastweights lab` serves its page; `fastweights train` runs 2 steps;
#   - no benchmark code is installed, and `fastweights bench` says where the benchmarks are.
# Then the same with the sdist installed in place of the wheel (pip builds it as a user's pip would),
# reusing the kernel cache (warm: nothing is compiled again).
# Usage: .ci/install_check.sh            (PYTHON picks the interpreter, default python3)
# KEEP=1 keeps the work folder for a look afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastweights-install-check.XXXXXX")
LAB_PID=
cleanup() {
    if [ -n "$LAB_PID" ]; then kill "$LAB_PID" 2>/dev/null || true; fi
    if [ "${KEEP:-0}" = 1 ]; then echo "install check: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
# A cache of its own: the first install must build from the sources it ships, not find the
# checkout's build; the second install reuses what the first built.
export FASTWEIGHTS_CACHE="$WORK/cache"
export PIP_DISABLE_PIP_VERSION_CHECK=1
t_all=$SECONDS
say() { echo "install check: $*"; }

# 1. the distributions, from the tracked files only (what a clean clone has)
mkdir -p "$WORK/src" "$WORK/dist" "$WORK/away"
if git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "$ROOT" ls-files -z | tar --null -T - -cf - | tar -xf - -C "$WORK/src"
else
    cp -r pyproject.toml README.md LICENSE fastweights "$WORK/src/"
fi
VENV="$WORK/venv"
t=$SECONDS
"$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install --quiet torch==2.13.0 "setuptools>=77"
say "fresh venv with torch==2.13.0 in $((SECONDS - t)) s"
t=$SECONDS
for hook in build_wheel build_sdist; do  # setuptools' PEP 517 hooks, one process each, as pip calls them
    (cd "$WORK/src" && "$PY" -c "import sys; from setuptools import build_meta as b; b.$hook(sys.argv[1])" "$WORK/dist" >/dev/null)
done
WHEEL=$(ls "$WORK"/dist/*.whl)
SDIST=$(ls "$WORK"/dist/*.tar.gz)
say "built $(basename "$WHEEL") ($(du -k "$WHEEL" | cut -f1) KB) and $(basename "$SDIST") ($(du -k "$SDIST" | cut -f1) KB) in $((SECONDS - t)) s"

check_install() {  # $1: what was installed (for the messages)
    local what=$1 out t
    cd "$WORK/away"  # nothing of the checkout on the path
    "$PY" - <<'EOF'
import fastweights, os, sys
here = os.path.dirname(fastweights.__file__)
assert "site-packages" in here and not os.path.exists(os.path.join(here, "..", ".git")), f"not the installed copy: {here}"
print(f"install check: fastweights {fastweights.__version__} from {here}")
EOF
    t=$SECONDS
    out=$("$PY" -m fastweights.ops.cpu 2>&1) || { echo "$out"; say "$what: python -m fastweights.ops.cpu failed"; return 1; }
    echo "$out"
    say "$what: python -m fastweights.ops.cpu took $((SECONDS - t)) s"
    for op in "chunk_delta_rule (forward + backward)" "chunk_gated_delta_rule (forward + backward)"; do
        grep -F "$op" <<<"$out" | grep -q "compiled (chunk_delta_bwd, chunk_delta_fwd)" \
            || { say "$what: $op does not take the compiled path"; return 1; }
    done
    t=$SECONDS
    "$VENV/bin/fastweights" examples >"$WORK/examples.log" 2>&1 || { tail -n 30 "$WORK/examples.log"; say "$what: fastweights examples failed"; return 1; }
    say "$what: fastweights examples passed ($((SECONDS - t)) s)"
    "$VENV/bin/fastweights" lab --port 0 >"$WORK/lab.log" 2>&1 &
    LAB_PID=$!
    "$PY" - "$WORK/lab.log" <<'EOF' || { cat "$WORK/lab.log"; say "$what: fastweights lab did not serve its page"; return 1; }
import re, sys, time, urllib.request
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    m = re.search(r"http://[\w.\-]+:\d+/?", open(sys.argv[1]).read())
    if m:
        break
    time.sleep(0.2)
else:
    sys.exit("no URL printed")
with urllib.request.urlopen(m.group(0), timeout=30) as r:
    page = r.read().decode()
    assert r.status == 200 and "<html" in page.lower() and "lab.js" in page, page[:300]
print(f"install check: fastweights lab served {len(page)} bytes at {m.group(0)}")
EOF
    kill "$LAB_PID"; wait "$LAB_PID" 2>/dev/null || true; LAB_PID=
    t=$SECONDS
    "$VENV/bin/fastweights" train --steps 2 --eval-every 2 --out "$WORK/away/run-$what" >"$WORK/train.log" 2>&1 \
        || { tail -n 30 "$WORK/train.log"; say "$what: fastweights train failed"; return 1; }
    say "$what: fastweights train ran 2 steps ($((SECONDS - t)) s)"
    # the benchmarks stay in the checkout: none installed, and `fastweights bench` says where they are
    if "$PY" -c "import benchmarks" 2>/dev/null; then say "$what: a benchmarks package was installed"; return 1; fi
    if out=$("$VENV/bin/fastweights" bench 2>&1); then say "$what: fastweights bench ran without the benchmarks"; return 1; fi
    grep -q "not part of the installed package" <<<"$out" || { echo "$out"; say "$what: fastweights bench did not say where the benchmarks are"; return 1; }
    say "$what: no benchmark code installed; fastweights bench points at the checkout"
    cd "$ROOT"
}

t=$SECONDS
"$PY" -m pip install --quiet "$WHEEL"
say "installed the wheel in $((SECONDS - t)) s"
check_install wheel
t=$SECONDS
"$PY" -m pip install --quiet --force-reinstall --no-deps "$SDIST"
say "installed the sdist (built by pip) in $((SECONDS - t)) s"
check_install sdist
[ "$(ls "$FASTWEIGHTS_CACHE/cpu_kernels" | wc -l)" = 1 ] || { say "the two installs did not share one cache entry"; exit 1; }
say "passed in $((SECONDS - t_all)) s"
