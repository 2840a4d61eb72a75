"""What-if simulator: predict the decode time of recorded generations for other stage counts, profiles and links.

Plan a deployment before buying it: record generations once (any mode, any timing: rows of
``pipeline.run --output``, ``pipeline.tools.bench`` or ``run_eval.sh``), then ask how long the same answers would take
with 8 or 16 stages, another device profile or a faster link, in seconds on one machine::

    python -m pipeline.tools.simulate outputs/eval/edge_orin_7b/rows.jsonl --stages 2,4,8 --bandwidth-mbps 150,1000

How, in the order the data flows (each module states its own invariants):

* :mod:`.recorded`: the rows, the generation being replayed, the target's features, and why a recorded answer
  fixes the schedule (which draft nodes the target accepts);
* :mod:`.replayer`: the *real* rank-0 scheduler of a mode, the real drafter (:mod:`.drafter`) and the real stage
  loop on any number of stages in one process, the expensive parts replaced by stand-ins (:mod:`.stand_ins`);
  every rank's ordered operations and the host work in between go to op logs (:mod:`.oplog`), over a
  simulated transport whose direct decisions follow a schedule (:mod:`.transport`); exact at T = 0;
* :mod:`.timing`: a discrete-event model with the emulated testbed's semantics times the op logs under a
  profile (``pipeline/emulation.py``); predictions are in the profile's time;
* :mod:`.pricing`: how rank 0's host work is priced (``--rank0-cost``): this CPU's measured time, its counted
  operators and syncs times the device's per-op / per-sync cost, or free;
* :mod:`.predict`: per-generation predictions, the direct-decision passes, calibration of a per-event
  testbed overhead, link overrides;
* :mod:`.report`: summary tables, paper-style tables, timelines and Gantt charts; :mod:`.cli`: the command line.

``pipeline.tools.tp_sim`` (tensor-parallel baselines) and ``pipeline.tools.osd_report replay`` (online drafter
learning) reuse the replay and the timing model.
"""
from __future__ import annotations

from pipeline.tools.simulate.cli import main, parse_args, parse_rows_args, run
from pipeline.tools.simulate.drafter import ReplayDrafter, record_drafter
from pipeline.tools.simulate.oplog import MarkTracer, OpLog, Recorder
from pipeline.tools.simulate.predict import calibrate, prediction, same_run, timed_passes, with_link
from pipeline.tools.simulate.recorded import Committed, ReplayTarget, TargetFeatures, load_rows, load_target
from pipeline.tools.simulate.replayer import Replayed, Session, replay
from pipeline.tools.simulate.report import (COLUMNS, MODE_ORDER, SPAN_KIND, draw_gantt, stage_utilization, summarize,
                                            to_timeline, write_paper_tables, write_summary)
from pipeline.tools.simulate.timing import Deadlock, TimingConfig, decode_times, decode_windows, simulate_timing
from pipeline.tools.simulate.transport import DirectTimes, ScheduledDirect, SimComm

__all__ = [
    "COLUMNS", "MODE_ORDER", "SPAN_KIND", "Committed", "Deadlock", "DirectTimes", "MarkTracer", "OpLog", "Recorder",
    "ReplayDrafter", "ReplayTarget", "Replayed", "ScheduledDirect", "Session", "SimComm", "TargetFeatures",
    "TimingConfig", "calibrate", "decode_times", "decode_windows", "draw_gantt", "load_rows", "load_target", "main",
    "parse_args", "parse_rows_args", "prediction", "record_drafter", "replay", "run", "same_run", "simulate_timing",
    "stage_utilization", "summarize", "timed_passes", "to_timeline", "with_link", "write_paper_tables",
    "write_summary",
]
