"""Per-call cost of a stage step and of rank 0's drafting calls, transformers layers against lean layers, side
by side in one run: ``python -m pipeline.tools.layerbench``.

At batch 1 these calls are short, and on a GPU (or on a CPU with a small model) their time is mostly the host's:
Python, operator dispatch, kernel launches. This measures exactly the calls the step loop makes, on the run's
own stage root, head and drafter (``key=value`` overrides as for ``pipeline.run``), on ``--device``:

* ``stage step, w rows``: one verification stage's layers (``--stage``, a hidden-input stage) on a ``w``-row
  tree segment after a ``--ctx``-token context (``w = 1`` is an ``ar`` step, ``w = 16`` a FlowSpec segment);
* ``draft head forward``: one EAGLE head forward over a 10-row tree level;
* ``first tree``, ``finish first tree``, ``expand``, ``commit``: what ``continuous`` runs at a round start (the
  quick first ``tree.first_levels`` levels, then the rest of the ``tree.init_depth`` levels), after each verified
  step (``tree.expand_levels`` levels) and per commit of 3 accepted tokens. ``first tree before its inputs``: the
  part of the first tree that a round start runs before its send (``draft.protocol.grow_tree_deferred``'s first
  half; the inputs follow the send). ``prefetch``: what ``continuous`` runs after each send while the stages
  compute (``tree.prefetch_level`` with ``tree.early_whole``: the re-fed tree's leaves ranked and the next
  expansion's second level drafted, :meth:`draft.drafter.BeamTreeDrafter.prefetch_expansion`), on the finished
  first tree. ``start``: a generation's start on a ``--ctx``-token prompt (the draft's prefill; it leaves the
  drafter on the context every other call was drafted on).

Each call runs ``--repeat`` times per block with the lean layers off, then on (``model.lean_layers``,
:mod:`model.lean_layer`), for ``--blocks`` alternating blocks (load drift hits both alike); the table gives the
median per-call milliseconds of each and their ratio (CUDA synchronised around every call). Drafted trees are
the same either way; the numbers are this host's only.

``--graphs off,compile`` (any ``model.graphs`` values) compares static-shape executors instead of layer kinds: every
call is built once per value (lean layers), timed in alternating blocks and counted, side by side; a ``compile``
executor's compilation (each bucket's first call, :class:`model.graphs.CompileExecutor`) happens in an untimed warm-up
and is reported apart (seconds and graphs per setting), never inside a per-call figure. What the operator counter
sees of a compiled call: the aten operators the compiled code still dispatches (inductor's extern kernels such as
``mm``/``addmm``, fallbacks such as ``topk``, and the host ops around the compiled body: padding, the static mask,
slots); each fused C++ (or, on CUDA, Triton) kernel of inductor's is not an aten operator and is not counted (one
call each: one launch on a GPU, where reduce-overhead replays the lot as one CUDA graph); the model-op column is 0
there (the head's modules are not called, their forward hooks do not fire).

``--fused-head`` times the draft head's fused forward (:mod:`draft.fused_head`, the default) against the lean layer
path it replaces (``EagleHead.fused`` off), both on lean layers, in the same alternating blocks.

Example::

    python -m pipeline.tools.layerbench --device cpu --blocks 3 --repeat 20 --json outputs/layerbench.json
    python -m pipeline.tools.layerbench --clock thread --graphs off,compile --count model.stage_dir=/tmp/s260
    python -m pipeline.tools.layerbench --clock thread --fused-head --count --blocks 3 --repeat 10 model.stage_dir=/tmp/s260
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from config.invocation import prog
from pipeline.tools.callbench import (add_call_args, alternate, check_args, load_stage, md_table, run_setup, stage_step,
                                      where, write_json)


class LayerBenchError(ValueError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.cli import DefaultsOnce  # each default shown once
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.layerbench"), description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsOnce,
        epilog="Example: python -m pipeline.tools.layerbench --device cpu --blocks 3 --repeat 20 "
               "model.stage_dir=/path/to/stages")
    add_call_args(p, "verification stage whose layers are timed (rank >= 2: it takes hidden rows)",
                  "key=value run overrides (model.stage_dir, model.head_dir, draft.sources, tree.*)")
    p.add_argument("--count", action="store_true", help="also count each call's aten operators and would-be "
                   "host<->device synchronisations (pipeline.tools.opcount; one extra untimed run per call)")
    p.add_argument("--count-only", action="store_true", help="only the counts (deterministic, no timing)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall", help="wall seconds, or this thread's CPU "
                   "seconds (thread: on a loaded shared CPU, time descheduled is not counted; CPU runs only)")
    p.add_argument("--fused-head", action="store_true", help="time the draft head's fused forward "
                   "(draft/fused_head.py) against the lean layer path (both lean layers) instead of transformers vs "
                   "lean layers")
    p.add_argument("--graphs", help="comma-separated model.graphs values (e.g. off,compile) to compare side by side "
                   "instead of transformers vs lean layers (lean layers on; compile time reported apart)")
    args = p.parse_args(argv)
    check_args(p, args)
    if args.graphs is not None:
        from config.run_config import GRAPHS
        args.graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
        bad = [g for g in args.graphs if g not in GRAPHS]
        if bad or not args.graphs or len(set(args.graphs)) != len(args.graphs):
            p.error(f"--graphs takes distinct model.graphs values ({', '.join(GRAPHS)}), got {','.join(args.graphs)!r}")
    return args


def _calls(args, cfg, stage_root: Path):
    """``[(name, fn, setup)]``: every timed call, each leaving the caches as it found them or, where it cannot
    (a commit appends to every source's context), preceded by an untimed ``setup`` that restores them."""
    import torch

    from draft.protocol import grow_tree_deferred
    from pipeline.build import make_static_stage
    stage, rank0, drafter, cache, g, dtype, dev = load_stage(args, cfg, stage_root, LayerBenchError, max(args.rows) + 8)
    hidden = rank0.config.hidden_size
    static = make_static_stage(cfg, stage, args.device)       # model.graphs (None: dynamic shapes)
    forward = stage if static is None else static

    prompt = [int(t) for t in torch.randint(3, rank0.config.vocab_size, (args.ctx,), generator=g)]
    feats0 = torch.randn(args.ctx, hidden, generator=g).to(dev, dtype)
    root_hidden = drafter.start(prompt, 5, feats0)

    def same_start():                    # counting only: the drafter back to the context the trees were drafted on
        drafter.start(prompt, 5, feats0)
    t = cfg.tree
    first = (lambda: drafter.grow_tree_with_inputs(5, root_hidden, min(t.init_total_token, t.subseq_token + 1),
                                                   max(t.first_levels - 1, 0), t.init_topk))
    sent = (lambda: grow_tree_deferred(drafter, 5, root_hidden, min(t.init_total_token, t.subseq_token + 1),
                                       max(t.first_levels - 1, 0), t.init_topk)[0])   # what a round start sends
    from draft.tree import DraftTree
    from pipeline.modes.flowspec import ContinuousMode
    cap = ContinuousMode.capacity(t)     # the round's tree buffers, as continuous preallocates them

    def fresh(x: DraftTree) -> DraftTree:   # x on buffers of its own (an expansion fills them in place)
        return DraftTree(x.tokens, x.parents, x.scores, x.depths, capacity=cap)
    tree, inputs = first()
    tree = fresh(tree)
    st = {}
    finish = (lambda: drafter.extend_tree(st.get("tree", tree), inputs, root_hidden,
                                          t.init_depth + 1 - max(t.first_levels, 1), t.init_topk,
                                          max(t.init_total_token - len(tree), 1)))
    big, big_inputs = finish()
    big = fresh(big)
    expand = (lambda: drafter.extend_tree(st.get("big", big), big_inputs, root_hidden, t.expand_levels,
                                          t.expand_topk, max(t.expand_total_token - len(big), t.expand_topk)))

    def own_buffers():                   # untimed: each drafting call grows a tree that owns its buffers' room
        st.update(tree=fresh(tree), big=fresh(big))
    head_drafter = next((s for s in getattr(drafter, "sources", [drafter]) if hasattr(s, "head")), None)
    if head_drafter is None or not hasattr(head_drafter.head, "block"):
        print("layerbench: note: the drafter has no EAGLE-1/2 head (no lean block): its rows time one path twice",
              file=sys.stderr)
    rows10 = torch.randn(10, hidden, generator=g).to(dev, dtype)

    def head_forward():
        head_drafter.tree_forward(torch.arange(10), rows10, torch.full((10,), -1))
        head_drafter.drop_tree()

    feats3 = torch.randn(3, hidden, generator=g).to(dev, dtype)
    start_feats = torch.randn(args.ctx, hidden, generator=g).to(dev, dtype)

    def restart():                       # untimed: every source back to the same context before each commit
        drafter.start(prompt, 5, start_feats)

    def commit():
        drafter.commit(torch.tensor([7, 8, 9]), feats3)

    prefetch = getattr(drafter, "prefetch_expansion", None)

    def prefetch_call():
        prefetch(big, big_inputs, root_hidden, t.expand_topk, t.early_whole)

    step, step_setup = bookkeeping_call(big, big_inputs, root_hidden, rank0.config.vocab_size, t.subseq_token)
    calls = [(f"stage step, {w} row{'s' if w > 1 else ''} ({stage.num_layers} layers)",
              stage_step(cache, lambda: forward, w, hidden, g, dtype, dev), None, 0) for w in args.rows]
    heads = [s.head for s in getattr(drafter, "sources", [drafter]) if hasattr(getattr(s, "head", None), "block")]
    if head_drafter is not None and hasattr(head_drafter.head, "block"):
        calls.append(("draft head forward, 10 rows", head_forward, None, 0))
    rest = t.init_depth + 1 - max(t.first_levels, 1)
    calls += [(f"first tree ({t.first_levels} levels)", first, None, t.first_levels),
              (f"first tree before its inputs ({t.first_levels} levels)", sent, None, t.first_levels),
              (f"finish first tree ({rest} levels)", finish, own_buffers, rest),
              (f"expand ({t.expand_levels} levels)", expand, own_buffers, t.expand_levels),
              *([(f"prefetch ({len(big)}-node tree)", prefetch_call, None, 0)] if prefetch is not None else []),
              ("commit 3 tokens", commit, restart, 0),
              ("verified step bookkeeping", step, step_setup, 0),
              (f"start ({args.ctx}-token prompt)", same_start, None, 0)]   # back to the trees' context
    blocks = [stage.block] + [h.block for h in heads]
    device = [stage, rank0, cache.keys, cache.values, root_hidden, start_feats, feats3, rows10, big_inputs, inputs]
    for s in getattr(drafter, "sources", [drafter]):
        device += [getattr(s, "head", None), getattr(getattr(s, "cache", None), "keys", None),
                   getattr(getattr(s, "cache", None), "values", None)]
    model = [stage, rank0] + [getattr(s, k, None) for s in getattr(drafter, "sources", [drafter])
                              for k in ("head", "lm_head")]
    executors = [x.static.executor for x in [static] + [getattr(s, "static_head", None)
                                                       for s in getattr(drafter, "sources", [drafter])]
                 if x is not None]
    return calls, blocks, (device, model, same_start, executors)


class _Ring:
    """A transport that only records (the bookkeeping call's outbox sends nowhere)."""
    world = 4

    def send_next(self, msg) -> None:
        self.last = msg

    def send_direct(self, msg) -> None:
        pass


def bookkeeping_call(tree, inputs, root_hidden, vocab: int, seg: int):
    """``(call, setup)``: one verified step's host bookkeeping in ``continuous`` on ``tree`` (rank 0's calls
    between receiving a result and drafting again, model work excluded): the result's alive rows
    (``RankTree.alive_rows``), the walk (``walk_tree``, greedy, on target logits that accept the tree's first-child
    chain), the decision (``Outbox.decide``), the re-root keep-list (``keep_indices_for``, ``RankTree.reroot``,
    the drafter inputs' rows) and packing the next segment (``RankTree.send``). ``setup`` (untimed) sends the
    whole tree in segments of ``seg`` nodes and returns the first as the result that came back."""
    import torch

    from draft.tree import keep_indices_for
    from pipeline.messages import Status
    from pipeline.outbox import Outbox, RankTree
    from pipeline.verify import Sampler, walk_tree
    n = len(tree)
    logits = torch.zeros(n, vocab)
    par = tree.parents.tolist()
    first_child = {}
    for i in range(n - 1, 0, -1):
        first_child[par[i]] = i
    for u, c in first_child.items():
        logits[u, int(tree.tokens[c])] = 1.0
    sampler = Sampler()
    engine = type("E", (), {"comm": _Ring(), "gen": 0})()
    st = {}

    def setup():
        box = Outbox(engine)
        state = RankTree(tree)
        first = None
        for _ in range(_Ring.world):                    # a fill: world segments in flight, the rest waits
            if state.waiting:
                state.send(box, min(seg, state.waiting))
                first = first or box.comm.last
        msg = type(first)(root_hidden.expand(1, first.gids.numel(), -1), first.parents, first.gids)
        box.inflight.popleft()                          # the first segment came back
        st.update(box=box, state=state, msg=msg)

    def call():
        box, state, msg = st["box"], st["state"], st["msg"]
        rows, k = state.alive_rows(msg)
        path, token, new_root = walk_tree(state.tree, k, logits[:k], sampler)
        committed = state.tree.tokens[path[1:]].tolist() + [token]
        path_gids = state.gids[path].tolist()
        if new_root is None:
            box.decide(Status.TRUNCATE, path_gids, -1, False)
            return committed
        box.decide(Status.CONTINUE, path_gids, int(state.gids[new_root]), False)
        keep = keep_indices_for(state.tree, path, new_root)
        state.reroot(keep, len(path))
        kept_inputs = inputs[keep[len(path):].to(inputs.device)]
        if state.waiting:
            state.send(box, min(seg, state.waiting))
        return committed, kept_inputs
    return call, setup


def measure(args, calls, blocks, heads=()) -> list[dict]:
    """Per call, the median ms of the two settings alternated in blocks: lean layers off / on, or with
    ``--fused-head`` the draft ``heads``' fused forward off / on (lean layers on; the same keys, the table says
    which)."""
    from model.layers import set_lean
    import time
    clock = time.thread_time if getattr(args, "clock", "wall") == "thread" else time.perf_counter
    fused = getattr(args, "fused_head", False)

    def setting(on: bool) -> None:
        for b in blocks:
            set_lean(b, on or fused)
        for h in heads:
            h.fused = on or not fused
    rows = []
    for name, fn, setup, _ in calls:
        times = alternate(args, [False, True], lambda lean: (setting(lean), (fn, setup))[1], clock=clock)
        ref, lean = statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3
        rows.append({"call": name, "transformers_ms": round(ref, 3), "lean_ms": round(lean, 3),
                     "lean_vs_transformers": round(lean / ref, 3) if ref else None})
    setting(True)
    return rows


def measure_graphs(args, sets: dict) -> dict:
    """``{setting: [per-call median ms]}`` for ``sets = {model.graphs value: (calls, blocks, device)}``, lean layers:
    every call warmed on every setting first (a compile executor compiles there: untimed), then ``--blocks``
    alternating blocks of ``--repeat`` calls per setting (the order of the settings alternates between blocks)."""
    import time

    from model.layers import set_lean
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    for calls, blocks, _ in sets.values():
        for b in blocks:
            set_lean(b, True)
    names = list(sets)
    out = {g: [] for g in names}
    for j in range(len(next(iter(sets.values()))[0])):
        times = alternate(args, names, lambda g: sets[g][0][j][1:3], clock=clock)
        for g in names:
            out[g].append(round(statistics.median(times[g]) * 1e3, 3))
    return out


def compile_report(executors) -> dict:
    """Compile cost of a setting's executors so far: seconds (first calls of each bucket) and graphs compiled."""
    return {"compile_s": round(sum(getattr(e, "compile_s", 0.0) for e in executors), 1),
            "graphs_compiled": sum(e.stats.get("compiled", 0) for e in executors)}


def graphs_table(names: list[str], per: dict, header: str) -> str:
    """One row per call, for each setting its ms (if timed), ops, syncs and per-level figures, side by side."""
    timed = "ms" in per[names[0]][0]
    cols = []
    for g in names:
        cols += ([f"{g}: ms"] if timed else []) + [f"{g}: ops", f"{g}: syncs", f"{g}: ops / level",
                                                    f"{g}: syncs / level"]
    rows = []
    for j, r0 in enumerate(per[names[0]]):
        cells = []
        for g in names:
            r = per[g][j]
            cells += ([f"{r['ms']:.3f}"] if timed else []) + [str(r["ops"]), str(r["syncs"]),
                                                              str(r.get("ops_per_level", "")),
                                                              str(r.get("syncs_per_level", ""))]
        rows.append((r0["call"], cells))
    return md_table(header, cols, rows)


def run_graphs(args, base_cfg, stage_root: Path) -> tuple[str, dict]:
    """``--graphs``: build every call per setting, time (unless ``--count-only``) and count them side by side."""
    from config.run_config import apply_overrides
    sets = {}
    for g in args.graphs:
        cfg = apply_overrides(base_cfg, [f"model.graphs={g}"])
        calls, blocks, device = _calls(args, cfg, stage_root)
        sets[g] = (calls, blocks, device)
    per = {g: [] for g in args.graphs}
    times = None if args.count_only else measure_graphs(args, sets)
    for g, (calls, blocks, device) in sets.items():
        rows = count(calls, blocks, device)
        for j, r in enumerate(rows):
            per[g].append({**r, **({"ms": times[g][j]} if times else {})})
    compiled = {g: compile_report(sets[g][2][3]) for g in args.graphs}
    return graphs_table(args.graphs, per, "{header}") + "\n\n" + "Compile cost (untimed warm-up, apart from every " \
        "figure above): " + "; ".join(f"{g}: {c['graphs_compiled']} graphs, {c['compile_s']} s"
                                      for g, c in compiled.items()), {"rows": per, "compile": compiled}


def count(calls, blocks, device) -> list[dict]:
    """Per call (lean layers on), one untimed run under :class:`pipeline.tools.opcount.OpCounter`: aten operators
    dispatched, those inside the model's forwards (head, lm_head, stage), those on device tensors, value reads and would-be host<->device synchronisations; per drafted
    level for the drafting calls. Deterministic: the same call on the same inputs counts the same."""
    from model.layers import set_lean
    from pipeline.tools.opcount import count_call
    for b in blocks:
        set_lean(b, True)
    rows = []
    for name, fn, setup, levels in calls:
        for _ in range(2):                  # warm once (first-call caches), then count
            if levels:                      # a drafting call: from the same context every time (counts repeat)
                device[2]()
            if setup is not None:
                setup()
            if _ == 0:
                fn()
        c = count_call(fn, *device[0], model=device[1])
        row = {"call": name, **c.row(), "levels": levels}
        if levels:
            row.update(ops_per_level=round(c.ops / levels, 1),
                       bookkeeping_per_level=round((c.ops - c.model_ops) / levels, 1),
                       syncs_per_level=round(c.syncs / levels, 2))
        rows.append(row)
    return rows


def table(rows: list[dict], header: str, fused: bool = False) -> str:
    timed = "lean_ms" in rows[0]
    counted = "ops" in rows[0]
    names = ["lean head, ms", "fused head, ms", "fused / lean"] if fused else \
        ["transformers layers, ms", "lean layers, ms", "lean / transformers"]
    cols = (names if timed else []) + \
        (["aten ops", "model ops", "device ops", "value reads", "syncs", "ops / level", "bookkeeping ops / level",
          "syncs / level"] if counted else [])
    return md_table(header, cols, [
        (r["call"], ([f"{r['transformers_ms']:.3f}", f"{r['lean_ms']:.3f}", str(r["lean_vs_transformers"])]
                     if timed else [])
         + ([str(r["ops"]), str(r["model_ops"]), str(r["dev_ops"]), str(r["reads"]), str(r["syncs"]),
             str(r.get("ops_per_level", "")), str(r.get("bookkeeping_per_level", "")),
             str(r.get("syncs_per_level", ""))] if counted else [])) for r in rows])


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        from pipeline.build import SetupError
        cfg, stage_root = run_setup(args, LayerBenchError)
        if cfg.osd.enabled:
            raise LayerBenchError("osd.enabled: an online drafter learns from every timed commit; time it without")
        try:
            if args.graphs:
                text, result = run_graphs(args, cfg, stage_root)
            else:
                calls, blocks, device = _calls(args, cfg, stage_root)
        except SetupError as e:
            raise LayerBenchError(str(e)) from None
        if not args.graphs:
            heads = [m for m in device[1] if hasattr(m, "fused")]     # EAGLE-1/2 heads (--fused-head)
            rows = [] if args.count_only else measure(args, calls, blocks, heads)
            if args.count or args.count_only:
                counts = count(calls, blocks, device)
                rows = counts if args.count_only else [{**r, **c} for r, c in zip(rows, counts)]
    except LayerBenchError as e:
        print(f"layerbench: error: {e}", file=sys.stderr)
        return 2
    device = where(args)
    if args.graphs:
        what = "operator counts" if args.count_only else \
            f"time (median of {args.blocks} x {args.repeat} calls each, {args.clock} clock) and operator counts"
        print(text.replace("{header}", f"# Per-call {what}, model.graphs={' vs '.join(args.graphs)}, lean layers "
                                       f"({stage_root.name}, {args.dtype}, {device}, context {args.ctx})"))
        write_json(args.json, {"device": device, "stage_root": str(stage_root), "dtype": args.dtype,
                               "ctx": args.ctx, **result})
        return 0
    what = "lean vs fused draft head, lean layers" if args.fused_head else "transformers vs lean decoder layers"
    header = (f"# Per-call time, {what} ({stage_root.name}, {args.dtype}, {device}, "
              f"context {args.ctx}; median of {args.blocks} x {args.repeat} calls each, {args.clock} clock)") \
        if not args.count_only \
        else f"# Per-call operator counts, lean layers ({stage_root.name}, {args.dtype}, context {args.ctx})"
    print(table(rows, header, args.fused_head))
    write_json(args.json, {"device": device, "stage_root": str(stage_root), "dtype": args.dtype, "ctx": args.ctx,
                           "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
