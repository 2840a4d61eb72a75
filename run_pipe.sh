#!/usr/bin/env bash
# One command on a fresh machine: bootstrap (venv + requirements + default model split, all cached),
# then decode through a local torchrun pipeline (rank 0 = draft + lm_head, ranks 1..N = layer blocks).
#
#   ./run_pipe.sh                                   # default SmolLM2 pipeline, 5 ranks, mode=continuous (FlowSpec)
#   ./run_pipe.sh --prompt "Write a haiku about rivers." max_new_tokens=64
#   ./run_pipe.sh --modes ar,naive --prompts-file q.jsonl --begin 0 --end 5 --output out.jsonl
#   ./run_pipe.sh model.stage_dir=/path/stages model.head_dir=/path/eagle_head max_new_tokens=256
#
# Every argument is passed to `python -m pipeline.run` (see `./run_pipe.sh --help`): config overrides
# key=value (config/run_config.py) and the options --prompt, --prompts-file, --modes, --output, ...
# The number of processes follows the stage root's manifest (set NPROC to force it). ENTRY=pipeline.serve runs
# the HTTP server's entry instead (run_serve.sh does that).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
ENTRY="${ENTRY:-pipeline.run}"
export FLOWSPEC_PROG="${FLOWSPEC_PROG:-$ENTRY=./run_pipe.sh}"   # usage lines name this script (config/invocation.py)
for a in "$@"; do  # --help and --print-config need no bootstrap: the venv's python when there is one, else python3 (no torch needed)
  case "$a" in
    -h|--help|--print-config)
      HPY="${FLOWSPEC_VENV:-$ROOT/.venv}/bin/python"; [[ -x "$HPY" ]] || HPY="${PYTHON:-python3}"
      [[ "$a" == --print-config ]] && exec "$HPY" -m pipeline.run "$@"
      exec "$HPY" -m "$ENTRY" --help ;;
  esac
done
PY="$(bash scripts/bootstrap.sh)"

stage_dir=""
for a in "$@"; do
  case "$a" in
    model.stage_dir=*|stage_dir=*) stage_dir="${a#*=}" ;;
  esac
done
if [[ -z "$stage_dir" ]]; then
  stage_dir="$("$PY" -m model.default_model | tail -n 1)"
fi
if [[ -z "${NPROC:-}" ]]; then
  nproc="$("$PY" -m model.stage_format "$stage_dir" --world)" || exit 2
else
  nproc="$NPROC"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# pipeline.tools.launch: checks the arguments once, starts the ranks (torchrun's options, not its agent); a lost rank
# is named by every survivor and by the launcher's summary line, and no rank outlives the launcher.
exec "$PY" -m pipeline.tools.launch --standalone --nproc_per_node="$nproc" -m "$ENTRY" "$@"
