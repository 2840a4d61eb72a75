"""Issue 41's open question (docs/results.md §65): what could a *precomputed round start* win at most?

A round start is rank 0's turnaround after a truncation (the target's token at the accepted path's last node ``v``
is none of ``v``'s drafted children): it commits the accepted tokens (a head forward) and drafts the new root's
first two levels (another forward, two draft ``lm_head`` calls) before the new tree's first send. A precompute
would draft those levels while the stages compute, for the likeliest truncations: a hit needs the target's token
among ``v``'s prefetched candidates (``ContinuousMode.pre``: every leaf's top-k, computed after each send; a
truncation at an inner node has none, since the prefetch ranks the leaves only, and is counted apart).

This script measures both factors of that bound on recorded answers, in one what-if replay of ``continuous``
(``pipeline.tools.simulate``, rank 0 priced per operator):

* **the hit rate**: at every truncation of the replay, whether the target's token was among the prefetched
  candidates of ``v`` (a step observer and a decoder factory handed to the simulator as
  :class:`pipeline.tools.simulate.replayer.Hooks`: nothing of the replayed code is patched);
* **the modeled gain of a perfect precompute**: rank 0's op log timed twice, as replayed and with a share ``H`` of
  the round starts' model calls removed (:func:`free_round_starts`: the commit's and the levels' head forwards and
  the draft ``lm_head`` calls; the verification's ``lm_head`` and the decisions stay), ``H`` = the measured hit
  rate and 1; and with the whole round start free (its host work too), the ceiling of any round-start lever. The
  removed round starts are drawn at random (seed 0) at rate ``H``. This is an upper bound: it charges the
  precompute nothing (its forwards over every node's candidates would run on rank 0 while the stages compute) and
  assumes the precomputed levels as good as today's (they would be drafted from the head's own feature at ``v``,
  not the target's, so tau could only fall). The whole-round-start row frees the turnaround's host work too, the
  verification's bookkeeping included.

Both timings are of the same op logs (paired): the load of the moment moves both alike. The stages' host work is
still this CPU's, measured during the replay, so the gain moves a little from one replay to the next (docs/results.md
§80: within 0.3 points at 20 answers) and the absolute ξ carries the load.

Example::

    python -m scripts.round_start_bound whatif20_rows.jsonl --limit 20 \\
        --profile ../shared/gpu/profiles/h100_7b_fp16.json --bandwidth-mbps 100000 --out-dir outputs/rs_bound
    python -m scripts.round_start_bound whatif20_rows.jsonl --limit 20 --profile edge_orin_7b --out-dir outputs/rs_edge
"""
from __future__ import annotations

import argparse
import random
import sys

MODEL_OPS = ("draft", "lm_head", "ssm")
WHOLE = 2.0      # a rate above 1: every round start free, host work included (the ceiling of any round-start lever)


def turnarounds(ops: list[tuple]) -> list[tuple[int, int]]:
    """``(i, j)`` index pairs of rank 0's turnarounds in its op log: ``ops[i]`` a ``recv``, ``ops[j]`` the next
    ``send`` with no ``recv`` between (pure)."""
    out, i, n = [], 0, len(ops)
    while i < n:
        if ops[i][0] != "recv":
            i += 1
            continue
        j = i + 1
        while j < n and ops[j][0] not in ("send", "recv"):
            j += 1
        if j < n and ops[j][0] == "send":
            out.append((i, j))
        i = j
    return out


def is_round_start(seg: list[tuple]) -> bool:
    """A turnaround that holds a round start: its first model call is the verification's ``lm_head`` and a head
    forward and a second ``lm_head`` (the new root's children) follow. A generation's first tree (after the
    prefill, no verification) is not one: nothing could have precomputed it."""
    kinds = [o[0] for o in seg]
    model = [k for k in kinds if k in MODEL_OPS]
    return bool(model) and model[0] == "lm_head" and "draft" in kinds and kinds.count("lm_head") >= 2


