"""What ``pipeline.run`` writes: provenance on every ``--output`` row, resuming an output file, and FastChat
llm_judge / EAGLE answer files (``--answer-file``).

Provenance (fields added to every row; the older row fields are unchanged):

* ``stage_dir`` (resolved) and ``stage_manifest_sha256`` (sha256 of its ``manifest.json``, which itself holds
  the sha256 of every stage file), ``head_dir`` and ``head_sha256`` (sha256 of the head's weight file,
  hashed once per run; ``head_dir`` is ``"none"`` for ``ar``-only runs, ``"untrained"`` for the random
  head, ``oracle[@noise]:<dir>``/``adversary:<dir>`` for the test drafters, whose ``head_sha256`` is null);
* ``config``: the flat ``section.key -> value`` settings that decide the rows' content and timing (every
  config field except ``gen.mode``, which is the row's ``mode``, and ``comm.*`` tracing/timeout settings),
  with ``model.stage_dir``/``model.head_dir`` replaced by the resolved paths and ``template`` and
  ``world_size`` added; ``config_hash`` = sha256 of that dict plus both checksums (first 16 hex digits);
* ``git_commit`` (``git rev-parse HEAD`` in the repository, ``"unknown"`` outside a checkout),
  ``hostname``, ``torch_version``, ``transformers_version``.

Resuming (``--output`` naming an existing file): rows whose ``config_hash`` equals this run's are kept and
their (question_id, turn, mode) skipped (a skipped turn's text is fed back as the answer for the next
turn, as when it was generated); a file holding any row of another configuration, or rows without
provenance, is refused with one line before anything is loaded. A partly written last line (a crash
mid-write) is cut off first, as ``run_eval.sh`` does.
"""
from __future__ import annotations

from config.paths import REPO
import dataclasses
import hashlib
import json
import socket
import subprocess
import time
import uuid
from pathlib import Path

from model.stage_format import sha256_file

HEAD_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# settings that do not change what is generated or how long it takes
NOT_HASHED = {"gen.mode", "comm.timeout_s", "comm.heartbeat_s", "comm.trace", "comm.trace_dir",
              "model.verify_checksums"}


class OutputFileError(RuntimeError):
    """A bad ``--output``/``--answer-file`` (another configuration, unreadable lines)."""


def git_commit(repo: Path = REPO) -> str:
    """``git rev-parse HEAD`` of ``repo`` (no shell), or ``"unknown"``."""
    try:
        res = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    out = res.stdout.strip()
    return out if res.returncode == 0 and out else "unknown"


def head_identity(head_setting: str, chosen: Path | None, needs_head: bool) -> tuple[str, str | None]:
    """(head_dir label, sha256 of its weights) for the drafter ``pipeline.build.make_drafter`` picks."""
    if not needs_head:
        return "none", None
    from draft.oracle import reference_drafter_kind
    if reference_drafter_kind(head_setting):
        return head_setting, None
    if chosen is None:
        return "untrained", None
    for name in HEAD_WEIGHTS:
        if (chosen / name).is_file():
            return str(chosen.resolve()), sha256_file(chosen / name)
    return str(chosen.resolve()), None


def drafter_fields(drafter) -> dict:
    """Per-row drafter identity: ``drafter_version`` (0 = the weights loaded at start; an online drafter,
    ``draft/osd.py``, counts its published updates and adds ``drafter_versions`` and an ``osd`` summary).
    Rows of ``ar`` runs (no drafter) get ``drafter_version`` None."""
    if drafter is None:
        return {"drafter_version": None}
    fields = getattr(drafter, "row_fields", None)
    out = fields() if callable(fields) else {"drafter_version": 0}
    size = drafted_vocab(drafter)
    if size is not None:
        out["draft_vocab_size"] = size
    return out


def drafted_vocab(drafter) -> int | None:
    """How many target ids the EAGLE source drafts over, as resolved at build time (``model.draft_vocab=-1``, the
    auto default, is recorded in the config as -1: this is the size it became; the whole vocabulary when no reduced
    vocabulary applies). None when no source drafts from a vocabulary (prompt lookup, suffix, oracles).
    Looks through wrappers (``inner``: OSD) and merged drafters (``sources``)."""
    todo, seen = [drafter], set()
    while todo:
        d = todo.pop(0)
        if d is None or id(d) in seen:
            continue
        seen.add(id(d))
        if hasattr(d, "dvocab"):
            if d.dvocab is not None:
                return int(d.dvocab.ids.numel())
            vmap = getattr(d, "vocab_map", None)
            if vmap is not None:
                return int(vmap.numel())
            lm = getattr(d, "lm_head", None)
            return int(lm.weight.shape[0]) if lm is not None else None
        todo += [getattr(d, "inner", None), *getattr(d, "sources", [])]
    return None


