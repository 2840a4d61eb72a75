"""Online speculative decoding report: τ and acceptance against requests served, static vs online.

Two subcommands:

* ``report`` (the default when the first argument is a file): reads one or more row files (``pipeline.run
  --output`` rows, or this module's ``replay`` rows), each a *run* labelled by its file name or ``--labels``; writes
  ``osd_curve.png`` (τ per request and its running mean, against requests served, one line per run, the drafter
  version changes marked), ``osd_rows.csv`` (one line per row), ``osd_summary.csv`` / ``.md`` (per run and
  request group: τ, acceptance = τ - 1 draft tokens accepted per verification, the online / static ratio when a
  run is labelled ``static``, with its 95% paired-bootstrap interval over requests).
* ``replay``: serve a recorded stream of answers again through the real rank-0 code of a mode in one process
  (``pipeline.tools.simulate.replay``: the real drafter, tree search and verification; the target's outputs and
  features come from the recording and the unsplit stages), request after request, with whatever drafter the
  ``key=value`` overrides build (``osd.enabled=true`` for online learning). It writes one row per request with
  ``tau``, ``accept_lengths`` and the drafter fields (``drafter_version``, ``osd``). Same accepted lengths as a
  real run at T = 0; at T > 0 a valid sample of the mode's behaviour (see docs/simulator.md).

* ``stream``: write a shifted prompt stream (FastChat question format) from a data folder: ``--stream`` requests of
  one domain, then that domain's evaluation records [``--eval-begin``, ``--eval-end``), never repeating a record.
  ``--domain translation`` translates short first turns of the six sets (Natural Questions, Alpaca, MT-bench,
  GSM8K) into French, Spanish and German; the shipped head was never trained on translation (its data:
  ``draft/train/prompt_lists.json``, chat only), so this is a real shift. ``--domain gsm8k,humaneval`` (any of the
  six sets) serves those sets' own records, one set after the other.

Request groups: a row's ``category`` up to the first ``:`` (e.g. ``stream`` / ``eval``), else ``all``.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

from config.errors import UserError, exit_status
from config.invocation import prog

EPILOG = """Examples:
  # a shifted stream: 200 translation requests, then the translation records [30, 50)
  python -m pipeline.tools.osd_report stream --domain translation --data ../shared/data --out stream.jsonl
  # record the target's answers once (any mode; ar is the cheapest), then replay them static and online
  python -m pipeline.tools.launch --standalone --nproc_per_node=5 -m pipeline.run --modes ar \\
      --prompts-file stream.jsonl --first-turn-only max_new_tokens=64 --output ar.jsonl
  python -m pipeline.tools.osd_report replay ar.jsonl --out static.jsonl --mode naive max_new_tokens=64
  python -m pipeline.tools.osd_report replay ar.jsonl --out online.jsonl --mode naive max_new_tokens=64 \\
      osd.enabled=true osd.sync=true osd.loss=fkl osd.sample_source=teacher
  # the report (PNG + CSV + Markdown)
  python -m pipeline.tools.osd_report static.jsonl online.jsonl --labels static,online --out-dir outputs/osd
