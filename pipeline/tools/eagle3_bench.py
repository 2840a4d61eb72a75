"""Measure draft heads: tau (naive mode, T=0) per prompt category through the in-process ring, and rank 0's
drafting time per tree (``Drafter.grow_tree``) for EAGLE-1/2 vs EAGLE-3 heads, full vs reduced vocabulary
(``model.draft_vocab`` for the shipped EAGLE-1/2 head once ``python -m draft.vocab count`` ranked its tokens).

Example::

    python -m pipeline.tools.eagle3_bench tau --head draft/heads/SmolLM2-135M-Instruct --head /tmp/e3/head \\
        --records 2 --max-new-tokens 48
    python -m pipeline.tools.eagle3_bench tau --head draft/heads/SmolLM2-135M-Instruct --draft-vocab 0 \\
        --draft-vocab 16384 --records 4 --max-new-tokens 64
    python -m pipeline.tools.eagle3_bench tau --head draft/heads/SmolLM2-135M-Instruct --set draft.sources=eagle,lookup
    python -m pipeline.tools.eagle3_bench draft-time --draft-vocab 8192 --trees 20
"""
from __future__ import annotations

from config.paths import REPO
import argparse
import json
import sys
import time
from pathlib import Path

import torch

SETS = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")
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


def chat_ids(tok, text: str) -> list[int]:
    from model.prompts import chat_prompt_ids
    return chat_prompt_ids(tok, [text], [], "", "auto")


def cmd_tau(args) -> int:
    from model.prompts import stop_token_ids
    from config.paths import DEFAULT_STAGE_DIR
    from pipeline.inprocess import run_threaded
    from transformers import AutoTokenizer
    torch.set_num_threads(args.threads)
    stage_root = Path(args.stage_dir) if args.stage_dir else DEFAULT_STAGE_DIR
    tok = AutoTokenizer.from_pretrained(str(stage_root / "stage_model_0"))
    stops = stop_token_ids(tok, None)
    cats: dict[str, list[list[int]]] = {}
    for k, texts in HELDOUT.items():
        cats[k] = [chat_ids(tok, t) for t in texts[:args.records]]
    for s in SETS:
        rows = [json.loads(l) for l in (Path(args.data) / s / "question.jsonl").read_text().splitlines() if l.strip()]
        cats[s] = [chat_ids(tok, r["turns"][0]) for r in rows[30:30 + args.records]]
    table = {}
    from draft.head_io import is_eagle3_config, read_head_config
    for head in args.head:
        for n in args.draft_vocab or [0]:
            if n and is_eagle3_config(read_head_config(head)):
                print(f"{head}: an EAGLE-3 head drafts over its own vocabulary; skipping --draft-vocab {n}",
                      file=sys.stderr)
                continue
            name = (head if not n else f"{head} @draft_vocab={n}") + "".join(f" {kv}" for kv in args.set)
            res = {}
            for k, prompts in cats.items():
                out = run_threaded(stage_root, prompts, ["naive"], [f"max_new_tokens={args.max_new_tokens}",
                                   "tree.total_token=60", "tree.depth=5", "tree.top_k=10", "dtype=float32",
                                   f"temperature={args.temperature}", f"seed={args.seed}", f"model.draft_vocab={n}",
                                   "draft.sources=eagle", *args.set],
                                   stops, head, dtype=torch.float32)["naive"]
                res[k] = sum(len(r.output_ids) - 1 for r in out) / max(1, sum(len(r.accept_lengths) for r in out))
                print(f"{name} {k}: tau {res[k]:.2f}", file=sys.stderr, flush=True)
            held = [res[k] for k in HELDOUT]
            res["mean_heldout"], res["mean_six_sets"] = sum(held) / len(held), sum(res[k] for k in SETS) / len(SETS)
            table[name] = res
    print(json.dumps(table, indent=1))
    return 0


def cmd_draft_time(args) -> int:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.tools.eagle3_bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tau", help="tau per category (held-out kinds + the six sets' records [30, 30+N))")
    t.add_argument("--head", action="append", required=True, help="head directory (repeatable)")
    t.add_argument("--records", type=int, default=2, help="prompts per category (held-out kinds have 5)")
    t.add_argument("--max-new-tokens", type=int, default=48)
    t.add_argument("--stage-dir", default=None)
    t.add_argument("--data", default=str(REPO.parent / "shared" / "data"))
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; > 0 samples (the target's law)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--draft-vocab", type=int, action="append", default=[],
                   help="also run each head with model.draft_vocab=N (repeatable; 0 = the whole vocabulary)")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra run key for every run (repeatable; applied last, so it overrides the bench's own "
                        "keys), e.g. --set draft.sources=eagle,lookup")
    t.set_defaults(func=cmd_tau)
    d = sub.add_parser("draft-time", help="rank 0's drafting time per 60/5/10 tree")
    d.add_argument("--draft-vocab", type=int, default=8192)
    d.add_argument("--eagle3-head", default=None)
    d.add_argument("--trees", type=int, default=20)
    d.add_argument("--threads", type=int, default=1)
    d.set_defaults(func=cmd_draft_time)
    args = ap.parse_args(argv)
    bad = [kv for kv in getattr(args, "set", []) if "=" not in kv or kv.startswith("=")]
    if bad:
        ap.error(f"--set takes KEY=VALUE, got {bad[0]!r}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
