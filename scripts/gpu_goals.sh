#!/usr/bin/env bash
# The FlowSpec-speed issue's GPU-host goal in one command: real (not emulated) SmolLM2 through 5 ranks on one GPU
# (gloo), the pipeline modes side by side with one-process HF generate of the unsplit model on the same GPU,
# prompts, dtype and max_new_tokens (pipeline.tools.bench --hf-generate). Goal: continuous >= 2x ar and faster
# than HF generate.
#
#   bash scripts/gpu_goals.sh [OUT_DIR] [key=value ...]     # default OUT_DIR: outputs/gpu_goals
#
# Settings (environment): N=6 (MT-bench records [BEGIN, BEGIN + N)), BEGIN=0, TOKENS=128 (max_new_tokens),
# MODES=ar,naive,pipedec,continuous, PYTHON=python3, BENCH_DIR=OUT_DIR/bench (the whole bench folder). Writes
# OUT_DIR/summary.md, summary.csv, rows.jsonl, gantt_continuous.png and bench.log, then layerbench.md/json
# (pipeline.tools.layerbench on the GPU: a stage step and rank 0's drafting calls, transformers vs lean layers;
# LAYERBENCH=0 skips it), then graphbench.md/json (pipeline.tools.graphbench: a draft level of the head and a stage
# step, dynamic shapes vs CUDA graphs; GRAPHS=0 skips it and the next part) and graphs/summary.md, summary.csv
# (the bench again with model.graphs=on, GRAPH_MODES=ar,continuous + HF generate: continuous vs ar vs HF with graphs),
# then graphs_layerbench.md/json (pipeline.tools.layerbench --graphs off,on,compile: each rank-0 call and a stage
# step with dynamic shapes, CUDA graphs and torch.compile reduce-overhead side by side; compile time reported apart)
# and compiled/summary.md (the bench with model.graphs=compile; COMPILE=0 skips both compile parts).
# DEVICE=cpu rehearses every command on this machine's CPU (the static shapes' eager twin instead of CUDA graphs),
# so that a broken command line is found before the few GPU minutes a session gets; its figures mean nothing.
# Exit status: the bench's (3 when some output differs from ar's at T = 0), else the graph bench's.
# Example, on the lent machine after `bash .device/setup.sh`: N=6 bash scripts/gpu_goals.sh "$OUT/goals"
# Rehearsal here: DEVICE=cpu N=1 TOKENS=8 COMPILE=0 bash scripts/gpu_goals.sh /tmp/goals_rehearsal
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
case "${1:-}" in -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;; esac
OUT="${1:-outputs/gpu_goals}"; shift || true
PY="${PYTHON:-python3}"; N="${N:-6}"; BEGIN="${BEGIN:-0}"; TOKENS="${TOKENS:-128}"
MODES="${MODES:-ar,naive,pipedec,continuous}"; BENCH="${BENCH_DIR:-$OUT/bench}"
Q=../shared/data/mt_bench/question.jsonl; [[ -f "$Q" ]] || Q=data/mt_bench/question.jsonl
[[ -f "$Q" ]] || { echo "gpu_goals: no mt_bench/question.jsonl in ../shared/data or data/" >&2; exit 2; }
DEV="${DEVICE:-cuda}"
[[ "$DEV" == cuda || "$DEV" == cpu ]] || { echo "gpu_goals: DEVICE=$DEV: expected cuda or cpu" >&2; exit 2; }
[[ "$DEV" == cpu ]] || "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || { echo "gpu_goals: no CUDA device visible to $PY" >&2; exit 2; }
mkdir -p "$OUT"
"$PY" -m model.default_model >/dev/null || { echo "gpu_goals: the default model is not available" >&2; exit 2; }
OMP_NUM_THREADS=1 "$PY" -m pipeline.tools.bench --prompts-file "$Q" --begin "$BEGIN" -n "$N" --modes "$MODES" \
  --hf-generate --quiet --out-dir "$BENCH" device="$DEV" max_new_tokens="$TOKENS" "$@" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
for f in summary.md summary.csv rows.jsonl gantt_continuous.png; do
  [[ -f "$BENCH/$f" ]] && cp "$BENCH/$f" "$OUT/$f"
done
if [[ "${LAYERBENCH:-1}" != 0 ]]; then
  OMP_NUM_THREADS=1 "$PY" -m pipeline.tools.layerbench --device "$DEV" --json "$OUT/layerbench.json" "$@" \
    > "$OUT/layerbench.md" 2> "$OUT/layerbench.log" || echo "gpu_goals: layerbench failed (see layerbench.log)" >&2
fi
if [[ "${GRAPHS:-1}" != 0 ]]; then
  OMP_NUM_THREADS=1 timeout 120 "$PY" -m pipeline.tools.graphbench --device "$DEV" --json "$OUT/graphbench.json" "$@" \
    > "$OUT/graphbench.md" 2> "$OUT/graphbench.log" || echo "gpu_goals: graphbench failed (see graphbench.log)" >&2
  GB="$OUT/graphs"
  OMP_NUM_THREADS=1 "$PY" -m pipeline.tools.bench --prompts-file "$Q" --begin "$BEGIN" -n "$N" \
    --modes "${GRAPH_MODES:-ar,continuous}" --hf-generate --quiet --out-dir "$GB" device="$DEV" \
    max_new_tokens="$TOKENS" model.graphs=on "$@" > "$OUT/graphs_bench.log" 2>&1
  grc=$?
  [[ $rc == 0 ]] && rc=$grc
  tail -n 30 "$OUT/graphs_bench.log"
  if [[ "${COMPILE:-1}" != 0 ]]; then
    OMP_NUM_THREADS=1 timeout 150 "$PY" -m pipeline.tools.layerbench --device "$DEV" --graphs off,on,compile --count \
      --blocks 2 --repeat 10 --json "$OUT/graphs_layerbench.json" "$@" > "$OUT/graphs_layerbench.md" \
      2> "$OUT/graphs_layerbench.log" || echo "gpu_goals: layerbench --graphs failed (see graphs_layerbench.log)" >&2
    OMP_NUM_THREADS=1 timeout 180 "$PY" -m pipeline.tools.bench --prompts-file "$Q" --begin "$BEGIN" -n "$N" \
      --modes "${GRAPH_MODES:-ar,continuous}" --quiet --out-dir "$OUT/compiled" device="$DEV" \
      max_new_tokens="$TOKENS" model.graphs=compile comm.timeout_s=600 "$@" > "$OUT/compiled_bench.log" 2>&1 \
      || echo "gpu_goals: the compiled bench failed or ran out of time (see compiled_bench.log)" >&2
    tail -n 12 "$OUT/compiled_bench.log"
  fi
fi
exit "$rc"