def free_round_starts(ops: list[tuple], rate: float, seed: int = 0) -> tuple[list[tuple], int, int]:
    """Rank 0's op log with a share ``rate`` of its round starts' model calls removed; ``rate`` > 1: all of every
    round start's turnaround but the verification's ``lm_head`` and the ring/direct messages, its host work
    included (the verification's own bookkeeping too: a ceiling looser than any round-start lever could reach).
    Returns ``(ops, round starts, freed)``; pure (the draw is ``random.Random(seed)``, one draw per round start in
    log order, so every rate frees a superset of a lower rate's round starts)."""
    rng = random.Random(seed)
    drop: set[int] = set()
    starts = freed = 0
    for i, j in turnarounds(ops):
        if not is_round_start(ops[i + 1:j]):
            continue
        starts += 1
        if rng.random() >= rate:
            continue
        freed += 1
        first_lm = next(k for k in range(i + 1, j) if ops[k][0] == "lm_head")
        gone = ("draft", "ssm", "lm_head", "host") if rate > 1 else ("draft", "ssm", "lm_head")
        drop |= {k for k in range(i + 1, j) if k != first_lm and ops[k][0] in gone}
    return [o for k, o in enumerate(ops) if k not in drop], starts, freed


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m scripts.round_start_bound", description=__doc__.split("\n\n")[0],
                                epilog="Example: python -m scripts.round_start_bound rows.jsonl --limit 20 "
                                       "--profile edge_orin_7b --out-dir outputs/rs_edge",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("rows", help="recorded answers at T = 0 (pipeline.tools.hf_generate / run rows)")
    p.add_argument("--rates", default="measured,1",
                   help="shares of round starts freed: numbers, 'measured' (this replay's hit rate); the whole "
                        "round start free is always added (default: measured,1)")
    args, rest = p.parse_known_args(argv)
    return args, rest


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    try:
        rates = [r if r == "measured" else float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        print(f"error: --rates {args.rates!r}: numbers or 'measured', comma-separated", file=sys.stderr)
        return 2
    if any(r != "measured" and not 0 <= r <= 1 for r in rates):
        print(f"error: --rates {args.rates!r}: each rate in [0, 1]", file=sys.stderr)
        return 2

    import numpy as np

    from pipeline.modes import new_decoder
    from pipeline.tools.simulate.cli import main as simulate
    from pipeline.tools.simulate.replayer import Hooks
    from pipeline.tools.simulate.timing import decode_times, simulate_timing as timing

    hits = {"truncations": 0, "hits": 0, "unprefetched": 0}
    current: dict[str, object] = {}

    def decoder(mode: str):                               # the mode whose `pre` the next truncation reads
        d = new_decoder(mode)
        current["mode"] = getattr(d, "__self__", d)       # a registry decoder is a mode instance's bound `decode`
        return d

    def observe(tree, path, token, finished):            # a step observer, untimed (the replay's Hooks)
        if token is None or finished:
            return
        tokens, parents = tree.host_numpy()[:2]
        v = path[-1]
        if token in tokens[np.nonzero(parents == v)[0]].tolist():
            return                                        # a verified step, not a truncation
        hits["truncations"] += 1
        pre = getattr(current.get("mode"), "pre", None)
        if pre is None or pre[3].shape[0] != len(tree) or not bool(pre[0][v]):
            hits["unprefetched"] += 1                     # none prefetched, or v is an inner node (leaves only)
        elif token in pre[3][v].tolist():
            hits["hits"] += 1

    logs: list[tuple] = []             # (every rank's op log, its TimingConfig) of each timed session
    hooks = Hooks(observers=(observe,), decoder=decoder, on_timed=lambda session, tc: logs.append((session.ops(), tc)))
    rc = simulate([args.rows, "--modes", "continuous", "--rank0-cost", "ops", "--no-plots",
                   "--quiet", *rest], hooks)
    if rc != 0:
        return rc
    seen = hits["truncations"] - hits["unprefetched"]
    measured = hits["hits"] / seen if seen else 0.0
    print(f"\ntruncations {hits['truncations']} (every replay pass), prefetched {seen}, target token among the "
          f"prefetched candidates: {hits['hits']} = hit rate {measured:.3f}")
    print("\n| round starts freed | rate | round starts | freed | decode s as replayed | decode s freed | ξ gain |")
    print("|---|---|---|---|---|---|---|")
    base = sum(sum(decode_times(timing(op_logs, tc))) for op_logs, tc in logs)     # as replayed: timed once
    for label, rate in [(("measured hit rate" if r == "measured" else "model calls"), measured if r == "measured"
                         else r) for r in rates] + [("whole round start (host work too)", WHOLE)]:
        new = 0.0
        starts = freed = 0
        for op_logs, tc in logs:
            r0, s, f = free_round_starts(op_logs[0], rate)
            new += sum(decode_times(timing([r0, *op_logs[1:]], tc)))
            starts, freed = starts + s, freed + f
        print(f"| {label} | {min(rate, 1):.3f} | {starts} | {freed} | {base:.4f} | {new:.4f} | "
              f"{(base / new - 1) * 100:+.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
