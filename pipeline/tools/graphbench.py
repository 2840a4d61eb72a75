"""A draft level and a stage step with dynamic shapes against static shapes (CUDA graphs on a GPU), side by side in
one run: ``python -m pipeline.tools.graphbench``.

Static shapes (run key ``model.graphs``; :mod:`model.graphs`, :mod:`draft.static_head`) pad a forward's rows to a
bucket and attend over the KV cache at capacity so that, on a GPU, each bucket's forward is one recorded CUDA graph.
This times, on the run's own stage root and head (``key=value`` overrides as for ``pipeline.run``), on ``--device``:

* ``head forward, k rows``: one EAGLE-1/2 head forward over a beam level of ``tree.top_k`` rows (the level's
  model work: what a graph replaces);
* ``draft tree, per level``: a whole EAGLE-2 tree of ``tree.depth`` levels (head forwards, the draft ``lm_head``'s
  top-k, the beam's bookkeeping) divided by its levels;
* ``stage step, w rows``: one verification stage's layers (``--stage``) on a ``w``-row tree segment after a
  ``--ctx``-token context.

Each call runs ``--repeat`` times per block, dynamic then static, for ``--blocks`` alternating blocks (load drift
hits both alike); the table gives the median milliseconds of each, their ratio, and each call's dispatched aten
operators counted once (:mod:`pipeline.tools.opcount`): dynamic, static, and "graph": what is left on the host when
every static forward is a replayed graph (a replay dispatches none of its forward's operators; on a CPU counted with
recorded replays whose re-run forward is not counted, so copy-in, padding, mask, copy-out and the bookkeeping remain).
The static executor is ``--executor`` (default: what ``model.graphs=on`` picks on the device: ``cuda`` graphs on a
GPU, the ``eager`` twin on a CPU; ``replay`` also works anywhere). Exit status 3 when the static path drafted a
different tree than the dynamic one (it must not: ``tests/test_graphs.py``).

Example::

    python -m pipeline.tools.graphbench --device cuda --json outputs/graphbench.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from config.invocation import prog
from pipeline.tools.callbench import (add_call_args, alternate, check_args, load_stage, md_table, run_setup, stage_step,
                                      where, write_json)


class GraphBenchError(ValueError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.cli import DefaultsOnce
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.graphbench"), description=__doc__.split("\n\n")[0], formatter_class=DefaultsOnce,
        epilog="Example: python -m pipeline.tools.graphbench --device cpu --repeat 10 --blocks 2 "
               "model.stage_dir=/path/to/stages")
    p.add_argument("--executor", choices=("eager", "replay", "cuda"), help="static executor (default: cuda on a "
                   "GPU, eager on a CPU)")
    add_call_args(p, "verification stage whose layers are timed (rank >= 2)",
                  "key=value run overrides (model.stage_dir, model.head_dir, tree.*)")
    p.add_argument("--no-count", action="store_true", help="skip the operator counts")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def _setup(args, cfg, stage_root: Path):
    """``(calls, toggle, check)``: ``calls`` = ``[(name, fn, levels)]``; ``toggle(static)`` switches every call
    between the dynamic and the static path; ``check()`` -> whether both paths draft the same tree."""
    import torch

    from config.run_config import apply_overrides, parse_graph_buckets
    from draft.static_head import head_buckets, static_head
    from model.graphs import StaticStage, make_executor, resolve_executor
    cfg = apply_overrides(cfg, ["model.graphs=off", "draft.sources=eagle"])     # the paths are toggled here
    buckets = parse_graph_buckets(cfg.model.graph_buckets)
    kind = args.executor or resolve_executor("on", args.device)
    if kind == "cuda" and not args.device.startswith("cuda"):
        raise GraphBenchError("--executor cuda needs --device cuda")
    stage, rank0, drafter, cache, g, dtype, dev = load_stage(args, cfg, stage_root, GraphBenchError,
                                                             max(max(args.rows), max(buckets)) + 8)
    if not hasattr(drafter, "static_head") or not hasattr(getattr(drafter, "head", None), "block"):
        raise GraphBenchError("the drafter has no EAGLE-1/2 head (model.head_dir): nothing to put on static shapes")
    t = cfg.tree
    hb = head_buckets((t.top_k, t.init_topk, t.expand_topk), buckets)
    sh = static_head(drafter.head, kind, hb)
    if sh is None:
        raise GraphBenchError("the head does not run lean layers (model.lean_layers=false?): no static path")
    ss = StaticStage(stage, make_executor(kind), buckets)
    graph_head, graph_stage = (sh, ss) if kind == "cuda" else (
        static_head(drafter.head, "replay", hb), StaticStage(stage, make_executor("replay"), buckets))
    hidden = rank0.config.hidden_size
    state = {"mode": "dynamic"}
    paths = {"dynamic": (None, stage), "static": (sh, ss), "graph": (graph_head, graph_stage)}
    prompt = [int(v) for v in torch.randint(3, rank0.config.vocab_size, (args.ctx,), generator=g)]
    root_hidden = drafter.start(prompt, 5, torch.randn(args.ctx, hidden, generator=g).to(dev, dtype))
    k = t.top_k
    rows = torch.randn(k, hidden, generator=g).to(dev, dtype)

    def head_forward():
        drafter.tree_forward(torch.arange(k), rows, torch.full((k,), -1))
        drafter.drop_tree()

    def tree():
        return drafter.grow_tree(5, root_hidden, t.total_token, t.depth, k)

    def toggle(mode) -> None:
        """``mode``: False / "dynamic", True / "static", or "graph" (counting only: see the module docstring)."""
        mode = {False: "dynamic", True: "static"}.get(mode, mode)
        state["mode"] = mode
        drafter.static_head = paths[mode][0]

    def check() -> bool:
        trees = []
        for mode in ("dynamic", "static", "graph"):
            toggle(mode)
            trees.append(tree())
        return all(torch.equal(a.tokens, trees[0].tokens) and torch.equal(a.parents, trees[0].parents)
                   for a in trees[1:])

    def uncounted_replays() -> None:
        """Once the "graph" path has recorded its forwards (in ``check`` and the warm-up): their replays re-run the
        forward outside the operator counter (a CUDA graph's replay dispatches no aten operator)."""
        if kind == "cuda":
            return
        from torch.utils._python_dispatch import _disable_current_modes
        for ex in (graph_head.static.executor, graph_stage.static.executor):
            for rec in ex.recordings.values():
                if not getattr(rec.replay, "uncounted", False):
                    def quiet(fn=rec.replay) -> None:
                        with _disable_current_modes():
                            fn()
                    quiet.uncounted = True
                    rec.replay = quiet

    calls = [(f"head forward, {k} rows", head_forward, 0), (f"draft tree, per level ({t.depth} levels)", tree,
                                                            t.depth)]
    calls += [(f"stage step, {w} row{'s' if w > 1 else ''} ({stage.num_layers} layers)",
               stage_step(cache, lambda: paths[state["mode"]][1], w, hidden, g, dtype, dev), 0) for w in args.rows]
    device = [stage, rank0, cache.keys, cache.values, root_hidden, rows, drafter.head, drafter.cache.keys,
              drafter.cache.values]
    return calls, toggle, check, kind, (device, [stage, drafter.head, drafter.lm_head], uncounted_replays)


def measure(args, calls, toggle, counted) -> list[dict]:
    from pipeline.tools.opcount import count_call
    out = []
    for name, fn, levels in calls:      # warm both (the static path records its graphs there)
        times = alternate(args, [False, True], lambda static: (toggle(static), (fn, None))[1], warm=3)
        per = max(levels, 1)
        dyn, sta = (statistics.median(times[s]) * 1e3 / per for s in (False, True))
        row = {"call": name, "dynamic_ms": round(dyn, 4), "static_ms": round(sta, 4),
               "static_vs_dynamic": round(sta / dyn, 3) if dyn else None}
        if counted is not None:
            for mode in ("dynamic", "static", "graph"):
                toggle(mode)
                fn()                                     # records this call's graph-path forwards, if new
                counted[2]()
                c = count_call(fn, *counted[0], model=counted[1])
                row[f"{mode}_ops"] = round(c.ops / per, 1)
        out.append(row)
    toggle(False)
    return out


def table(rows: list[dict], header: str) -> str:
    counted = "dynamic_ops" in rows[0]
    cols = ["dynamic, ms", "static, ms", "static / dynamic"] + (
        ["dynamic aten ops", "static aten ops", "aten ops with graphs"] if counted else [])
    return md_table(header, cols, [
        (r["call"], [f"{r['dynamic_ms']:.3f}", f"{r['static_ms']:.3f}", str(r["static_vs_dynamic"])]
         + ([str(r["dynamic_ops"]), str(r["static_ops"]), str(r["graph_ops"])] if counted else [])) for r in rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from pipeline.build import SetupError
        cfg, stage_root = run_setup(args, GraphBenchError)
        try:
            calls, toggle, check, kind, counted = _setup(args, cfg, stage_root)
        except SetupError as e:
            raise GraphBenchError(str(e)) from None
        same = check()
        rows = measure(args, calls, toggle, None if args.no_count else counted)
    except GraphBenchError as e:
        print(f"graphbench: error: {e}", file=sys.stderr)
        return 2
    device = where(args)
    header = (f"# Dynamic vs static shapes ({kind} executor; {stage_root.name}, {args.dtype}, {device}, context "
              f"{args.ctx}; median of {args.blocks} x {args.repeat} calls each; same draft tree: "
              f"{'yes' if same else 'NO'})")
    print(table(rows, header))
    write_json(args.json, {"device": device, "executor": kind, "stage_root": str(stage_root), "dtype": args.dtype,
                           "ctx": args.ctx, "same_tree": same, "rows": rows})
    return 0 if same else 3


if __name__ == "__main__":
    sys.exit(main())
