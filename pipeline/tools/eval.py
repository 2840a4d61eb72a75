"""Evaluation sweep (``./run_eval.sh`` or ``python -m pipeline.tools.eval``): modes x datasets x temperatures.

For every dataset and temperature the driver launches one ``python -m pipeline.tools.launch ... -m pipeline.run`` with the records
still missing (``--prompts-file`` holding just those, every MT-bench turn asked with the previous answer fed
back, one untimed warm-up generation per mode) and copies each generation's JSON line into
``<out-dir>/rows.jsonl`` as soon as it appears, adding ``dataset``. A row's key is (dataset, question_id,
turn, mode, temperature): rerunning the same command skips every key already there, so a crashed sweep
resumes where it stopped without duplicates (a half-written last line is cut off first).

Then it writes the paper-style summary: ξ = decode throughput (Σ new tokens / Σ decode seconds, prefill
excluded, in modeled time when the emulated testbed is dilated), SR = ξ / ξ(Chunk-PP = ``naive``), and τ (mean
tokens committed per verification, bonus included), per dataset and their mean, as ``summary.md``,
``summary.csv`` and bar charts ``xi.png``, ``sr.png``, ``tau.png``. At T=0 every mode must reproduce ``ar``'s
tokens exactly; any difference is printed loudly and the exit status is 3.

``--answer-dir DIR`` also writes FastChat llm_judge answer files,
``DIR/<dataset>/model_answer/<model>-<mode>-t<T>.jsonl``, whose ``model_id`` is that file's stem (llm_judge
names a model by its answer file), one line per question with all its turns.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

from config.errors import UserError, exit_status
from config.invocation import prog
from config.modes import COMPARED_MODES, label
from config.paths import DATA, DATASET_LABELS, DATASETS, OUTPUTS
from pipeline.tools.ranks import child_env, job_command, log_tail, run_job
from pipeline.tools.rows import (UNTRAINED_WARNING, RowTailer, find_mismatches, head_line, losslessness_md,
                                 mismatch_banner, sr_baseline, untrained)

META_KEYS = ("profile", "time_scale", "max_new_tokens", "stage_dir", "head_dir", "overrides", "world", "draft_sources")


def draft_sources(overrides: list[str], default: str | None = None) -> str:
    """The effective ``draft.sources`` of a sweep's overrides: the last ``draft.sources=`` wins, else ``default``
    (None: today's default); "" and "eagle" are the same drafter. A meta.json written before this key existed
    ran with the old default, the head alone: its value is ``draft_sources(its overrides, "eagle")``, so a resume
    under the new default is refused instead of mixing rows of two drafters."""
    from config.run_config import DEFAULT
    value = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("draft.sources=")),
                 DEFAULT.draft.sources if default is None else default)
    return value.replace(" ", "") or "eagle"


class EvalError(UserError, RuntimeError):
    """Bad input to the sweep; ``main`` prints it, like every other :class:`UserError` (a bad override, profile,
    stage root or question file), as one line and exits 2."""


def parse_args(argv=None) -> argparse.Namespace:
    from pipeline.cli import DefaultsOnce  # each default shown once
    p = argparse.ArgumentParser(
        prog=prog("pipeline.tools.eval"),
        description="Sweep decoding modes x datasets x temperatures through the pipeline (optionally on the "
                    "emulated edge testbed), resumably, and summarise throughput ξ, speed-up SR over Chunk-PP "
                    "(naive) and τ as Markdown, CSV and plots. At T=0 every mode's output must equal ar's.",
        epilog="Extra key=value words are config overrides passed to every pipeline run (see "
               "config/run_config.py), e.g. tree.init_depth=5. Prepare the datasets with "
               "`python -m data.prepare --from DIR` (DIR/<dataset>/question.jsonl). Example: ./run_eval.sh "
               "--datasets mt_bench,gsm8k --modes ar,naive,continuous --temperatures 0 --begin 30 --end 33",
        formatter_class=DefaultsOnce)
    p.add_argument("overrides", nargs="*", help="config overrides key=value for pipeline.run")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated dataset folders")
    p.add_argument("--modes", default=",".join(COMPARED_MODES), help="comma-separated modes")
    p.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    p.add_argument("--begin", type=int, default=30, help="first record of each question.jsonl (0-based)")
    p.add_argument("--end", type=int, default=50, help="end record (exclusive)")
    p.add_argument("--first-turn-only", action="store_true", help="ask only each record's first turn")
    p.add_argument("--data-dir", default=str(DATA), help="holds <dataset>/question.jsonl")
    p.add_argument("--profile", default="edge_orin_7b",
                   help="emulation profile (builtin name or JSON path); 'none' = real timing")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="emulation time dilation (see pipeline/emulation.py); ξ is reported in modeled time")
    p.add_argument("--max-new-tokens", type=int, default=256, help="tokens per generation (the paper: 256)")
    p.add_argument("--stage-dir", default="", help="split checkpoint (default: the embedded SmolLM2 split)")
    p.add_argument("--head-dir", default="", help="EAGLE head (default: the default model's head)")
    p.add_argument("--world", type=int, default=0, help="ranks (default: from the stage manifest)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per mode and launch")
    p.add_argument("--out-dir", default="", help="results folder [outputs/eval/<profile>]")
    p.add_argument("--summarize-only", action="store_true", help="run nothing; summarise the rows there")
    p.add_argument("--no-plots", action="store_true", help="skip the matplotlib charts")
    p.add_argument("--answer-dir", default="",
                   help="also write FastChat llm_judge answer files DIR/<dataset>/model_answer/<model>-<mode>-t<T>.jsonl "
                        "(model_id = the file stem; questions already there are kept)")
    p.add_argument("--quiet", action="store_true", help="less progress output")
    return p.parse_intermixed_args(argv)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _key(row: dict) -> tuple:
    return (row["dataset"], row["question_id"], int(row["turn"]), row["mode"], float(row["temperature"]))


# -- rows file ------------------------------------------------------------------------------------------
def load_rows(path: Path, repair: bool = True, log=print) -> list[dict]:
    """Rows of a JSONL results file; a partial last line (a crash mid-write) is dropped and, with
    ``repair``, cut from the file so that appends start on a fresh line. Corrupt lines are skipped."""
    from pipeline.outputs import jsonl_lines
    lines, dropped = jsonl_lines(path, repair)
    if dropped:
        log(f"[eval] {path}: dropping a partially written last line ({dropped} bytes)")
    rows = []
    for i, line in lines:
        try:
            row = json.loads(line)
            _key(row)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            log(f"[eval] {path}:{i}: skipping a corrupt line")
            continue
        rows.append(row)
    return rows


class RowSink:
    """Appends rows to the results file, skipping keys already present."""

    def __init__(self, path: Path, done: set) -> None:
        self.path, self.done = path, done
        self.added = 0

    def add(self, row: dict) -> bool:
        k = _key(row)
        if k in self.done:
            return False
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done.add(k)
        self.added += 1
        return True


# -- planning -------------------------------------------------------------------------------------------
def load_dataset(data_dir: Path, ds: str, begin: int, end: int) -> list[dict]:
    from model.prompts import load_questions
    path = data_dir / ds / "question.jsonl"
    if not path.is_file():
        raise EvalError(f"dataset {ds!r} is missing: {path} does not exist. Prepare it with "
                        f"`python -m data.prepare --from DIR --out {data_dir}` (DIR/{ds}/question.jsonl, "
                        f"EAGLE/FlowSpec layout) or pass --data-dir")
    recs = load_questions(path, begin, end)
    for r in recs:
        if "question_id" not in r:
            raise EvalError(f"{path}: a record lacks question_id")
    if not recs:
        raise EvalError(f"{path}: no records in [{begin}, {end})")
    return recs


def plan(records: dict, modes: list[str], temps: list[float], done: set, first_turn_only: bool) -> list[tuple]:
    """``[(dataset, temperature, [modes], [records])]``: missing work, modes with equal gaps batched."""
    chunks = []
    for ds, recs in records.items():
        for t in temps:
            groups: dict[tuple, list[str]] = {}
            for m in modes:
                missing = tuple(r["question_id"] for r in recs
                                if any((ds, r["question_id"], ti, m, float(t)) not in done
                                       for ti in range(1 if first_turn_only else len(r["turns"]))))
                if missing:
                    groups.setdefault(missing, []).append(m)
            for qids, ms in groups.items():
                chunks.append((ds, t, ms, [r for r in recs if r["question_id"] in set(qids)]))
    return chunks


def run_chunk(chunk, args, common: list[str], world: int, out_dir: Path, sink: RowSink, log) -> int:
    ds, temp, modes, recs = chunk
    tmp = out_dir / "tmp"
    logs = out_dir / "logs"
    tmp.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    tag = f"{ds}-T{temp:g}-{'+'.join(modes)}"
    prompts = tmp / f"{tag}.questions.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    part = tmp / f"{tag}.rows.jsonl"
    part.unlink(missing_ok=True)
    run_args = [*common, f"gen.temperature={temp}", "--prompts-file", str(prompts), "--modes", ",".join(modes),
                "--output", str(part), "--quiet", "--warmup", str(args.warmup)]
    if args.first_turn_only:
        run_args.append("--first-turn-only")
    cmd = job_command(world, run_args)
    # FLOWSPEC_PARENT_PID: the launcher stops its job when this driver dies, even by kill -9 (parent-death signal)
    env = child_env(FLOWSPEC_PARENT_PID=str(os.getpid()))
    n_turns = sum(1 if args.first_turn_only else len(r["turns"]) for r in recs) * len(modes)
    log(f"[eval] {tag}: {len(recs)} records, {n_turns} generations (log: {logs / (tag + '.log')})")
    tailer = RowTailer(part)

    def transfer() -> None:
        for row in tailer.poll():
            row["dataset"] = ds
            if sink.add(row) and not args.quiet:
                log(f"[eval]   {ds} q{row['question_id']} turn {row['turn']} {row['mode']} T={temp:g}: "
                    f"{row['new_tokens']} tokens, {_xi_row(row):.2f} tok/s, tau {row['tau']:.2f}"
                    + (" [emulation overruns]" if row.get("emu_flag") else ""))

    try:
        rc = run_job(cmd, logs / f"{tag}.log", env, transfer, poll_s=1.0, append=True)
    except KeyboardInterrupt:  # Ctrl-C (the job runs in its own session: run_job stopped it)
        transfer()
        print(f"[eval] interrupted: stopped the {tag} job; rows so far are kept, rerun the same command to "
              f"resume", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    transfer()
    if rc:
        log(f"[eval] {tag}: pipeline exited {rc}; last log lines:{log_tail(logs / f'{tag}.log', 15)}")
    return rc


def _answer_order(key: tuple) -> tuple:
    ds, mode, t, qid = key
    return ds, mode, t, (0, qid, "") if isinstance(qid, int) else (1, 0, str(qid))


# -- llm_judge answers ---------------------------------------------------------------------------------
def write_answers(rows: list[dict], answer_dir: Path, model: str, first_turn_only: bool = False) -> list[Path]:
    """FastChat llm_judge answer files of ``rows``: one per (dataset, mode, temperature),
    ``answer_dir/<dataset>/model_answer/<model>-<mode>-t<T>.jsonl`` with ``model_id`` = the file stem, one line per
    question whose turns are all in ``rows`` (as many as any mode has for it; only the first with
    ``first_turn_only``), in question order. A
    question already in the file is not written again (``pipeline.outputs.AnswerFile``)."""
    from pipeline.outputs import AnswerFile
    turns: dict[tuple, dict[int, str]] = defaultdict(dict)
    for r in rows:
        turns[(r["dataset"], r["mode"], float(r["temperature"]), r["question_id"])][int(r["turn"])] = \
            str(r.get("text", "")).strip()
    n_turns: dict[tuple, int] = defaultdict(int)   # a question's turns: the most any mode or temperature has
    for (ds, _, _, qid), got in turns.items():
        n_turns[(ds, qid)] = max(n_turns[(ds, qid)], max(got) + 1)
    files: dict[tuple, AnswerFile] = {}
    for (ds, mode, t, qid), got in sorted(turns.items(), key=lambda kv: _answer_order(kv[0])):
        n = 1 if first_turn_only else n_turns[(ds, qid)]
        if any(i not in got for i in range(n)):
            continue
        key = (ds, mode, t)
        if key not in files:
            path = Path(answer_dir) / ds / "model_answer" / f"{model}-{mode}-t{t:g}.jsonl"
            files[key] = AnswerFile(path, path.stem)
        files[key].add(qid, [got[i] for i in range(n)])
    return [f.path for f in files.values()]


# -- summary --------------------------------------------------------------------------------------------
def _scale(row: dict) -> float:
    return float(row.get("emu_time_scale") or 1.0)


def _xi_row(row: dict) -> float:
    d = row["decode_s"] / _scale(row)
    return row["new_tokens"] / d if d > 0 else 0.0


def aggregate(rows: list[dict]) -> dict:
    """(temperature, mode, dataset) -> metrics."""
    acc = defaultdict(lambda: {"n": 0, "tokens": 0, "decode_s": 0.0, "acc_sum": 0, "acc_n": 0, "flagged": 0,
                               "over_s": 0.0, "model_s": 0.0, "emu": False, "over_ops": 0, "ops": 0})
    for r in rows:
        a = acc[(float(r["temperature"]), r["mode"], r["dataset"])]
        a["n"] += 1
        a["tokens"] += r["new_tokens"]
        a["decode_s"] += r["decode_s"] / _scale(r)
        a["acc_sum"] += sum(r.get("accept_lengths") or [])
        a["acc_n"] += len(r.get("accept_lengths") or [])
        a["flagged"] += bool(r.get("emu_flag"))   # also simulate's predictions of flagged recorded rows
        if "emu_profile" in r:
            a["emu"] = True
            a["over_s"] += r.get("emu_overrun_s", 0.0)
            a["model_s"] += r.get("emu_modeled_s", 0.0) + r.get("emu_link_modeled_s", 0.0)
            a["over_ops"] += r.get("emu_overrun_ops", 0)
            a["ops"] += r.get("emu_ops", 0)
    out = {}
    for k, a in acc.items():
        out[k] = dict(a, xi=a["tokens"] / a["decode_s"] if a["decode_s"] > 0 else 0.0,
                      tau=a["acc_sum"] / a["acc_n"] if a["acc_n"] else 0.0)
    return out


def _fmt(v: float, nd: int = 2) -> str:
    return f"{v:.{nd}f}"


def summarize(rows: list[dict], datasets: list[str], modes: list[str], temps: list[float], meta: dict,
              mismatch: tuple) -> tuple[str, str]:
    agg = aggregate(rows)
    md = io.StringIO()
    w = md.write
    scale = meta.get("time_scale") or 1.0
    prof = meta.get("profile") or "none"
    w("# Evaluation summary\n\n")
    if untrained(rows):
        w(f"**{UNTRAINED_WARNING}**\n\n")
    w(f"- {head_line(rows)}\n")
    w(f"- model: `{meta.get('stage_dir') or 'default SmolLM2-135M split'}`, world {meta.get('world')}, "
      f"max_new_tokens {meta.get('max_new_tokens')}, records [{meta.get('begin')}, {meta.get('end')})"
      f"{', first turns only' if meta.get('first_turn_only') else ', all turns'}\n")
    w(f"- timing: emulation profile `{prof}`" + (f" (time_scale {scale:g}: ξ in modeled time)" if scale != 1 else "")
      + ("" if prof != "none" else " (real timing of this host)") + "\n")
    if meta.get("overrides"):
        w(f"- overrides: `{' '.join(meta['overrides'])}`\n")
    w("- ξ = Σ new tokens / Σ decode seconds (tokens/s, prefill excluded); SR = ξ / ξ(Chunk-PP = naive), or of "
      "PP-AR (`ar`) when naive did not run (named under each T); "
      "τ = mean tokens committed per verification incl. the bonus token; Mean = mean over datasets\n\n")
    csv_buf = io.StringIO()
    cw = csv.writer(csv_buf)
    cw.writerow(["temperature", "mode", "method", "dataset", "generations", "new_tokens", "decode_s", "xi", "sr",
                 "tau", "emu_flagged_rows", "emu_overrun_ratio", "emu_overrun_frac"])
    cols = datasets + ["Mean"]
    for t in temps:
        present = [m for m in modes if any((t, m, d) in agg for d in datasets)]
        if not present:
            continue
        w(f"## T = {t:g}\n\n")
        base = sr_baseline(present)

        def cell(m, d, field):
            if d == "Mean":
                vals = [agg[(t, m, dd)][field] for dd in datasets if (t, m, dd) in agg]
                return sum(vals) / len(vals) if vals and len(vals) == len(datasets) else None
            return agg[(t, m, d)][field] if (t, m, d) in agg else None

        def sr(m, d):
            x, b = cell(m, d, "xi"), cell(base, d, "xi")
            return x / b if x is not None and b else None
        w(f"ξ (tokens/s) and SR against {label(base)} (`{base}`)\n\n| method | "
          + " | ".join(DATASET_LABELS.get(d, d) for d in datasets)
          + " | Mean |\n|---|" + "---|" * len(cols) + "\n")
        for m in present:
            parts = []
            for d in cols:
                x, s = cell(m, d, "xi"), sr(m, d)
                parts.append("–" if x is None else _fmt(x) + (f" ({s:.2f}×)" if s is not None else ""))
            w(f"| {label(m)} (`{m}`) | " + " | ".join(parts) + " |\n")
        w("\nτ (accepted tokens per verification)\n\n| method | "
          + " | ".join(DATASET_LABELS.get(d, d) for d in datasets) + " | Mean |\n|---|" + "---|" * len(cols) + "\n")
        for m in present:
            w(f"| {label(m)} | " + " | ".join("–" if cell(m, d, "tau") is None else _fmt(cell(m, d, "tau"))
                                                     for d in cols) + " |\n")
        if any(agg[k]["emu"] for k in agg if k[0] == t):
            w("\nEmulation fidelity (decode phase): rows flagged (overruns > threshold of modeled time) / rows; "
              "overrun ratio = Σ overrun s / Σ modeled s; overrun ops = share of modeled ops that ran longer "
              "than modeled\n\n| method | rows flagged | overrun ratio | overrun ops |\n|---|---|---|---|\n")
            for m in present:
                ks = [(t, m, d) for d in datasets if (t, m, d) in agg]
                n = sum(agg[k]["n"] for k in ks)
                fl = sum(agg[k]["flagged"] for k in ks)
                ov, mo = sum(agg[k]["over_s"] for k in ks), sum(agg[k]["model_s"] for k in ks)
                oo, ops = sum(agg[k]["over_ops"] for k in ks), sum(agg[k]["ops"] for k in ks)
                w(f"| {label(m)} | {fl}/{n} | {(ov / mo if mo else float('inf')):.3f} | "
                  f"{(oo / ops if ops else 0):.1%} |\n")
        w("\n")
        for m in present:
            for d in datasets:
                if (t, m, d) not in agg:
                    continue
                a = agg[(t, m, d)]
                s = sr(m, d)
                cw.writerow([t, m, label(m), d, a["n"], a["tokens"], round(a["decode_s"], 6),
                             round(a["xi"], 4), "" if s is None else round(s, 4), round(a["tau"], 4),
                             a["flagged"] if a["emu"] else "",
                             (round(a["over_s"] / a["model_s"], 4) if a["model_s"] else "") if a["emu"] else "",
                             (round(a["over_ops"] / a["ops"], 4) if a["ops"] else "") if a["emu"] else ""])
    w("## Losslessness at T = 0\n\n" + losslessness_md(mismatch, scope="T=0 "))
    return md.getvalue(), csv_buf.getvalue()


def bar_values(agg: dict, t: float, m: str, metric: str, datasets: list[str], base: str) -> tuple[list, list]:
    """One mode's bars at temperature ``t``: ``metric`` (xi, tau, or sr = ξ / ξ(``base``)) per dataset and their
    mean (0 where a dataset has no rows), and how many rows behind each bar the emulation flagged."""
    vals, flagged = [], []
    for d in datasets + ["Mean"]:
        ds = datasets if d == "Mean" else [d]
        flagged.append(sum(agg[(t, m, x)]["flagged"] for x in ds if (t, m, x) in agg)
                       + (sum(agg[(t, base, x)]["flagged"] for x in ds if (t, base, x) in agg)
                          if metric == "sr" else 0))
        if not all((t, m, x) in agg for x in ds):
            vals.append(0.0)
            continue
        if metric == "sr":
            if not all((t, base, x) in agg for x in ds):
                vals.append(0.0)
                continue
            num = sum(agg[(t, m, x)]["xi"] for x in ds)
            den = sum(agg[(t, base, x)]["xi"] for x in ds)
            vals.append(num / den if den else 0.0)
        else:
            vals.append(sum(agg[(t, m, x)][metric] for x in ds) / len(ds))
    return vals, flagged


def plot(rows: list[dict], datasets: list[str], modes: list[str], temps: list[float], out_dir: Path) -> list[Path]:
    """Bar charts ξ, SR, τ per dataset and mode. A bar whose rows include any the emulation flagged for
    overruns (``emu_flag``: the host could not keep the modeled times, so its ξ is not the testbed's) is
    hatched and starred, with a legend note."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    agg = aggregate(rows)
    cols = datasets + ["Mean"]
    written = []
    for metric, fname, ylabel in (("xi", "xi.png", "ξ (tokens/s)"), ("sr", "sr.png", "SR = ξ / ξ({base})"),
                                  ("tau", "tau.png", "τ (tokens per verification)")):
        show = [m for m in modes if not (metric == "tau" and m == "ar")]
        fig, axes = plt.subplots(1, len(temps), figsize=(max(6, 1.3 * len(cols) + 2) * len(temps), 4.2), squeeze=False)
        for ax, t in zip(axes[0], temps):
            base = sr_baseline([m for m in modes if any((t, m, d) in agg for d in datasets)]) or "naive"
            width = 0.8 / max(1, len(show))
            any_flagged = False
            for i, m in enumerate(show):
                vals, flagged = bar_values(agg, t, m, metric, datasets, base)
                bars = ax.bar([j + (i - (len(show) - 1) / 2) * width for j in range(len(cols))], vals, width,
                              label=label(m))
                for bar, nf in zip(bars, flagged):
                    if nf and bar.get_height() > 0:
                        any_flagged = True
                        bar.set_hatch("///")
                        bar.set_edgecolor("black")
                        ax.annotate("*", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                                    va="bottom", fontsize=11, fontweight="bold")
            if metric == "sr":
                ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xticks(range(len(cols)))
            ax.set_xticklabels([DATASET_LABELS.get(d, d) for d in cols], rotation=20)
            ax.set_title(f"T = {t:g}")
            ax.set_ylabel(ylabel.format(base=label(base)))
            handles, _ = ax.get_legend_handles_labels()
            if any_flagged:
                from matplotlib.patches import Patch
                handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                                     label="* emulation flagged overruns\n  (host slower than modeled)"))
            ax.legend(handles=handles, fontsize=8)
        fig.suptitle(head_line(rows) + ("  (UNTRAINED: not representative)" if untrained(rows) else ""),
                     fontsize=9, color="red" if untrained(rows) else "black")
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


