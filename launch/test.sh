#!/usr/bin/env bash
# The README's test command: install everything into .venv (idempotent), then run the whole test suite.
# Usage: bash launch/test.sh [pytest args...]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bash "$here/launch/install.sh"
cd "$here"
exec "$here/.venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
