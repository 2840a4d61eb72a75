"""Compare drafters: τ per prompt set through the in-process ring for several configurations (``draft.sources``
combinations, draft heads, reduced draft vocabularies), rank 0's work per verification round, a check that every
configuration's output is token-identical to the first one's (T = 0); and, with ``--draft-time``, rank 0's
drafting time per tree (``Drafter.grow_tree``) for EAGLE-1/2 vs EAGLE-3 heads, full vs reduced vocabulary.

A configuration is every combination of ``--sources`` (a ``draft.sources`` value, optionally followed by
``key=value`` overrides of that configuration alone), ``--head`` and ``--draft-vocab`` (``model.draft_vocab``).
Every configuration runs mode ``naive`` (or ``--mode``) at the same tree budget (the run defaults: 60 nodes,
depth 5, top-k 10) through the in-process ring (:mod:`pipeline.inprocess`: the real stage worker, engine and
modes in one process), on the first turn of records ``[--begin, --end)`` of each set: the six evaluation sets
(``config.paths.DATASETS``) and the held-out prompt kinds written here (``translation``, ``rag``, ``extraction``,
``roleplay``: ``--sets heldout`` names all four; five prompts each, records 30..34; a range starting below 30
takes their first ``end - begin`` prompts). A drafter that remembers earlier requests (the suffix store, recycle's
table) starts each set with none (:func:`draft.protocol.forget_requests`): a set's earlier requests are its own
earlier prompts, whatever ran before it. Rows go to
``OUT/rows.jsonl`` as each set finishes (one per generation, with ``prompt_ids``/``output_ids``, so
``python -m pipeline.tools.simulate OUT/rows.jsonl --modes naive draft.sources=...`` replays them under an
emulation profile; each row names its ``head``); a rerun skips the (configuration, head, set) triples already
there. ``OUT/summary.csv`` and the markdown table printed at the end hold the per-set τ and the ratio to the first
configuration.

Examples::

    python -m pipeline.tools.drafter_bench --sources eagle --sources eagle,lookup \\
        --sources eagle,lookup,ssm:draft/ssms/SmolLM2-135M-Instruct/ssm_1 --begin 30 --end 50 --out outputs/drafters
    python -m pipeline.tools.drafter_bench --head draft/heads/SmolLM2-135M-Instruct --head /tmp/e3/head \\
        --sets heldout,mt_bench,gsm8k --begin 30 --end 34 --max-new-tokens 64 --out outputs/heads
    python -m pipeline.tools.drafter_bench --draft-vocab 0 --draft-vocab 16384 --out outputs/vocab
    python -m pipeline.tools.drafter_bench --draft-time --draft-vocab 8192 --trees 20
    python -m pipeline.tools.drafter_bench --sources eagle,lookup --sources "eagle,lookup draft.tree_shape=confidence" \
        --sets six,broad --begin 30 --end 32 --out outputs/shape
    python -m pipeline.tools.drafter_bench --report outputs/a outputs/b --out outputs/ab   # tables of earlier runs

Besides the per-set summary, a table per category (each set, then the pooled ``broad kinds`` and ``six sets``):
τ, tokens per round and rank 0's busy ms per round for every configuration, also written to
``OUT/per_category.csv`` and ``OUT/per_category.jsonl``.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import torch

from config.invocation import prog
from config.paths import DATASETS, REPO

# held-out prompt kinds that the six evaluation sets do not have (written here; not used for training)
HELDOUT = {
    "translation": ["Translate into French: The library opens at nine and closes at six on weekdays.",
                    "Translate this German sentence into English: Ich habe gestern einen langen Brief an meine "
                    "Großmutter geschrieben.",
                    "Translate into Spanish: Please remember to water the tomatoes before you leave for the weekend.",
                    "What does this French sentence mean in English? Le train pour Lyon part dans dix minutes, "
                    "mais nous avons encore le temps de prendre un café.",
                    "Translate into German: The museum is closed on Mondays, but the garden is open every day."],
    "rag": ["Passage: The Nile is about 6,650 km long and flows north through eleven countries before reaching "
            "the Mediterranean Sea. Its two main tributaries are the White Nile and the Blue Nile.\n\nUsing only the "
            "passage, answer and quote it: how long is the Nile and where does it end?",
            "Passage: Honeybees communicate the location of flowers with a 'waggle dance'. The angle of the dance "
            "shows the direction relative to the sun, and its length shows the distance.\n\nUsing only the passage, "
            "answer and quote it: what does the length of the dance tell other bees?",
            "Passage: The town library was built in 1911 with money from a local mill owner. It moved to a larger "
            "building in 1978, and the old building now houses a small museum of weaving.\n\nUsing only the passage, "
            "answer and quote it: what is in the old library building today?",
            "Passage: Octopuses have three hearts. Two pump blood through the gills, and the third pumps it to the "
            "rest of the body. Their blood is blue because it uses copper to carry oxygen.\n\nUsing only the passage, "
            "answer and quote it: why is octopus blood blue?",
            "Passage: The Great Wall was built over many centuries. Most of the parts that tourists visit today were "
            "built during the Ming dynasty, between 1368 and 1644.\n\nUsing only the passage, answer and quote it: "
            "when were the most visited parts of the wall built?"],
    "extraction": ["Extract every person and city from this text as a JSON list: Maria flew from Madrid to Oslo "
                   "to meet Tom, and then they took a train to Bergen with their friend Aiko.",
                   "List all dates and amounts in this text: On 3 March we paid $120 for repairs, and on 15 April "
                   "another $75 for new tyres.",
                   "Extract the product names and prices as JSON from: The shop sells a blue kettle for 25 euros, "
                   "a toaster for 40 euros and a set of four mugs for 12 euros.",
                   "From this email, extract the sender, the meeting day and the room as JSON: Hi team, this is "
                   "Priya. Our planning meeting moves to Thursday and will be held in room 4B.",
                   "Find every company name in this sentence and return them as a JSON list: Last year Acme Foods "
                   "bought a small bakery from Northwind Traders and partnered with Blue River Logistics."],
    "roleplay": ["Let's role-play. You are a lighthouse keeper on a stormy night. A sailor knocks on your door. "
                 "What do you say?",
                 "Pretend you are a tour guide in ancient Rome. Describe what I see in the Forum.",
                 "You are a grumpy but kind old wizard. A young apprentice asks you how to light a candle with magic. "
                 "Answer in character.",
                 "Role-play as a barista in a busy café. I walk in and ask what you would recommend on a cold "
                 "morning.",
                 "Act as the captain of a spaceship that has just landed on an unknown planet. Give your first "
                 "report to mission control."],
}


# the broad (Spec-Bench) kinds of issue 45, each as the set that holds it here: multi-turn chat = mt_bench (first
# turn), summarization = sum, QA = qa, math = gsm8k; translation and RAG = the held-out kinds written above
BROAD = {"multi-turn": "mt_bench", "translation": "translation", "summarization": "sum", "QA": "qa",
         "math": "gsm8k", "RAG": "rag"}


def expand_sets(names: list[str]) -> list[str]:
    """``heldout`` stands for the four held-out kinds, ``broad`` for the sets of the six broad kinds (:data:`BROAD`),
    ``six`` for the six evaluation sets; anything else is a set name. Duplicates are dropped (first kept)."""
    groups = {"heldout": list(HELDOUT), "broad": list(BROAD.values()), "six": list(DATASETS)}
    return list(dict.fromkeys(k for n in names for k in groups.get(n, [n])))


HELDOUT_FIRST = 30     # the held-out kinds' prompts are records 30, 31, ... (the six sets' held-out range)


def heldout_slice(prompts: list[str], begin: int, end: int) -> list[str]:
    """Records ``[begin, end)`` of a held-out kind: prompt ``i`` is record ``HELDOUT_FIRST + i``, so that two runs
    over disjoint record ranges never measure the same prompt twice (``--begin 32 --end 33`` is the third prompt).
    Ranges starting below ``HELDOUT_FIRST`` (calibration runs) take the first ``end - begin`` prompts, as before."""
    if begin >= HELDOUT_FIRST:
        return prompts[begin - HELDOUT_FIRST:max(0, end - HELDOUT_FIRST)]
    return prompts[:max(0, end - begin)]


def load_prompts(data: Path, name: str, begin: int, end: int, tok) -> list[list[int]]:
    from model.prompts import chat_prompt_ids
    if name in HELDOUT:
        return [chat_prompt_ids(tok, [t], [], "", "auto") for t in heldout_slice(HELDOUT[name], begin, end)]
    path = data / name / "question.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (--data points at a folder of <dataset>/question.jsonl)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [chat_prompt_ids(tok, [r["turns"][0]], [], "", "auto") for r in rows[begin:end]]


def summarize(rows: list[dict], configs: list[str], sets: list[str], check_identity: bool = True) -> list[dict]:
    """One summary row per configuration: τ per dataset (all tokens / all verification steps), the mean over
    datasets, its ratio to the first configuration, rank 0's busy ms per round and whether every output equals
    the first configuration's (T = 0 only: ``check_identity``; None otherwise)."""
    def key(r):
        return r["dataset"], r["record"]
    first = {key(r): r["output_ids"] for r in rows if r["sources"] == configs[0]}
    out = []
    for c in configs:
        mine = [r for r in rows if r["sources"] == c]
        s = {"sources": c}
        for d in sets:
            rs = [r for r in mine if r["dataset"] == d]
            steps = sum(len(r["accept_lengths"]) for r in rs)
            s[d] = round(sum(sum(r["accept_lengths"]) for r in rs) / steps, 3) if steps else None
        taus = [s[d] for d in sets if s[d] is not None]
        s["mean"] = sum(taus) / len(taus) if taus else None
        rounds = sum(r["rounds"] for r in mine)
        s["rank0_ms_per_round"] = round(1000 * sum(r["rank0_busy_s"] for r in mine) / rounds, 1) if rounds else None
        s["identical_to_first"] = (all(first.get(key(r)) == r["output_ids"] for r in mine) if check_identity
                                   else None)
        s["generations"] = len(mine)
        out.append(s)
    base = out[0]["mean"] if out and out[0]["mean"] else None
    for s in out:
        s["x_first"] = round(s["mean"] / base, 3) if base and s["mean"] else None
        s["mean"] = round(s["mean"], 3) if s["mean"] else None
    return out


