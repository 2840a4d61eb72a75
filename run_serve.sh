#!/usr/bin/env bash
# Serve the pipeline over HTTP: bootstrap (as run_pipe.sh), then rank 0 answers OpenAI-style requests.
#
#   ./run_serve.sh                                     # default SmolLM2 pipeline, 5 ranks, http://127.0.0.1:8000/
#   ./run_serve.sh mode=continuous --port 8001 --queue-size 8
#   ./run_serve.sh model.stage_dir=/path/stages --host 0.0.0.0 --port 8000   # reachable from the LAN
#
# Every argument goes to `python -m pipeline.serve` (see `./run_serve.sh --help`): config overrides
# key=value (config/run_config.py; mode= is the default mode of requests) and --host, --port,
# --queue-size, --modes, --template, --model-name, --warmup, --access-log, --max-body-bytes (1 MiB: HTTP 413 above),
# --max-prompt-chars, --stop-grace-s (SIGTERM finishes the request in flight within it; a second signal or
# Ctrl-C stops at once). A bad flag is one line before any rank starts. Failures: docs/failures.md.
# Several machines: set NODE_RANK/NNODES/MASTER_ADDR/STAGE_DIR as for run_jetson.sh and run this script on
# every host; it then hands over to run_jetson.sh with ENTRY=pipeline.serve (host 0 serves HTTP).
# The number of local processes follows the stage root's manifest (set NPROC to force it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export FLOWSPEC_PROG="${FLOWSPEC_PROG:-pipeline.serve=./run_serve.sh}"   # usage lines name this script (config/invocation.py)
for a in "$@"; do  # help needs no bootstrap (run_pipe.sh's rule)
  case "$a" in -h|--help) ENTRY=pipeline.serve exec "$ROOT/run_pipe.sh" --help ;; esac
done
if [[ -n "${NODE_RANK:-}" ]]; then
  ENTRY=pipeline.serve exec "$ROOT/run_jetson.sh" "$@"
fi
# one host: run_pipe.sh's bootstrap, default stages and process count, with the server's entry point
ENTRY=pipeline.serve exec "$ROOT/run_pipe.sh" "$@"
