#!/usr/bin/env bash
# Issue 16's draft-head recipe for the default target on a GPU, in steps that each fit one 10-minute command of
# a lent GPU machine (and run unchanged, much slower, on a CPU):
#
#   bash scripts/gpu_head_recipe.sh data  OUT   # self-distilled data: the default head's kinds + broad kinds,
#                                               # half greedy, half sampled (float32 target, as at inference);
#                                               # the six sets' records [30, 50) excluded; then translations of
#                                               # its answers' sentences and back (data --translate); then
#                                               # OUT/corpus.jsonl, every answer as a suffix corpus
#                                               # (draft.suffix_corpus; docs/suffix.md)
#   bash scripts/gpu_head_recipe.sh train OUT   # EAGLE-1/2 head with the training-time test (--unroll-steps 5),
#                                               # from the shipped head, saved in bf16 to OUT/head
#   bash scripts/gpu_head_recipe.sh eval  OUT   # tau per category (held-out kinds + six sets), T = 0 and T = 1,
#                                               # shipped head vs OUT/head, draft = the head alone
#   bash scripts/gpu_head_recipe.sh all   OUT   # the three in a row
#
# Every step resumes: data and train continue from OUT's files (data.jsonl, head/train_state), eval skips the
# tables it has. So a step cut by the time budget, or by a machine that was given back, goes on from where it was
# when run again with OUT carried back. Settings (environment):
#   PYTHON=python3  DEVICE=cuda (cpu where none)  BUDGET_S=480 (seconds per data/train step)
#   SCALE=1 (prompt counts x SCALE; e.g. 0.01 for a CPU smoke run)  BATCH=384 (generation batch)
#   TRAIN_BATCH=32 (conversations per training step)  LR=5e-4 (a fine-tune of the shipped head)
#   ANCHOR=0 (train --anchor-decay: a pull toward the shipped head against forgetting; 0 = off; docs/results.md §97)
#   RECORDS=4 (tau prompts per category)  TAU_TOKENS=64
# Example, on the lent machine after `bash .device/setup.sh`: DEVICE=cuda bash scripts/gpu_head_recipe.sh data $OUT
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  data|train|eval|all) ;;
  *) usage >&2; echo "gpu_head_recipe: give a step: data, train, eval or all (got '${1:-}')" >&2; exit 2 ;;
esac
step="$1"; OUT="${2:-outputs/head_recipe}"
PY="${PYTHON:-python3}"
"$PY" -c 'import torch' 2>/dev/null || { echo "gpu_head_recipe: $PY has no torch (set PYTHON, e.g. PYTHON=.venv/bin/python)" >&2; exit 2; }
DEVICE="${DEVICE:-$("$PY" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}"
BUDGET_S="${BUDGET_S:-480}"; SCALE="${SCALE:-1}"; BATCH="${BATCH:-384}"; TRAIN_BATCH="${TRAIN_BATCH:-32}"; LR="${LR:-5e-4}"; RECORDS="${RECORDS:-4}"; TAU_TOKENS="${TAU_TOKENS:-64}"
ANCHOR="${ANCHOR:-0}"
SHIPPED="draft/heads/SmolLM2-135M-Instruct"
mkdir -p "$OUT"
n() { "$PY" -c "import sys; print(max(1, round(float(sys.argv[1]) * float(sys.argv[2]))))" "$1" "$SCALE"; }
log() { echo "[head_recipe $(date +%H:%M:%S)] $*" >&2; }

exclude=()
sets=($("$PY" -c "from config.paths import DATASETS; print(' '.join(DATASETS))"))
for set in "${sets[@]}"; do
  f="../shared/data/$set/question.jsonl"
  [[ -f "$f" ]] || f="data/$set/question.jsonl"
  [[ -f "$f" ]] || { echo "gpu_head_recipe: no $set/question.jsonl in ../shared/data or data/ (the evaluation records must be excluded)" >&2; exit 2; }
  exclude+=(--exclude "$f:30:50")
done