# -- main -----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    log = (lambda s: print(s, file=sys.stderr, flush=True))
    return exit_status(lambda: _main(args, log))


def _main(args, log) -> int:
    from config.modes import MODES as VALID_MODES, canonical_mode
    datasets, modes = _split(args.datasets), [canonical_mode(m) for m in _split(args.modes)]
    try:
        temps = [float(t) for t in _split(args.temperatures)]
    except ValueError:
        raise EvalError(f"--temperatures takes comma-separated numbers, not {args.temperatures!r}") from None
    bad = [m for m in modes if m not in VALID_MODES]
    if bad or not modes:
        raise EvalError(f"unknown mode(s) {bad}; choose from {', '.join(VALID_MODES)}")
    if not datasets or not temps:
        raise EvalError("need at least one dataset and one temperature")
    if any(t < 0 for t in temps) or args.time_scale <= 0 or args.max_new_tokens < 1:
        raise EvalError("temperatures must be >= 0, --time-scale > 0, --max-new-tokens >= 1")
    profile = "" if args.profile.lower() in ("", "none", "off") else args.profile
    prof_name = "real"
    if profile:
        from config.profiles import load_profile, resolve_profile
        prof_name = load_profile(profile).name
        profile = str(resolve_profile(profile).resolve())
    out_dir = Path(args.out_dir or OUTPUTS / "eval" / prof_name)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_path = out_dir / "rows.jsonl"
    data_dir = Path(args.data_dir)
    # datasets before meta.json: a start that fails on a missing dataset must leave no meta.json behind,
    # or the corrected rerun into the same folder would be refused as "another configuration"
    records = {ds: load_dataset(data_dir, ds, args.begin, args.end) for ds in datasets}
    stage_dir = str(Path(args.stage_dir).resolve()) if args.stage_dir else ""
    head_dir = str(Path(args.head_dir).resolve()) if args.head_dir and ":" not in args.head_dir else args.head_dir
    # every pipeline run's overrides; checked here (likewise before meta.json), not at the first launch
    common = [f"max_new_tokens={args.max_new_tokens}", *([f"model.stage_dir={stage_dir}"] if stage_dir else []),
              *([f"model.head_dir={head_dir}"] if head_dir else []),
              *([f"emu.profile={profile}", f"emu.time_scale={args.time_scale}"] if profile else []), *args.overrides]
    if not args.summarize_only:
        from config.run_config import DEFAULT, apply_overrides
        apply_overrides(DEFAULT, common)
    world = args.world
    if not args.summarize_only and not world:
        from model.default_model import resolve_stage_root
        from model.stage_format import read_manifest
        world = len(read_manifest(resolve_stage_root(stage_dir))["split"])
    meta = {"profile": profile, "time_scale": args.time_scale if profile else 1.0, "max_new_tokens": args.max_new_tokens,
            "stage_dir": stage_dir, "head_dir": head_dir, "overrides": list(args.overrides), "world": world,
            "draft_sources": draft_sources(list(args.overrides))}
    meta_path = out_dir / "meta.json"
    if meta_path.is_file():
        old = json.loads(meta_path.read_text())
        if args.summarize_only:
            meta = dict(old)
        else:
            if "draft_sources" not in old:       # written before the default draft became eagle,lookup
                old["draft_sources"] = draft_sources(old.get("overrides", []), "eagle")
            diff = [k for k in META_KEYS if old.get(k) != meta.get(k)]
            if diff:
                raise EvalError(f"{out_dir} holds results of another configuration ({', '.join(f'{k}: {old.get(k)!r} vs {meta.get(k)!r}' for k in diff)}); "
                                "use another --out-dir (or delete that one)")
    elif not args.summarize_only:
        meta_path.write_text(json.dumps(meta, indent=1))
    meta.update(begin=args.begin, end=args.end, first_turn_only=args.first_turn_only)

    rows = load_rows(rows_path, log=log)
    done = {_key(r) for r in rows}
    failures = []
    if not args.summarize_only:
        chunks = plan(records, modes, temps, done, args.first_turn_only)
        if not chunks:
            log(f"[eval] nothing to run: every requested generation is already in {rows_path}")
        sink = RowSink(rows_path, done)
        for i, chunk in enumerate(chunks, 1):
            log(f"[eval] launch {i}/{len(chunks)}")
            rc = run_chunk(chunk, args, common, world, out_dir, sink, log)
            if rc:
                failures.append(f"{chunk[0]} T={chunk[1]:g} modes {','.join(chunk[2])} (exit {rc})")
        log(f"[eval] added {sink.added} rows to {rows_path}")
        rows = load_rows(rows_path, log=log)

    qids = {ds: {r["question_id"] for r in recs} for ds, recs in records.items()}
    sel = [r for r in rows if r["dataset"] in qids and r["question_id"] in qids[r["dataset"]] and r["mode"] in modes
           and float(r["temperature"]) in temps and (not args.first_turn_only or int(r["turn"]) == 0)]
    mismatch = find_mismatches(sel, by_dataset=True)
    md, csv_text = summarize(sel, datasets, modes, temps, meta, mismatch)
    (out_dir / "summary.md").write_text(md, encoding="utf-8")
    (out_dir / "summary.csv").write_text(csv_text, encoding="utf-8")
    if not args.no_plots and sel:
        plot(sel, datasets, modes, temps, out_dir)
    if args.answer_dir and sel:
        from pipeline.run import model_name
        from config.paths import DEFAULT_STAGE_DIR
        written = write_answers(sel, Path(args.answer_dir), model_name(Path(stage_dir or DEFAULT_STAGE_DIR)),
                                args.first_turn_only)
        log(f"[eval] llm_judge answers: {len(written)} file(s) under {args.answer_dir}")
    print(md)
    if untrained(sel):
        print(UNTRAINED_WARNING, flush=True)
    log(f"[eval] {len(sel)} rows summarised -> {out_dir / 'summary.md'}, summary.csv"
        + ("" if args.no_plots or not sel else ", xi.png, sr.png, tau.png"))
    code = 0
    if failures:
        log("[eval] FAILED launches (rerun the same command to resume):\n  " + "\n  ".join(failures))
        code = 2
    if mismatch[0]:
        log(mismatch_banner("eval", mismatch[0]))
        code = 3
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("[eval] interrupted", file=sys.stderr, flush=True)
        sys.exit(130)
