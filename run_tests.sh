#!/usr/bin/env bash
# The test suite on a fresh machine: bootstrap (venv + requirements + default model, cached), then pytest.
#   ./run_tests.sh                 # everything (about 17 minutes on 2 CPU cores)
#   ./run_tests.sh -k tree -x      # any pytest arguments
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
PY="$(bash scripts/bootstrap.sh)"
"$PY" -m model.default_model >/dev/null
exec "$PY" -m pytest -q -ra "$@" tests
