#!/usr/bin/env bash
# Serve the pipeline over HTTP: bootstrap (as run_pipe.sh), then rank 0 answers OpenAI-style requests.
#
#   ./run_serve.sh                                     # default SmolLM2 pipeline, 5 ranks, http://127.0.0.1:8000/
#   ./run_serve.sh mode=continuous --port 8001 --queue-size 8
#   ./run_serve.sh model.stage_dir=/path/stages --host 0.0.0.0 --port 8000   # reachable from the LAN
#
# Every argument goes to `python -m pipeline.serve` (see `./run_serve.sh --help`): config overrides
# key=value (config/run_config.py; mode= is the default mode of requests) and --host, --port,
# --queue-size, --modes, --template, --model-name, --warmup, --access-log.
# Several machines: set NODE_RANK/NNODES/MASTER_ADDR/STAGE_DIR as for run_jetson.sh and run this script on
# every host; it then hands over to run_jetson.sh with ENTRY=pipeline.serve (host 0 serves HTTP).
# The number of local processes follows the stage root's manifest (set NPROC to force it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
for a in "$@"; do
  case "$a" in -h|--help) PY="$(bash scripts/bootstrap.sh)"; exec "$PY" -m pipeline.serve --help ;; esac
done
if [[ -n "${NODE_RANK:-}" ]]; then
  ENTRY=pipeline.serve exec "$ROOT/run_jetson.sh" "$@"
fi
PY="$(bash scripts/bootstrap.sh)"
stage_dir=""
for a in "$@"; do
  case "$a" in model.stage_dir=*|stage_dir=*) stage_dir="${a#*=}" ;; esac
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
exec "$PY" -m pipeline.launch --standalone --nproc_per_node="$nproc" -m pipeline.serve "$@"