"""


def _group(row: dict) -> str:
    cat = row.get("category") or ""
    return cat.split(":", 1)[0] if cat else "all"


class ReportError(UserError, ValueError):
    """Bad input to a command: printed as one ``error:`` line, exit 2."""


def load(path: Path) -> list[dict]:
    """The rows of ``path``; a missing file, an empty one or a line that is not a row is a :class:`ReportError`."""
    from pipeline.outputs import jsonl_lines
    if not Path(path).is_file():
        raise ReportError(f"{path} does not exist")
    rows = []
    for i, line in jsonl_lines(Path(path), repair=False)[0]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ReportError(f"{path}:{i} is not a JSON row") from None
        if not isinstance(row, dict) or "tau" not in row:
            raise ReportError(f"{path}:{i} has no tau: not a pipeline.run / osd_report row")
        rows.append(row)
    if not rows:
        raise ReportError(f"{path} has no rows")
    return rows


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """Per run and request group: requests, verifications, τ (tokens per verification over the group, all steps
    pooled), mean per-request τ, acceptance (τ - 1), last drafter version; ``vs_static`` = τ / static's τ of the
    same group when a run is labelled ``static``."""
    out = []
    for label, rows in runs.items():
        groups: dict[str, list[dict]] = {}
        for r in rows:
            groups.setdefault(_group(r), []).append(r)
        for g, rs in groups.items():
            tau = _pooled_tau(rs)
            out.append({"run": label, "group": g, "requests": len(rs),
                        "verifications": sum(len(r.get("accept_lengths") or []) for r in rs), "tau": round(tau, 4),
                        "tau_mean_per_request": round(sum(r["tau"] for r in rs) / len(rs), 4),
                        "acceptance": round(tau - 1, 4), "drafter_version_last": rs[-1].get("drafter_version")})
    static = {s["group"]: s["tau"] for s in out if s["run"] == "static"}
    for s in out:
        s["vs_static"] = round(s["tau"] / static[s["group"]], 4) if s["group"] in static and static[s["group"]] else None
    if "static" in runs:
        by_group = {}
        for label, rows in runs.items():
            for r in rows:
                by_group.setdefault((label, _group(r)), []).append(r)
        for s in out:
            base = by_group.get(("static", s["group"]), [])
            s["vs_static_ci95"] = (paired_ratio_ci(by_group[(s["run"], s["group"])], base)
                                   if s["run"] != "static" else None)
    return out


def _pooled_tau(rows: list[dict]) -> float:
    """All committed tokens / all verifications of ``rows`` (bonus tokens included); NaN without any."""
    steps = sum(len(r.get("accept_lengths") or []) for r in rows)
    return sum(sum(r.get("accept_lengths") or []) for r in rows) / steps if steps else float("nan")


def paired_ratio_ci(rows: list[dict], base: list[dict], n_boot: int = 2000, seed: int = 0) -> list[float] | None:
    """95% paired-bootstrap interval of pooled τ(rows) / τ(base): both runs served the same requests in the same
    order (row ``i`` of each is request ``i``), so requests are resampled together. None when they do not pair."""
    import random
    if not rows or len(rows) != len(base) or any(a.get("question_id") != b.get("question_id")
                                                 for a, b in zip(rows, base)):
        return None
    rng, n, ratios = random.Random(seed), len(rows), []
    for _ in range(n_boot):
        idx = [rng.randrange(n) for _ in range(n)]
        den = _pooled_tau([base[i] for i in idx])
        if den and den == den:
            ratios.append(_pooled_tau([rows[i] for i in idx]) / den)
    ratios.sort()
    if not ratios:
        return None
    return [round(ratios[int(0.025 * len(ratios))], 4), round(ratios[min(len(ratios) - 1, int(0.975 * len(ratios)))], 4)]


def plot(runs: dict[str, list[dict]], png: Path, window: int = 5) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for label, rows in runs.items():
        x = list(range(1, len(rows) + 1))
        taus = [r["tau"] for r in rows]
        run = [sum(taus[max(0, i - window + 1):i + 1]) / len(taus[max(0, i - window + 1):i + 1]) for i in range(len(taus))]
        line, = ax.plot(x, run, label=f"{label} (mean of last {window})")
        ax.scatter(x, taus, s=8, alpha=0.35, color=line.get_color())
        prev = None
        for xi, r in zip(x, rows):
            v = r.get("drafter_version")
            if prev is not None and v != prev:
                ax.axvline(xi - 0.5, color=line.get_color(), alpha=0.25, lw=0.8)
            prev = v
    names = [_group(r) for r in next(iter(runs.values()))]
    for i in range(1, len(names)):
        if names[i] != names[i - 1]:
            ax.axvline(i + 0.5, color="k", ls="--", lw=1)
            ax.text(i + 1, ax.get_ylim()[1], names[i], va="top", fontsize=8)
    ax.set_xlabel("requests served")
    ax.set_ylabel("τ (tokens per verification, incl. bonus)")
    ax.set_title("τ against requests served (thin lines: drafter version swaps; dashed: request group)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def cmd_report(args) -> int:
    files = [Path(f) for f in args.rows]
    labels = args.labels.split(",") if args.labels else [f.stem for f in files]
    if len(labels) != len(files):
        raise ReportError(f"--labels names {len(labels)} runs but {len(files)} files were given")
    runs = {lab: load(f) for lab, f in zip(labels, files)}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "osd_rows.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["run", "index", "question_id", "category", "group", "tau", "acceptance", "steps", "new_tokens",
                    "drafter_version", "osd_updates", "osd_rollbacks", "learner_busy_s"])
        for lab, rows in runs.items():
            for i, r in enumerate(rows, 1):
                o = r.get("osd") or {}
                w.writerow([lab, i, r.get("question_id"), r.get("category"), _group(r), r["tau"],
                            round(r["tau"] - 1, 4), len(r.get("accept_lengths") or []), r.get("new_tokens"),
                            r.get("drafter_version"), o.get("updates"), o.get("rollbacks"), o.get("learner_busy_s")])
    summ = summarize(runs)
    keys = list(summ[0])
    with open(out / "osd_summary.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, keys)
        w.writeheader()
        w.writerows(summ)
    md = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join("" if s[k] is None else str(s[k]) for k in keys) + " |" for s in summ]
    (out / "osd_summary.md").write_text("\n".join(md) + "\n")
    plot(runs, out / "osd_curve.png", args.window)
    print("\n".join(md))
    print(f"[osd_report] wrote {out / 'osd_curve.png'}, osd_rows.csv, osd_summary.csv/.md")
    return 0


def cmd_replay(args) -> int:
    import torch

    from config.run_config import DEFAULT, apply_overrides
    from pipeline.outputs import drafter_fields
    from pipeline.build import make_drafter
    from pipeline.tools.simulate import load_target, replay
    cfg = apply_overrides(DEFAULT, args.overrides)     # a ConfigError, like every error below, is a UserError
    rows = load(Path(args.rows))
    torch.set_num_threads(cfg.model.num_threads)
    target = load_target(cfg, "cpu")                   # SetupError, StageDirError
    drafter = make_drafter(cfg, target.stage_root, target.model0, target.dtype, "cpu")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    with open(out, "w") as fh:
        for i, row in enumerate(rows):
            t0 = time.perf_counter()
            sess = replay([row], args.mode, args.stages or target.world - 1, cfg, drafter, target.vocab_size,
                          target.features)
            g = sess.gens[0]
            tau = sum(g.accept_lengths) / max(1, len(g.accept_lengths))
            rec = {"index": i, "question_id": row.get("question_id"), "category": row.get("category"),
                   "mode": args.mode, "temperature": cfg.gen.temperature, "new_tokens": len(row["output_ids"]),
                   "tau": round(tau, 4), "accept_lengths": g.accept_lengths, "replay_s": round(time.perf_counter() - t0, 3)}
            rec.update(drafter_fields(drafter))
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            if not args.quiet:
                print(f"[osd replay] {i + 1}/{len(rows)} {row.get('category')} tau={tau:.2f} "
                      f"version={rec.get('drafter_version')} {rec['replay_s']:.1f}s", file=sys.stderr, flush=True)
    if hasattr(drafter, "close"):
        drafter.close()
    print(f"[osd replay] {len(rows)} requests in {time.perf_counter() - t_all:.0f}s -> {out}", file=sys.stderr)
    return 0


TRANSLATION_SOURCES = ("qa", "alpaca", "mt_bench", "gsm8k")
TRANSLATION_LANGUAGES = ("French", "Spanish", "German")
MAX_SOURCE_CHARS = 250


def translation_records(data: Path) -> list[dict]:
    """The translation domain: record ``i`` asks to translate the ``i``-th short first turn (< 250 characters)
    taken round-robin from Natural Questions, Alpaca, MT-bench and GSM8K into French, Spanish or German
    (``i % 3``). Deterministic; every source text appears once."""
    pools = []
    for ds in TRANSLATION_SOURCES:
        firsts = [r["turns"][0].strip() for r in dataset_records(data, ds)]
        pools.append([t for t in firsts if len(t) < MAX_SOURCE_CHARS])
    texts, seen = [], set()
    for k in range(max(len(p) for p in pools)):
        for pool in pools:
            if k < len(pool) and pool[k] not in seen:
                seen.add(pool[k])
                texts.append(pool[k])
    return [{"turns": [f"Translate the following text into {TRANSLATION_LANGUAGES[i % 3]}:\n\n{t}"],
             "source": f"translation:{i}"} for i, t in enumerate(texts)]


def dataset_records(data: Path, name: str) -> list[dict]:
    """Set ``name``'s records as one-turn requests (``source`` = ``<name>:<index>``)."""
    from model.prompts import load_questions
    path = data / name / "question.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} does not exist (--data must hold the sets' <dataset>/question.jsonl)")
    return [{"turns": r["turns"][:1], "source": f"{name}:{i}"} for i, r in enumerate(load_questions(path))]


