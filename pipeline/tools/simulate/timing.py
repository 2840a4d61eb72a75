"""The discrete-event timing model: a replay's op logs (:mod:`.oplog`) timed under an emulation profile.

:func:`simulate_timing` runs the per-rank op lists with the emulated testbed's semantics
(``pipeline/emulation.py``):

* a compute op takes the profile's modeled time (a stage's ``time(rows, ctx)`` times ``stage_cost_scale``;
  rank 0's lm_head and draft head by the profile's rank-0 models, or at their recorded CPU time with
  ``model_rank0=False``), plus ``op_overhead_s``; host work takes its measured time (rank 0's: as
  ``rank0_pricing`` says, :mod:`.pricing`: measured, its counted operators and syncs at the device's cost, or
  free); everything rank 0 runs itself is multiplied by ``rank0_cost_scale`` (0: the what-if of a rank 0 that
  costs nothing);
* a message serialises on its link (header + rows x bytes per row + other bytes, over the bandwidth; one link
  per (sender, receiver) pair, messages on it back to back) and arrives ``latency_s`` later without blocking
  the sender; a receive waits for its message (plus ``msg_overhead_s``);
* a direct decision (``dsend``) travels on its own link and never blocks rank 0; a stage's ``poll`` takes no
  time (their times go to :class:`.transport.DirectTimes` for the next replay pass).

Predictions are in the profile's time: ``time_scale`` dilates modeled durations (compute, transfers, latency)
like ``emu.time_scale``, never measured host work. Invariants: the model is deterministic (the same logs and
configuration give the same times); every rank's clock only moves forward; and logs that cannot all complete
(a receive whose message is never sent) raise :class:`Deadlock` instead of returning partial times.
"""
from __future__ import annotations

from dataclasses import dataclass

from config.profiles import LinkModel, Profile
from pipeline.tools.simulate.pricing import MEASURED, Rank0Pricing, host_seconds
from pipeline.tools.simulate.transport import DirectTimes


@dataclass
class TimingConfig:
    """How a session's ops are timed. ``stage_cost_scale`` multiplies every stage compute time (e.g. the same
    model on twice as many stages: 0.5); ``hidden_bytes_per_token`` overrides the profile's (needed when the
    profile counts real payloads); ``model_rank0=False`` times rank 0's lm_head/draft ops at their recorded
    CPU time instead of the profile's model; ``rank0_cost_scale`` multiplies every op rank 0 runs (its
    lm_head, draft-model and host work, and their ``op_overhead_s``), never its transfers or waits;
    ``rank0_pricing`` prices rank 0's host ops (:mod:`.pricing`; the stages' host ops stay measured)."""

    profile: Profile
    time_scale: float = 1.0
    stage_cost_scale: float = 1.0
    msg_overhead_s: float = 0.0         # transport cost per received message (every rank)
    model_rank0: bool = True
    real_hidden_bytes: float = 0.0      # bytes per hidden row of the real model (profiles that count payloads)
    op_overhead_s: float = 0.0          # added to every modeled op (e.g. the testbed's padding overhead)
    rank0_cost_scale: float = 1.0       # factor on all of rank 0's work (lm_head, draft ops, host work);
                                        # 0 = a what-if rank 0 that takes no time (off the critical path)
    rank0_pricing: Rank0Pricing = MEASURED   # rank 0's host work: measured | ops (counts x device cost) | zero


class Deadlock(RuntimeError):
    """The op logs cannot all complete: a rank waits for a message that is never sent."""
