#!/usr/bin/env bash
# The test command: create or refresh ./.venv, install the project with its test extra, run the suite.
# Extra arguments go to pytest (e.g. `bash tests/run.sh tests/library/ops/test_gla.py -x`; `-n 0` runs in one process).
# Two workers (pytest-xdist), one test file at a time each, so a file's module-scoped fixtures are built once:
# the suite is mostly single-threaded XLA compiles and subprocess start-ups, so 2 workers use both cores.
# --no-loadscope-reorder keeps tests/conftest.py's order (slowest files first) instead of xdist's (most tests).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
