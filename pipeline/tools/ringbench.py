"""Bare ring vs the project's transport, side by side in one run: ``python -m pipeline.tools.ringbench``.

Starts ``--world`` local gloo processes and, for each message shape the decode loop sends, times
ring trips (rank 0 -> 1 -> ... -> N-1 -> 0) two ways on the same process group:

* **bare**: preallocated buffers of exactly the project's gloo messages (:func:`pipeline.comm.wire_sizes`: one
  frame of header + payload bytes, or header and payload when the frame would exceed ``FRAME_BYTES``; received
  into a frame-sized buffer as the project does), ``dist.send`` / ``dist.recv`` and nothing else: the floor the
  host and gloo allow for those messages;
* **project**: the messages the modes really send, through :class:`pipeline.comm.Comm` (``send_next`` /
  ``recv_prev``: the wire codec, tracing off, the watchdog running), token ids from rank 0 and hidden rows
  from the stages, as in ``ar`` (w = 1) and a step-wise segment (w rows with parents).

The two methods alternate in blocks of trips (load drift on a shared host hits both alike). Per-hop time =
median trip time / world. The last line reads ``overhead ratio R`` = project per-hop / bare per-hop
for the ``ar`` shape (issue 15's goal: R <= 2). No model, no compute: transport only.

Example::

    python -m pipeline.tools.ringbench --world 5 --hidden 576 --trips 300
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from config.invocation import prog
from pipeline.tools.callbench import parse_rows
from pipeline.tools.ranks import free_port


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.ringbench"), description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Example: python -m pipeline.tools.ringbench --world 5 --hidden 576 --trips 300")
    p.add_argument("--world", type=int, default=5, help="processes in the ring (rank 0 + stages)")
    p.add_argument("--hidden", type=int, default=576, help="hidden size of the rows the stages pass (SmolLM2: 576)")
    p.add_argument("--rows", default="1,16", help="comma-separated rows per message (1 = ar; 16 = a segment)")
    p.add_argument("--trips", type=int, default=200, help="timed ring trips per shape and method")
    p.add_argument("--warmup", type=int, default=20, help="untimed trips first")
    p.add_argument("--json", help="also write the table as JSON here")
    args = p.parse_args(argv)
    if args.world < 2 or args.trips < 1 or args.hidden < 1:
        p.error("--world >= 2, --trips >= 1 and --hidden >= 1")
    args.rows = parse_rows(p, args.rows)
    return args


def _messages(rank: int, w: int, hidden: int):
    """The message a rank sends for a shape: ids from rank 0, hidden rows from a stage (``ar`` uses Context,
    the step-wise modes Segment)."""
    import torch

    from model.devices import HOST
    from pipeline.messages import Context, Segment
    x = torch.ones(1, w, dtype=torch.long, device=HOST) if rank == 0 else torch.ones(1, w, hidden, device=HOST)
    if w == 1:
        return Context(x)
    return Segment(x, torch.arange(-1, w - 1, device=HOST), torch.arange(w, device=HOST), 1, 5)


def _worker(rank: int, world: int, port: int, args, out_q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from model.devices import HOST
    from pipeline.comm import FRAME_BYTES, Comm, wire_sizes
    from pipeline.messages import encode
    torch.set_num_threads(1)
    comm = Comm("gloo", 60.0, 0.5, "cpu")
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    results = {}
    for w in args.rows:
        msg = _messages(rank, w, args.hidden)
        out_msgs = [torch.ones(n, dtype=torch.uint8, device=HOST) for n in wire_sizes(encode(msg)[1].numel())]
        # what the previous rank sends us: same codec, so same sizes
        in_sizes = wire_sizes(encode(_messages(prv, w, args.hidden))[1].numel())
        in_msgs = [torch.empty(FRAME_BYTES, dtype=torch.uint8, device=HOST)] + \
                  [torch.empty(n, dtype=torch.uint8, device=HOST) for n in in_sizes[1:]]

        # one trip round the ring: rank 0 sends, then receives; every stage receives, then sends
        def bare_trip() -> None:
            steps = [(dist.send, out_msgs, nxt), (dist.recv, in_msgs, prv)]
            for op, frames, peer in steps if rank == 0 else steps[::-1]:
                for tag, t in enumerate(frames):
                    op(t, peer, tag=tag)

        def project_trip() -> None:
            steps = [lambda: comm.send_next(msg), comm.recv_prev]
            for step in steps if rank == 0 else steps[::-1]:
                step()

        times: dict[str, list[float]] = {"bare": [], "project": []}
        dist.barrier()
        for trip in (bare_trip, project_trip):
            for _ in range(args.warmup):
                trip()
        # the two methods alternate in blocks, so that load drifting on a shared host hits both alike
        blocks = max(1, min(10, args.trips // 10))
        for b in range(blocks):
            n = args.trips // blocks + (1 if b < args.trips % blocks else 0)
            for name, trip in (("bare", bare_trip), ("project", project_trip)):
                dist.barrier()
                for _ in range(n):
                    t0 = time.perf_counter()
                    trip()
                    times[name].append(time.perf_counter() - t0)
        if rank == 0:
            sh, sp = encode(_messages(1, w, args.hidden))      # a stage's message: the larger one
            for name, ts in times.items():
                results[(name, w)] = (statistics.median(ts), statistics.mean(ts),
                                      int(sh.numel() * 8 + sp.numel()), len(wire_sizes(sp.numel())))
    dist.barrier()
    if rank == 0:
        out_q.put(results)
    comm.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    try:
        results = q.get(timeout=600)
    except Exception:
        print("ringbench: error: the ring did not finish within 600 s", file=sys.stderr)
        for p in procs:
            p.kill()
        return 1
    for p in procs:
        p.join(timeout=30)
    print(f"ring of {args.world} processes (gloo, loopback), hidden {args.hidden}, {args.trips} trips per row "
          f"(median per trip; per hop = trip / {args.world})")
    print(f"{'rows':>5} {'stage msg B':>11} {'gloo msgs':>9} {'bare trip ms':>13} {'project trip ms':>16} {'bare hop ms':>12} "
          f"{'project hop ms':>15} {'ratio':>6}")
    table = []
    for w in args.rows:
        b, pj = results[("bare", w)], results[("project", w)]
        ratio = pj[0] / b[0] if b[0] > 0 else float("inf")
        table.append({"rows": w, "bytes": pj[2], "gloo_messages_per_hop": pj[3], "bare_trip_s": b[0], "project_trip_s": pj[0],
                      "bare_hop_s": b[0] / args.world, "project_hop_s": pj[0] / args.world, "ratio": ratio})
        print(f"{w:>5} {pj[2]:>11} {pj[3]:>9} {b[0] * 1e3:>13.3f} {pj[0] * 1e3:>16.3f} {b[0] / args.world * 1e3:>12.3f} "
              f"{pj[0] / args.world * 1e3:>15.3f} {ratio:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "hidden": args.hidden, "trips": args.trips, "rows": table}, f, indent=2)
    ar = next((t for t in table if t["rows"] == 1), table[0])
    print(f"overhead ratio {ar['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
