#!/usr/bin/env bash
# The README's test command: set up .venv (idempotent), then run the test suite.
# Extra arguments go to pytest (e.g. `bash scripts/run_tests.sh -m slow`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest "$@"