do_data() {
  T0=$(date +%s)   # one budget for the whole step
  log "data: $(n 6000) self prompts + $(n 4000) broad prompts on $DEVICE, budget ${BUDGET_S}s"
  run_data data --self-prompts "$(n 6000)" --broad "$(n 4000)" --followup-frac 0.2 --temperature 0.8 \
      --sample-frac 0.5 --max-new-tokens 256 "${exclude[@]}" || return 0
  # translation made from the target's own answers (English sentences -> five languages, then those answers back
  # into English); each source must be complete first, so that a resumed run draws the same prompts
  run_data translate_to --translate "$(n 2000)" --translate-from "$OUT/data.jsonl" --temperature 0.8 \
      --sample-frac 0.3 --max-new-tokens 96 --seed 1 || return 0
  run_data translate_back --translate "$(n 1000)" --translate-from "$OUT/translate_to.jsonl" --temperature 0.8 \
      --sample-frac 0.3 --max-new-tokens 96 --seed 2 || return 0
  # the same answers as a static suffix corpus (seconds; measured with drafter_bench later, on any machine)
  "$PY" -m draft.train.corpus "$OUT/data.jsonl" "$OUT/translate_to.jsonl" "$OUT/translate_back.jsonl" \
      --out "$OUT/corpus.jsonl" >&2 || { echo "gpu_head_recipe: could not write $OUT/corpus.jsonl" >&2; exit 2; }
}

run_data() {   # run_data NAME ARGS...: OUT/NAME.jsonl, resumed; fails while prompts are left (the budget cut it)
  local name="$1" left=$((BUDGET_S - ($(date +%s) - T0))); shift
  (( left > 30 )) || { log "data: the budget is spent before $name: run the data step again"; return 1; }
  "$PY" -m draft.train_eagle data --out "$OUT/$name.jsonl" --batch-size "$BATCH" --device "$DEVICE" --dtype float32 \
      --time-budget "$left" --resume --no-progress "$@" 2> "$OUT/$name.log" || { cat "$OUT/$name.log" >&2; exit 2; }
  cat "$OUT/$name.log" >&2
  log "data: $(cat "$OUT/$name.jsonl" 2>/dev/null | wc -l) conversations in $OUT/$name.jsonl"
  tail -n 1 "$OUT/$name.log" | grep -q '"complete": true' ||
    { log "data: $name is not complete: run the data step again"; return 1; }
}

do_train() {
  [[ -s "$OUT/data.jsonl" ]] || { echo "gpu_head_recipe: run the data step first ($OUT/data.jsonl is missing)" >&2; exit 2; }
  local amp=none; [[ "$DEVICE" == cuda* ]] && amp=bf16
  log "train: --unroll-steps 5 from $SHIPPED on $DEVICE, budget ${BUDGET_S}s"
  local data=(--data "$OUT/data.jsonl") f
  for f in translate_to translate_back; do [[ -s "$OUT/$f.jsonl" ]] && data+=(--data "$OUT/$f.jsonl"); done
  "$PY" -m draft.train_eagle train "${data[@]}" --out "$OUT/head" --init-from "$SHIPPED" \
      --unroll-steps 5 --batch-size "$TRAIN_BATCH" --max-len 1024 --lr "$LR" --anchor-decay "$ANCHOR" --epochs 3 \
      --cache-features cpu --amp "$amp" \
      --val-count "$(n 40)" --val-every 200 --time-budget "$BUDGET_S" --save-dtype bfloat16 --device "$DEVICE" \
      --resume --no-progress
  cp "$SHIPPED/token_counts.safetensors" "$OUT/head/" 2>/dev/null || true
}

do_eval() {
  [[ -f "$OUT/head/model.safetensors" ]] || { echo "gpu_head_recipe: run the train step first" >&2; exit 2; }
  for temp in 0 1; do
    local table="$OUT/tau_t$temp/summary.csv"
    [[ -s "$table" ]] && { log "eval: $table exists"; continue; }
    log "eval: tau at T=$temp, $RECORDS prompts per category, $TAU_TOKENS tokens"
    "$PY" -m pipeline.tools.drafter_bench --head "$SHIPPED" --head "$OUT/head" --sets "heldout,$(IFS=,; echo "${sets[*]}")" \
        --begin 30 --end "$((30 + RECORDS))" --max-new-tokens "$TAU_TOKENS" --temperature "$temp" --seed 0 \
        --out "$OUT/tau_t$temp" "model.device=$DEVICE"
    cat "$table"
  done
}

case "$step" in
  data) do_data ;;
  train) do_train ;;
  eval) do_eval ;;
  all) do_data; do_train; do_eval ;;
esac
