#!/usr/bin/env bash
# Shape (or reset) this host's egress on one interface with tc, to emulate an edge link.
#   sudo scripts/shape_link.sh eth0 150mbit 1ms     # rate limit + one-way delay (needs sch_netem)
#   sudo scripts/shape_link.sh eth0 150mbit 0ms     # rate limit only (tbf)
#   sudo scripts/shape_link.sh eth0 reset           # remove the shaping
# Runs with the privileges you give it (tc needs CAP_NET_ADMIN); it never asks for passwords.
set -euo pipefail
if [[ $# -lt 2 || "$1" == "-h" || "$1" == "--help" ]]; then
  sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0
fi
dev="$1"
command -v tc >/dev/null || { echo "shape_link.sh: error: 'tc' (iproute2) is not installed" >&2; exit 2; }
if [[ "$2" == "reset" ]]; then
  tc qdisc del dev "$dev" root 2>/dev/null || true
  echo "shaping removed from $dev"; exit 0
fi
rate="$2"; delay="${3:-0ms}"
tc qdisc del dev "$dev" root 2>/dev/null || true
if [[ "$delay" =~ ^0+(\.0+)?(us|ms|s)?$ ]]; then
  # rate only: a token bucket at the root
  tc qdisc replace dev "$dev" root handle 2: tbf rate "$rate" burst 64kb latency 50ms
else
  # delay (netem) at the root, rate (tbf) below it
  if ! err="$(tc qdisc replace dev "$dev" root handle 1: netem delay "$delay" 2>&1)"; then
    echo "shape_link.sh: error: cannot add a ${delay} delay on $dev: ${err} (the kernel needs sch_netem;" \
         "pass 0ms to shape the rate only)" >&2
    exit 2
  fi
  tc qdisc replace dev "$dev" parent 1: handle 2: tbf rate "$rate" burst 64kb latency 50ms
fi
tc qdisc show dev "$dev"