def build_stream(data: Path, domain: str, n_stream: int, eval_begin: int, eval_end: int) -> list[dict]:
    """``n_stream`` records of the domain outside [eval_begin, eval_end) in record order (one set after the other
    for several sets, split evenly), then the records [eval_begin, eval_end) of each set. Categories are
    ``stream:<source>`` and ``eval:<source>`` (the report's request groups)."""
    sets = [translation_records(data)] if domain == "translation" else \
        [dataset_records(data, d) for d in domain.split(",") if d]
    if not sets:
        raise ReportError("--domain names no set")
    share = [n_stream // len(sets) + (1 if k < n_stream % len(sets) else 0) for k in range(len(sets))]
    stream, evals = [], []
    for recs, n in zip(sets, share):
        outside = [r for i, r in enumerate(recs) if not eval_begin <= i < eval_end]
        if len(outside) < n or len(recs) < eval_end:
            raise ReportError(f"{recs[0]['source'].split(':')[0]} has {len(recs)} records: too few for {n} stream "
                              f"records outside [{eval_begin}, {eval_end}) and the evaluation records")
        stream += [("stream", r) for r in outside[:n]]
        evals += [("eval", r) for r in recs[eval_begin:eval_end]]
    return [{"question_id": i, "category": f"{tag}:{r['source']}", "turns": r["turns"]}
            for i, (tag, r) in enumerate(stream + evals)]


def cmd_stream(args) -> int:
    recs = build_stream(Path(args.data), args.domain, args.stream, args.eval_begin, args.eval_end)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as fh:
        for r in recs:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    n_eval = sum(r["category"].startswith("eval:") for r in recs)
    print(f"[osd_report] wrote {out}: {len(recs) - n_eval} stream + {n_eval} evaluation requests", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog("pipeline.tools.osd_report"), description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG)
    sub = p.add_subparsers(dest="cmd")
    r = sub.add_parser("report", help="plots + CSV from row files (default)", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("rows", nargs="+", help="row files (JSONL), one run each, in serving order")
    r.add_argument("--labels", help="comma-separated run labels (default: file names); 'static' is the baseline")
    r.add_argument("--out-dir", default="outputs/osd")
    r.add_argument("--window", type=int, default=5, help="running-mean window in requests (default 5)")
    r.set_defaults(func=cmd_report)
    q = sub.add_parser("replay", help="serve recorded answers again in one process, with the drafter of the overrides",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("rows", help="recorded rows (pipeline.run --output) in serving order")
    q.add_argument("overrides", nargs="*", help="config overrides key=value (osd.enabled=true ...)")
    q.add_argument("--out", required=True, help="output JSONL (overwritten)")
    q.add_argument("--mode", default="naive", help="mode whose rank-0 code is replayed (default naive)")
    q.add_argument("--stages", type=int, default=0, help="layer stages (default: the split's)")
    q.add_argument("--quiet", action="store_true")
    q.set_defaults(func=cmd_replay)
    t = sub.add_parser("stream", help="write a shifted prompt stream (stream requests, then evaluation records)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--domain", default="translation",
                   help="'translation' or comma-separated set names (gsm8k,humaneval); default translation")
    t.add_argument("--data", default="data", help="folder with <dataset>/question.jsonl (default data/)")
    t.add_argument("--stream", type=int, default=200, help="stream requests before the evaluation ones (default 200)")
    t.add_argument("--eval-begin", type=int, default=30)
    t.add_argument("--eval-end", type=int, default=50)
    t.add_argument("--out", required=True, help="output JSONL (FastChat question format)")
    t.set_defaults(func=cmd_stream)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("report", "replay", "stream", "-h", "--help"):
        argv = ["report", *argv]
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    if getattr(args, "cmd", None) == "replay":   # key=value words may sit between the options
        args.overrides = list(args.overrides) + [w for w in rest if "=" in w and not w.startswith("-")]
        rest = [w for w in rest if not ("=" in w and not w.startswith("-"))]
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if not getattr(args, "func", None):
        p.print_help()
        return 2
    return exit_status(lambda: args.func(args))   # ReportError, ConfigError, SetupError, StageDirError: one line


if __name__ == "__main__":
    sys.exit(main())