def simulate_timing(logs: list[list[tuple]], tc: TimingConfig,
                    timeline: list | None = None, direct: DirectTimes | None = None) -> list[tuple[str, float]]:
    """Discrete-event timing of per-rank op lists; returns the ``(mark, time)`` list (rank 0 writes the marks).
    ``timeline``, when given, receives ``(rank, op, start, end)`` for every op (waits end at the arrival);
    ``direct``, when given, receives when each direct decision reached each stage and when each stage polled."""
    prof, s = tc.profile, tc.time_scale
    world = len(logs)
    idx, clock = [0] * world, [0.0] * world
    chan: dict[tuple[int, int], list[float]] = {}
    read: dict[tuple[int, int], int] = {}
    link_free: dict[tuple[int, int], float] = {}
    marks: list[tuple[str, float]] = []
    r0_lm = prof.lm_head if (tc.model_rank0 and prof.lm_head is not None) else None
    # rank 0's draft-model ops (w rows over ctx slots): the profile's model, or None = their recorded CPU time
    r0_fwd = {"draft": prof.draft_forward, "ssm": prof.ssm_forward} if tc.model_rank0 else {"draft": None, "ssm": None}

    def nbytes(link: LinkModel, hidden_rows: int, other: int) -> float:
        per_row = link.hidden_bytes_per_token or tc.real_hidden_bytes
        return link.header_bytes + hidden_rows * per_row + other

    remaining = sum(len(l) for l in logs)
    while remaining:
        progressed = False
        for r in range(world):
            ops = logs[r]
            own = tc.rank0_cost_scale if r == 0 else 1.0     # factor on the work this rank does itself
            while idx[r] < len(ops):
                t = clock[r]
                op = ops[idx[r]]
                kind = op[0]
                if kind == "recv":
                    key = (op[1], r)
                    k = read.get(key, 0)
                    q = chan.get(key)
                    if q is None or k >= len(q):
                        break
                    t = max(t, q[k]) + tc.msg_overhead_s
                    read[key] = k + 1
                elif kind == "host":
                    t += (host_seconds(op, tc.rank0_pricing) if r == 0 else op[1]) * own
                elif kind == "compute":
                    t += prof.stage_model(r).time(op[1], op[2]) * tc.stage_cost_scale * s + tc.op_overhead_s
                elif kind == "lm_head":
                    t += ((r0_lm.time_share(op[1], op[2]) * s if r0_lm is not None else op[3]) + tc.op_overhead_s) * own
                elif kind in r0_fwd:
                    cost = r0_fwd[kind]
                    t += ((cost.time(op[1], op[2]) * s if cost is not None else op[3]) + tc.op_overhead_s) * own
                elif kind == "send":
                    dst = op[1]
                    link = prof.link_model(r, dst)
                    start = max(t, link_free.get((r, dst), 0.0))
                    done = start + link.transfer_s(nbytes(link, op[2], op[3])) * s
                    link_free[(r, dst)] = done
                    chan.setdefault((r, dst), []).append(done + link.latency_s * s)
                elif kind == "dsend":     # a direct decision: its own link, does not block rank 0
                    dst = op[1]
                    link = prof.link_model(r, dst)
                    start = max(t, link_free.get((r, dst), 0.0))
                    done = start + link.transfer_s(nbytes(link, 0, op[2])) * s
                    link_free[(r, dst)] = done
                    if direct is not None:
                        direct.arrivals.setdefault(dst, []).append(done + link.latency_s * s)
                elif kind == "poll":      # a stage looks at the direct decisions it holds (no time)
                    if direct is not None:
                        direct.polls.setdefault(r, []).append((t, op[1]))
                elif kind == "mark":
                    marks.append((op[1], t))
                else:
                    raise ValueError(f"unknown op {op!r}")
                if timeline is not None:
                    timeline.append((r, op, clock[r], t))
                clock[r] = t
                idx[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: logs[r][idx[r]] for r in range(world) if idx[r] < len(logs[r])}
            raise Deadlock(f"op logs cannot make progress: {stuck}")
    return marks


def decode_windows(marks: list[tuple[str, float]]) -> list[tuple[float, float]]:
    """Each generation's decode window ``(decode_begin, gen_end)`` on rank 0's clock."""
    out, begin = [], None
    for name, t in marks:
        if name == "decode_begin":
            begin = t
        elif name == "gen_end" and begin is not None:
            out.append((begin, t))
            begin = None
    return out


def decode_times(marks: list[tuple[str, float]]) -> list[float]:
    """Decode seconds of each generation: from its ``decode_begin`` mark to its ``gen_end`` mark."""
    return [hi - lo for lo, hi in decode_windows(marks)]
