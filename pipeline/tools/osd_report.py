"""Online speculative decoding report: τ and acceptance against requests served, static vs online.

Two subcommands:

* ``report`` (the default when the first argument is a file): reads one or more row files (``pipeline.run
  --output`` rows, or this module's ``replay`` rows), each a *run* labelled by its file name or ``--labels``; writes
  ``osd_curve.png`` (τ per request and its running mean, against requests served, one line per run, the drafter
  version changes marked), ``osd_rows.csv`` (one line per row), ``osd_summary.csv`` / ``.md`` (per run and
  request group: τ, acceptance = τ - 1 draft tokens accepted per verification, the online / static ratio when a
  run is labelled ``static``).
* ``replay``: serve a recorded stream of answers again through the real rank-0 code of a mode in one process
  (``pipeline.tools.simulate.replay``: the real drafter, tree search and verification; the target's outputs and
  features come from the recording and the unsplit stages), request after request, with whatever drafter the
  ``key=value`` overrides build (``osd.enabled=true`` for online learning). It writes one row per request with
  ``tau``, ``accept_lengths`` and the drafter fields (``drafter_version``, ``osd``). Same accepted lengths as a
  real run at T = 0; at T > 0 a valid sample of the mode's behaviour (see the simulator section of README).

Request groups: a row's ``category`` up to the first ``:`` (e.g. ``stream`` / ``eval``), else ``all``.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

EPILOG = """Examples:
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


def load(path: Path) -> list[dict]:
    from pipeline.outputs import jsonl_lines
    rows = []
    for i, line in jsonl_lines(Path(path), repair=False)[0]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{i} is not a JSON row") from None
        if not isinstance(row, dict) or "tau" not in row:
            raise ValueError(f"{path}:{i} has no tau: not a pipeline.run / osd_report row")
        rows.append(row)
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
            steps = sum(len(r.get("accept_lengths") or []) for r in rs)
            toks = sum(sum(r.get("accept_lengths") or []) for r in rs)
            tau = toks / steps if steps else float("nan")
            out.append({"run": label, "group": g, "requests": len(rs), "verifications": steps, "tau": round(tau, 4),
                        "tau_mean_per_request": round(sum(r["tau"] for r in rs) / len(rs), 4),
                        "acceptance": round(tau - 1, 4), "drafter_version_last": rs[-1].get("drafter_version")})
    static = {s["group"]: s["tau"] for s in out if s["run"] == "static"}
    for s in out:
        s["vs_static"] = round(s["tau"] / static[s["group"]], 4) if s["group"] in static and static[s["group"]] else None
    return out


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
        print(f"error: --labels names {len(labels)} runs but {len(files)} files were given", file=sys.stderr)
        return 2
    runs = {}
    for lab, f in zip(labels, files):
        if not f.is_file():
            print(f"error: {f} does not exist", file=sys.stderr)
            return 2
        try:
            runs[lab] = load(f)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if not runs[lab]:
            print(f"error: {f} has no rows", file=sys.stderr)
            return 2
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

    from config.run_config import DEFAULT, ConfigError, apply_overrides
    from pipeline.outputs import drafter_fields
    from pipeline.build import SetupError, make_drafter
    from pipeline.tools.simulate import load_target, replay
    try:
        cfg = apply_overrides(DEFAULT, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not Path(args.rows).is_file():
        print(f"error: {args.rows} does not exist", file=sys.stderr)
        return 2
    try:
        rows = load(Path(args.rows))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: {args.rows} has no rows", file=sys.stderr)
        return 2
    torch.set_num_threads(cfg.model.num_threads)
    target = load_target(cfg, "cpu")
    try:
        drafter = make_drafter(cfg, target.stage_root, target.model0, target.dtype, "cpu")
    except SetupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.tools.osd_report", description=__doc__.split("\n\n")[0],
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
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("report", "replay", "-h", "--help"):
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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
