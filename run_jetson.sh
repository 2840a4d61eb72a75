#!/usr/bin/env bash
# Multi-node launcher: one rank per host (Jetson boards or servers), over TCP with gloo (or NCCL).
#
# Run the same command on every host, each with its own NODE_RANK (0 = the draft host):
#   NODE_RANK=0 NNODES=5 MASTER_ADDR=192.168.1.10 MASTER_PORT=29500 IFACE=eth0 \
#     STAGE_DIR=/data/stages_0+8+8+8+8 ./run_jetson.sh mode=continuous --prompt "Hello"
#   NODE_RANK=1 NNODES=5 MASTER_ADDR=192.168.1.10 MASTER_PORT=29500 IFACE=eth0 \
#     STAGE_DIR=/data/stages_0+8+8+8+8 ./run_jetson.sh mode=continuous
#   ...
# Every host needs the code and the stage root (at least its own stage_model_<NODE_RANK>/ plus
# manifest.json; copy the whole root for simplicity). MASTER_ADDR is NODE_RANK 0's address, reachable
# from every host; IFACE is the interface carrying that address (sets GLOO_SOCKET_IFNAME and
# NCCL_SOCKET_IFNAME). Flags override the environment:
#   --node-rank R --nnodes N --master-addr A --master-port P --iface IF --stage-dir D --python PY
# Remaining arguments go to `python -m pipeline.run` (only rank 0 uses prompts/outputs; ENTRY=pipeline.serve
# serves HTTP from host 0 instead, see run_serve.sh).
# No bootstrap here: install requirements_jetson.txt (see docs/multihost.md) and set PYTHON if not `python3`.
# Optional link shaping for experiments: scripts/shape_link.sh (tc netem/tbf, needs root on that host).
# Security: host 0's launcher holds the rendezvous store on MASTER_PORT, unauthenticated and on every interface
# when the hosts differ (all on 127.0.0.1: loopback only). Make MASTER_PORT reachable only from the cluster's
# hosts (firewall, private network): whoever reaches it can stop the job. See docs/failures.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NODE_RANK="${NODE_RANK:-}"; NNODES="${NNODES:-}"; MASTER_ADDR="${MASTER_ADDR:-}"
MASTER_PORT="${MASTER_PORT:-29500}"; IFACE="${IFACE:-}"; STAGE_DIR="${STAGE_DIR:-}"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
pass=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --node-rank) NODE_RANK="$2"; shift 2 ;;
    --nnodes) NNODES="$2"; shift 2 ;;
    --master-addr) MASTER_ADDR="$2"; shift 2 ;;
    --master-port) MASTER_PORT="$2"; shift 2 ;;
    --iface) IFACE="$2"; shift 2 ;;
    --stage-dir) STAGE_DIR="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0 ;;
    *) pass+=("$1"); shift ;;
  esac
done
missing=()
[[ -z "$NODE_RANK" ]] && missing+=("NODE_RANK/--node-rank")
[[ -z "$NNODES" ]] && missing+=("NNODES/--nnodes")
[[ -z "$MASTER_ADDR" ]] && missing+=("MASTER_ADDR/--master-addr")
[[ -z "$STAGE_DIR" ]] && missing+=("STAGE_DIR/--stage-dir")
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "run_jetson.sh: error: missing ${missing[*]} (see --help)" >&2; exit 2
fi
if [[ -n "$IFACE" ]]; then
  export GLOO_SOCKET_IFNAME="$IFACE" NCCL_SOCKET_IFNAME="$IFACE"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
cd "$ROOT"
exec "$PY" -m pipeline.tools.launch --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node=1 \
  --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
  -m "${ENTRY:-pipeline.run}" "model.stage_dir=$STAGE_DIR" "model.num_threads=${OMP_NUM_THREADS}" "${pass[@]}"