def per_category(rows: list[dict], configs: list[str], sets: list[str]) -> list[dict]:
    """One row per (category, configuration): the sets, then the groups ``broad kinds`` (the sets of :data:`BROAD`
    present) and ``six sets`` (of :data:`config.paths.DATASETS` present), each pooled (all tokens / all steps).
    Fields: ``tau`` (tokens per verification step), ``tokens_per_round``, ``rank0_ms_per_round`` (rank 0's busy
    time over the rounds), ``prompts``, ``steps``, ``rounds``."""
    cats = [(d, [d]) for d in sets]
    for name, members in (("broad kinds", [d for d in BROAD.values() if d in sets]),
                          ("six sets", [d for d in DATASETS if d in sets])):
        if len(members) > 1:
            cats.append((name, members))
    out = []
    for cat, members in cats:
        for c in configs:
            rs = [r for r in rows if r["sources"] == c and r["dataset"] in members]
            steps = sum(len(r["accept_lengths"]) for r in rs)
            toks = sum(sum(r["accept_lengths"]) for r in rs)
            rounds = sum(r["rounds"] for r in rs)
            out.append({"category": cat, "sources": c, "prompts": len(rs), "steps": steps, "rounds": rounds,
                        "tau": round(toks / steps, 3) if steps else None,
                        "tokens_per_round": round(toks / rounds, 3) if rounds else None,
                        "rank0_ms_per_round": round(1000 * sum(r["rank0_busy_s"] for r in rs) / rounds, 1)
                        if rounds else None})
    return out


