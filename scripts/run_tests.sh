#!/usr/bin/env bash
# The README's test command: set up .venv (idempotent), then run the test suite.
# Extra arguments go to pytest (e.g. `bash scripts/run_tests.sh -m slow`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# a worker a core (pytest-xdist), each test file whole in one worker (its module fixtures made once);
# PYTEST_WORKERS=0 runs the tests in pytest's own process, PYTEST_WORKERS=N in N workers
exec "$ROOT/.venv/bin/python" -m pytest -n "${PYTEST_WORKERS:-auto}" --dist loadfile "$@"
