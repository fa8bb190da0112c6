#!/usr/bin/env bash
# The test command: create or refresh ./.venv, install the project with its test extra, run the suite.
# Extra arguments go to pytest (e.g. `bash tests/run.sh tests/test_gla.py -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
exec .venv/bin/python -m pytest "$@"