def flat_config(cfg) -> dict:
    """``section.key -> value`` of every setting of ``cfg`` (a :class:`config.run_config.RunConfig`)."""
    return {f"{sec.name}.{k}": v for sec in dataclasses.fields(cfg)
            for k, v in dataclasses.asdict(getattr(cfg, sec.name)).items()}


def provenance(cfg, stage_root: Path, head: tuple[str, str | None], template: str, world: int) -> dict:
    """The provenance fields of every row of this run (see the module docstring)."""
    import torch
    import transformers
    manifest = Path(stage_root) / "manifest.json"
    settings = {k: v for k, v in flat_config(cfg).items() if k not in NOT_HASHED}
    settings["model.stage_dir"] = str(Path(stage_root).resolve())
    settings["model.head_dir"] = head[0]
    settings["template"] = template
    settings["world_size"] = world
    prov = {"stage_dir": str(Path(stage_root).resolve()),
            "stage_manifest_sha256": sha256_file(manifest) if manifest.is_file() else None,
            "head_dir": head[0], "head_sha256": head[1], "config": settings}
    blob = json.dumps({"config": settings, "stage": prov["stage_manifest_sha256"], "head": head[1]},
                      sort_keys=True, default=str)
    prov["config_hash"] = hashlib.sha256(blob.encode()).hexdigest()[:16]
    prov.update(git_commit=git_commit(), hostname=socket.gethostname(), torch_version=torch.__version__,
                transformers_version=transformers.__version__)
    return prov


def jsonl_lines(path: Path, repair: bool = True) -> tuple[list[tuple[int, str]], int]:
    """``([(line_number, line), ...], dropped_bytes)`` of a JSONL file that a crash may have cut mid-write.

    A partly written last line (no final newline) is dropped and, with ``repair``, cut from the file so that
    appends start on a fresh line; blank lines are skipped. The one torn-line rule of every results reader
    (``pipeline.run --output`` here, ``run_eval.sh``'s rows in :func:`pipeline.tools.eval.load_rows`).
    """
    path = Path(path)
    if not path.is_file():
        return [], 0
    data = path.read_bytes()
    dropped = 0
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        dropped = len(data) - cut
        if repair:
            with open(path, "r+b") as f:
                f.truncate(cut)
        data = data[:cut]
    lines = [(i, line) for i, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1)
             if line.strip()]
    return lines, dropped


def read_rows(path: Path) -> list[dict]:
    """Rows of an existing output file; a partly written last line is cut from the file first. A line that is
    not a JSON object refuses the file (one line)."""
    rows = []
    for i, line in jsonl_lines(path)[0]:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise OutputFileError(f"{path}:{i} is not a JSON row; use another --output file") from None
        if not isinstance(row, dict):
            raise OutputFileError(f"{path}:{i} is not a JSON object; use another --output file")
        rows.append(row)
    return rows


def resume_rows(path: Path, prov: dict) -> dict[tuple, dict]:
    """``(question_id, turn, mode) -> row`` already in ``path`` for this configuration; raises
    :class:`OutputFileError` (one line) when the file holds rows of another configuration."""
    done = {}
    for row in read_rows(path):
        h = row.get("config_hash")
        if h != prov["config_hash"]:
            if h is None:
                raise OutputFileError(f"--output {path} holds rows without provenance (an older run); "
                                      "use another file or delete it")
            old = row.get("config") or {}
            diff = [k for k in sorted(set(old) | set(prov["config"])) if old.get(k) != prov["config"].get(k)]
            for k in ("stage_manifest_sha256", "head_sha256"):
                if row.get(k) != prov.get(k):
                    diff.append(k)
            shown = ", ".join(f"{k}: {old.get(k, row.get(k))!r} vs {prov['config'].get(k, prov.get(k))!r}"
                              for k in diff[:3]) + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")
            raise OutputFileError(f"--output {path} holds rows of another configuration ({shown or 'config_hash'});"
                                  " use another file or delete it")
        done[(row.get("question_id"), int(row.get("turn", 0)), row.get("mode"))] = row
    return done


class AnswerFile:
    """FastChat llm_judge / EAGLE answer file: one JSON line per question,
    ``{question_id, answer_id, model_id, choices: [{index: 0, turns: [text, ...]}], tstamp}``.
    Questions whose ``question_id`` the file already has for ``model_id`` are not written again."""

    def __init__(self, path: str | Path, model_id: str) -> None:
        self.path, self.model_id = Path(path), model_id
        self.done = set()
        if self.path.is_file():
            for row in read_rows(self.path):
                if row.get("model_id") == model_id:
                    self.done.add(row.get("question_id"))
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, question_id, turns: list[str]) -> bool:
        if question_id in self.done:
            return False
        try:
            import shortuuid
            answer_id = shortuuid.uuid()
        except ImportError:
            answer_id = uuid.uuid4().hex
        line = {"question_id": question_id, "answer_id": answer_id, "model_id": self.model_id,
                "choices": [{"index": 0, "turns": list(turns)}], "tstamp": time.time()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        self.done.add(question_id)
        return True