def category_markdown(cats: list[dict], configs: list[str]) -> str:
    """Categories down, configurations across: ``τ (tokens/round) · rank 0 ms/round`` per cell, prompts per row."""
    head = ["category", "prompts", *(f"`{c}`" for c in configs)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cat in dict.fromkeys(r["category"] for r in cats):
        mine = {r["sources"]: r for r in cats if r["category"] == cat}
        cells = []
        for c in configs:
            r = mine.get(c)
            cells.append("-" if not r or r["tau"] is None else
                         f"{r['tau']:.2f} ({r['tokens_per_round']:.2f}) · {r['rank0_ms_per_round']}")
        n = sorted({r["prompts"] for r in mine.values()})
        lines.append(f"| {cat} | {'/'.join(map(str, n))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_reports(out: Path, rows: list[dict], configs: list[str], sets: list[str], check_identity: bool) -> bool:
    """``summary.csv``, ``per_category.csv`` and ``per_category.jsonl`` under ``out``; prints both tables. True
    when every configuration's output equals the first one's (or ``check_identity`` is off)."""
    summary = summarize(rows, configs, sets, check_identity=check_identity)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    cats = per_category(rows, configs, sets)
    with (out / "per_category.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(cats[0]))
        w.writeheader()
        w.writerows(cats)
    with (out / "per_category.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in cats)
    print(markdown(summary, sets))
    print()
    print("τ (tokens per round) · rank 0 ms per round, per category:")
    print(category_markdown(cats, configs))
    return all(s["identical_to_first"] is not False for s in summary)


def report(args) -> int:
    """``--report ROWS...``: the tables of rows already written (several runs' ``rows.jsonl``, e.g. one process per
    configuration or per ``--head-dir``: :func:`label_heads` tells the heads apart), configurations in order of
    first appearance (the first is the reference), sets as ``--sets`` (those present when not given)."""
    from pipeline.outputs import read_rows
    rows = []
    for p in args.report:
        path = Path(p) / "rows.jsonl" if Path(p).is_dir() else Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such rows file")
        rows += read_rows(path)
    if not rows:
        raise FileNotFoundError("no rows in " + ", ".join(args.report))
    rows = label_heads(rows)
    configs = list(dict.fromkeys(r["sources"] for r in rows))
    present = list(dict.fromkeys(r["dataset"] for r in rows))
    sets = [d for d in expand_sets(args.sets) if d in present] if args.sets_given else present
    ok = write_reports(Path(args.out), rows, configs, sets, check_identity=all(r["temperature"] == 0 for r in rows))
    return 0 if ok else 1


def markdown(summary: list[dict], sets: list[str]) -> str:
    head = ["sources", *sets, "mean", "× first", "rank 0 ms / round", "identical"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summary:
        cells = [f"`{s['sources']}`", *(f"{s[d]:.2f}" if s[d] is not None else "-" for d in sets),
                 f"{s['mean']:.2f}" if s["mean"] else "-", f"{s['x_first']:.2f}" if s["x_first"] else "-",
                 f"{s['rank0_ms_per_round']}",
                 {True: "yes", False: "**NO**", None: "(T > 0)"}[s["identical_to_first"]]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def configurations(args) -> list[tuple[str, str, list[str]]]:
    """``(label, head, overrides)`` of every configuration: ``--sources`` x ``--head`` x ``--draft-vocab``; the head
    as the run uses it (each ``--head``, else ``--head-dir``, else the shipped head: the one home of that rule). The
    label names what varies (the sources string as given, then `` model.head_dir=H`` / `` model.draft_vocab=N``)."""
    from config.paths import DEFAULT_HEAD_DIR
    from pipeline.inprocess import head_key     # rows name a head directory by its resolved path (reruns, --report)
    out = []
    heads = [head_key(h) for h in (args.head or [args.head_dir or str(DEFAULT_HEAD_DIR)])]
    vocabs = args.draft_vocab or [None]
    for c in args.sources or ["eagle"]:
        for h in heads:
            for n in vocabs:
                sources, *own = c.split()   # "eagle,lookup,ssm:DIR draft.ssm_score_scale=3": its own overrides last
                label = c + (f" model.head_dir={h}" if len(heads) > 1 else "") + \
                    (f" model.draft_vocab={n}" if n is not None and len(vocabs) > 1 else "")
                over = [f"draft.sources={sources}", *([f"model.draft_vocab={n}"] if n is not None else []), *own]
                out.append((label, h, over))
    return out


def run(args) -> int:
    from config.paths import DEFAULT_STAGE_DIR
    from model.prompts import stop_token_ids
    from pipeline.build import load_tokenizer
    from pipeline.inprocess import run_threaded
    torch.set_num_threads(args.threads)
    stage_root = Path(args.stage_dir) if args.stage_dir else DEFAULT_STAGE_DIR
    configs = configurations(args)
    sets = expand_sets(args.sets)
    from model.stage_format import read_manifest
    world = len(read_manifest(stage_root)["split"])
    tok = load_tokenizer(stage_root)
    stops = stop_token_ids(tok, None)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    from pipeline.outputs import read_rows
    rows = read_rows(rows_path) if rows_path.is_file() else []
    # a row is done for its configuration AND head (a rerun in the same --out with another --head-dir runs anew;
    # rows written before rows named their head count for none)
    done = {(r["sources"], r.get("head"), r["dataset"]) for r in rows}
    mine = {(c, head) for c, head, _ in configs}
    data = Path(args.data)
    prompts = {d: load_prompts(data, d, args.begin, args.end, tok) for d in sets}
    for c, head, own in configs:
        for d in sets:
            if (c, head, d) in done:
                continue
            t0 = time.time()
            over = [f"max_new_tokens={args.max_new_tokens}", "dtype=float32", f"temperature={args.temperature}",
                    f"seed={args.seed}", *args.overrides, *own]
            res = run_threaded(stage_root, prompts[d], [args.mode], over, stops, head,
                               dtype=torch.float32)[args.mode]
            with rows_path.open("a") as f:
                for i, (p, r) in enumerate(zip(prompts[d], res)):
                    row = {"sources": c, "head": head, "dataset": d, "record": args.begin + i,
                           "mode": args.mode,
                           "prompt_ids": p, "output_ids": r.output_ids, "accept_lengths": r.accept_lengths,
                           "rounds": r.rounds, "decode_s": r.decode_s,
                           "rank0_busy_s": (r.busy_fraction[0] if r.busy_fraction else 0.0) * r.decode_s,
                           "world_size": world, "temperature": args.temperature}
                    rows.append(row)
                    f.write(json.dumps(row) + "\n")
            taus = [r.tau for r in res]
            print(f"[drafter_bench] {c} {d}: tau {sum(taus) / max(1, len(taus)):.2f} ({len(res)} prompts, "
                  f"{time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    rows = [r for r in rows if (r["sources"], r.get("head")) in mine]   # this run's configurations only
    ok = write_reports(out, rows, [c for c, _, _ in configs], sets, check_identity=args.temperature == 0)
    return 0 if ok else 1


def label_heads(rows: list[dict]) -> list[dict]:
    """``rows`` with `` head=H`` added to the configuration label (``sources``) of every row whose label other rows
    carry with another head (``--report`` over runs with different ``--head-dir``: each run's label names its
    sources only); other rows as they are. A row written before rows named their head counts as head ``?``."""
    heads: dict[str, set] = {}
    for r in rows:
        heads.setdefault(r["sources"], set()).add(r.get("head"))
    return [dict(r, sources=f"{r['sources']} head={r.get('head') or '?'}") if len(heads[r["sources"]]) > 1 else r
            for r in rows]


def draft_time(args) -> int:
    """Median seconds per ``grow_tree`` (60/5/10) for: the shipped EAGLE-1/2 head, an EAGLE-3 head with the full
    vocabulary and one with ``--draft-vocab`` (random weights: timing only; the tree shape is fixed)."""
    from draft.drafter import Drafter
    from draft.load_head import load_draft_head
    from draft.eagle3 import init_eagle3_head
    from model.stage_model import load_stage
    from config.paths import DEFAULT_HEAD_DIR, DEFAULT_STAGE_DIR
    torch.set_num_threads(args.threads)
    m0 = load_stage(DEFAULT_STAGE_DIR, 0, 5, torch.float32)
    cfg = m0.config
    heads = {"eagle1/2 (shipped)": load_draft_head(DEFAULT_HEAD_DIR, cfg, m0.embed_tokens.weight.data)}
    from draft.vocab import COUNTS_FILE, draft_vocab_ids
    ranked = (DEFAULT_HEAD_DIR / COUNTS_FILE).is_file()
    ids = draft_vocab_ids(args.draft_vocab, DEFAULT_HEAD_DIR, cfg.vocab_size) if ranked else None
    if not ranked:
        print(f"no {COUNTS_FILE} beside {DEFAULT_HEAD_DIR}: the shipped head is timed with its full vocabulary only",
              file=sys.stderr)
    if ids is not None:   # the shipped head drafting over its N most frequent tokens (model.draft_vocab=N)
        heads[f"eagle1/2 (shipped), draft_vocab {args.draft_vocab}"] = (heads["eagle1/2 (shipped)"], ids)
    if args.eagle3_head:
        heads["eagle3 (trained)"] = load_draft_head(args.eagle3_head, cfg, m0.embed_tokens.weight.data)
    heads["eagle3 full vocab"] = init_eagle3_head(cfg)
    heads[f"eagle3 vocab {args.draft_vocab}"] = init_eagle3_head(cfg, vocab_map=torch.arange(args.draft_vocab))
    rows = {}
    g = torch.Generator().manual_seed(0)
    for name, head in heads.items():
        head, ids = head if isinstance(head, tuple) else (head, None)
        head = head.float().eval()
        if hasattr(head, "aux_layers"):
            head.embed_tokens.weight.data.copy_(m0.embed_tokens.weight.data)
        d = Drafter(head, m0.lm_head, 1024, draft_ids=ids)
        width = cfg.hidden_size * 4 if hasattr(head, "aux_layers") else cfg.hidden_size
        feats = torch.randn(200, width, generator=g)
        root = d.start(list(range(1, 201)), 5, feats)
        times = []
        for i in range(args.trees + 2):
            t0 = time.perf_counter()
            d.grow_tree(5, root, 60, 5, 10)
            times.append(time.perf_counter() - t0)
        times = sorted(times[2:])
        rows[name] = round(times[len(times) // 2] * 1000, 2)
        print(f"{name}: {rows[name]} ms per tree", file=sys.stderr, flush=True)
    print(json.dumps({"ms_per_tree_median": rows, "threads": args.threads}, indent=1))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog("pipeline.tools.drafter_bench"), description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", action="append", default=[],
                    help="a draft.sources value, optionally followed by key=value overrides of this configuration "
                         "alone, e.g. 'eagle,lookup,ssm:DIR draft.ssm_score_scale=3' (repeatable; the first is the "
                         "reference; default: eagle)")
    ap.add_argument("--head", action="append", default=[],
                    help="a draft head (model.head_dir value; repeatable: every configuration runs with each)")
    ap.add_argument("--draft-vocab", type=int, action="append", default=[],
                    help="model.draft_vocab=N for every configuration (repeatable; 0 = the whole vocabulary; none given: "
                         "the run default, auto = 16384 for the shipped heads); "
                         "with --draft-time: the reduced vocabulary timed (default 8192)")
    ap.add_argument("--sets", type=lambda s: s.split(","), default=None,
                    help="comma-separated sets: the six evaluation sets and/or the held-out kinds "
                         f"({', '.join(HELDOUT)}; 'heldout' = all four; 'six' = the six sets; 'broad' = the sets "
                         "of the broad kinds: " + ", ".join(f"{k} = {v}" for k, v in BROAD.items()) +
                         "; default: the six sets)")
    ap.add_argument("--report", nargs="+", default=None, metavar="ROWS",
                    help="instead of running: the tables (and CSV/JSONL under --out) of rows.jsonl files or folders "
                         "already written, e.g. one run per configuration")
    ap.add_argument("--begin", type=int, default=30)
    ap.add_argument("--end", type=int, default=50)
    ap.add_argument("--mode", default="naive", help="decoding mode (e.g. sps with draft.sources=ssm:<dir>)")
    ap.add_argument("--temperature", type=float, default=0.0, help="T > 0: no identity check (outputs are draws)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data"), help="folder of <dataset>/question.jsonl")
    ap.add_argument("--stage-dir", default=None, help="stage root (default: the SmolLM2 split)")
    ap.add_argument("--head-dir", default=None, help="the head when no --head is given (default: the shipped one)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="output folder (rows.jsonl, summary.csv); required unless --draft-time")
    ap.add_argument("--draft-time", action="store_true",
                    help="instead: median ms per 60/5/10 grow_tree of the shipped head, EAGLE-3 heads (random "
                         "weights: timing only) with the full and a reduced vocabulary")
    ap.add_argument("--eagle3-head", default=None, help="--draft-time: also time this trained EAGLE-3 head")
    ap.add_argument("--trees", type=int, default=20, help="--draft-time: trees timed per head")
    ap.add_argument("overrides", nargs="*", help="further key=value run overrides")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.sets_given = args.sets is not None
    if args.sets is None:
        args.sets = list(DATASETS)
    if args.draft_time:
        args.draft_vocab = args.draft_vocab[-1] if args.draft_vocab else 8192
        return draft_time(args)
    if not args.out:
        ap.error("--out is required (unless --draft-time)")
    bad = [kv for kv in args.overrides if "=" not in kv or kv.startswith("=")]
    if bad and not args.report:
        ap.error(f"overrides take KEY=VALUE, got {bad[0]!r}")
    from config.run_config import ConfigError
    if not args.report:       # run_threaded refuses a head named by an override; say so before loading anything
        from config.run_config import DEFAULT, apply_overrides
        from pipeline.inprocess import head_conflict, not_in_process
        for _, head, own in configurations(args):
            try:
                named = head_conflict([*args.overrides, *own], head)
                why = not_in_process(apply_overrides(DEFAULT, [*args.overrides, *own]))
            except ConfigError as e:
                print(f"[drafter_bench] error: {e}", file=sys.stderr)
                return 2
            if why is not None:
                print(f"[drafter_bench] error: {why}", file=sys.stderr)
                return 2
            if named is not None:
                ap.error(f"give the head as --head-dir DIR (or --head DIR, repeatable), not as an override ({named!r})")
    try:
        return report(args) if args.report else run(args)
    except FileNotFoundError as e:
        print(f"[drafter_bench] error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
