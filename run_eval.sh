#!/usr/bin/env bash
# The evaluation sweep: modes x datasets x temperatures through the pipeline, on the emulated edge testbed
# by default (profiles/edge_orin_7b.json), resumable, summarised like the FlowSpec paper (ξ, SR, τ).
#
#   ./run_eval.sh --help
#   ./run_eval.sh                                   # ar naive pruned pipedec continuous x 6 datasets x T in {0,1},
#                                                   # records [30,50), both MT-bench turns, 256 new tokens
#   ./run_eval.sh --datasets mt_bench,gsm8k --modes ar,naive,continuous --temperatures 0 --begin 30 --end 33
#   ./run_eval.sh --profile none                    # real timing of this host instead of the emulated testbed
#   ./run_eval.sh --data-dir /path/to/data tree.init_depth=5   # key=value words go to every pipeline run
#   ./run_eval.sh --answer-dir llm_judge/data      # + FastChat llm_judge answers: <dataset>/model_answer/<model>-<mode>-t<T>.jsonl
#
# Datasets are read from data/<dataset>/question.jsonl (prepare them with `python -m data.prepare --from DIR`).
# Results: outputs/eval/<profile>/{rows.jsonl,summary.md,summary.csv,xi.png,sr.png,tau.png,logs/}; rerunning
# the same command resumes. Exit status: 0 ok, 2 a launch failed or bad arguments, 3 a T=0 output differs from ar.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
export FLOWSPEC_PROG="pipeline.tools.eval=./run_eval.sh"   # usage lines name this script (config/invocation.py)
for a in "$@"; do
  case "$a" in
    -h|--help)
      PY="${FLOWSPEC_VENV:-$ROOT/.venv}/bin/python"; [[ -x "$PY" ]] || PY="${PYTHON:-python3}"  # no bootstrap
      exec "$PY" -m pipeline.tools.eval --help ;;
  esac
done
PY="$(bash scripts/bootstrap.sh)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m pipeline.tools.eval "$@"
