#!/usr/bin/env bash
# The test suite on a fresh machine: bootstrap (venv + requirements + default model, cached), then pytest.
#   ./run_tests.sh                 # everything (what CI runs; its time on 2 CPU cores: docs/results.md)
#   ./run_tests.sh --fast          # the fast tier: pure rules, laws, architecture, CLI checks (tests/conftest.py)
#   ./run_tests.sh tests/test_sampling.py tests/test_tree.py::test_reroot   # just those paths
#   ./run_tests.sh -k tree -x      # any pytest arguments (with no path: the whole tests/ folder)
#   FLOWSPEC_TEST_WORKERS=1 ./run_tests.sh ...   # one test process (default: two, pytest-xdist)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
args=()
opts=()   # the arguments that are no path: the rerun of failed tests keeps them (-x, -k, -p, --durations, ...)
paths=0
value=0   # the previous word was an option that takes a value (-k EXPR, -m MARK, ...): this one is no path
for a in "$@"; do
  if (( value )); then
    args+=("$a"); opts+=("$a"); value=0
  elif [[ "$a" == --fast ]]; then
    args+=(-m "not slow"); opts+=(-m "not slow")
  else
    args+=("$a")
    case "$a" in
      -k|-m|-p|-o|-c|--deselect|--ignore|--ignore-glob|--durations|--maxfail|--basetemp|--rootdir|--junitxml)
        value=1; opts+=("$a") ;;
      -*) opts+=("$a") ;;
      # a test file, a folder of them or file::test: run only those (today's whole tests/ otherwise)
      *) if [[ -e "${a%%::*}" && ( "$a" == tests* || "$a" == *.py* ) ]]; then paths=1; else opts+=("$a"); fi ;;
    esac
  fi
done
(( paths )) || args+=(tests)
if [[ -n "${RUN_TESTS_DRY_RUN:-}" ]]; then printf '%s\n' "${args[@]}"; exit 0; fi   # tests/test_cli.py: the arguments
PY="$(bash scripts/bootstrap.sh)"
# One intra-op thread per process unless told otherwise: the tests run tiny models, several ranks at once (threads or
# processes) on a few cores, where torch's own thread pool only oversubscribes them (tests/test_protocol.py on 2 cores:
# 137 s wall with 2 threads, 124 s with 1; docs/results.md, issue 43's suite section)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$PY" -m model.default_model >/dev/null
# Two test processes by default (pytest-xdist): a test mostly keeps one core busy (its rings run as threads in one
# process, or as ranks that take turns), so on 2 cores two of them at once halve the wall time (docs/results.md,
# issue 43). FLOWSPEC_TEST_WORKERS=1 runs in this process (what --pdb or -s want); a Python without pytest-xdist
# (a Jetson's own venv) runs in one too.
workers="${FLOWSPEC_TEST_WORKERS:-2}"
if [[ "$workers" != 1 ]] && "$PY" -c "import xdist" 2>/dev/null; then
  args=(-n "$workers" "${args[@]}")
fi
# A run with at most 5 failed tests runs those once more, alone, with the options given (not the paths): one that
# fails again fails the run; one that passes is named FLAKY on stderr and the run passes (tests/failed_list.py says
# why; FLOWSPEC_NO_RERUN=1 turns it off)
failed="$(mktemp)"
trap 'rm -f "$failed"' EXIT
rc=0
FLOWSPEC_FAILED_OUT="$failed" "$PY" -m pytest -q -ra -p tests.failed_list "${args[@]}" || rc=$?
mapfile -t again < "$failed"
if (( rc == 1 && ${#again[@]} > 0 && ${#again[@]} <= 5 )) && [[ -z "${FLOWSPEC_NO_RERUN:-}" ]]; then
  echo "[tests] ${#again[@]} failed; running them once more, alone, to tell a timing flake from a defect" >&2
  rc=0
  "$PY" -m pytest -q -ra "${opts[@]}" "${again[@]}" || rc=$?
  if (( rc == 0 )); then
    printf '[tests] FLAKY (failed in the full run, passed alone): %s\n' "${again[@]}" >&2
  fi
fi
exit "$rc"
