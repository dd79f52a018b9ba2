#!/usr/bin/env bash
# The README's main command: set up .venv (idempotent), then run the CPU demonstration.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" scripts/demo_attention.py "$@"
