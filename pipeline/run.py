"""Entry point of every rank (launched by ``pipeline.tools.launch``, which ``run_pipe.sh`` uses, or by plain torchrun): ``python -m pipeline.run [key=value ...] [options]``.

Rank 0 holds the draft head and ``lm_head``, formats prompts, runs the chosen mode(s) and prints/writes
results; ranks 1..N run the mode-agnostic stage worker.

Errors are one line per rank (``[rank r] error: ...``) and a non-zero exit on every rank, never a hang:

* bad arguments / config / stage root (seen alike by every rank, before the process group): printed by
  rank 0 (and by local rank 0 of other nodes), exit 2; the other ranks exit 2 silently;
* failures once the process group exists (a rank's own bad input, an unexpected exception, Ctrl-C):
  the failing rank prints its line and records the cause in the rendezvous store; every other rank
  exits with ``[rank r] error: lost rank K: ...`` (exit 3) within ``comm.timeout_s`` (usually at once);
* a rank that never joins, or a foreign program on ``MASTER_PORT``: ``init_process_group`` gives up
  after ``comm.timeout_s``.

Exit codes: 1 unexpected exception, 2 bad input, 3 lost a peer, 128+N signal N (SIGINT 130, SIGTERM 143).
Set ``FLOWSPEC_DEBUG=1`` for full tracebacks (and all-thread stacks on Ctrl-C) and torch's C++ warnings.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from config.invocation import prog
from config.errors import UserError
from config.paths import DEFAULT_STAGE_DIR
from pipeline.build import (SetupError, generation_config, head_choice, load_rank_stage, load_tokenizer, loading_line,
                            make_engine)


def debug() -> bool:
    """``FLOWSPEC_DEBUG=1``: full tracebacks, all-thread stacks on Ctrl-C, torch's C++ warnings."""
    return os.environ.get("FLOWSPEC_DEBUG", "") not in ("", "0")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=prog("pipeline.run"),
        description="Distributed (pipeline-parallel) speculative decoding. Launch one process per rank\n"
                    "with python -m pipeline.tools.launch (or torchrun); rank 0 drafts and verifies, ranks 1..N hold the decoder layers.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Config overrides are key=value words (config/run_config.py): section.key, or a bare key\n"
               "when only one section has it (top_k is ambiguous: tree.top_k = draft beam width, gen.top_k =\n"
               "sampling top-k). HF names: do_sample=false, gen.top_k, top_p, temperature, max_new_tokens.\n\n"
               "Examples:\n"
               "  python -m pipeline.run --print-config mode=continuous tree.init_depth=5\n"
               "  python -m pipeline.tools.launch --standalone --nproc_per_node=5 -m pipeline.run mode=continuous max_new_tokens=64 \\\n"
               "      --prompt 'Write a haiku about rivers.' --output rows.jsonl --answer-file answers.jsonl")
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.add_argument("--print-config", action="store_true",
                   help="print the effective configuration (section.key = value, non-defaults marked) and exit; "
                        "needs no torchrun")
    p.add_argument("--prompt", action="append", default=[], help="a user prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[],
                   help="a raw prompt as comma-separated token ids (repeatable; no chat template)")
    p.add_argument("--prompts-file", help="FastChat question.jsonl; every turn is asked, answers fed back")
    p.add_argument("--begin", type=int, default=None, help="first record of --prompts-file (0-based)")
    p.add_argument("--end", type=int, default=None, help="end record (exclusive)")
    p.add_argument("--first-turn-only", action="store_true", help="ask only the first turn of each record")
    p.add_argument("--modes", default=None, help="comma-separated modes to run in turn (default: config mode)")
    p.add_argument("--output", help="one JSON line per generation, with provenance; an existing file of the "
                                    "same configuration is resumed (done (question, turn, mode) skipped), one "
                                    "of another configuration refused")
    p.add_argument("--answer-file", help="FastChat llm_judge / EAGLE answer file: one line per question "
                                         "(question_id, answer_id, model_id, choices[{index, turns}], tstamp); "
                                         "with several --modes put {mode} in the path")
    p.add_argument("--model-id", help="model_id of --answer-file lines (default: the answer file's stem, as "
                                      "FastChat's llm_judge names a model by its answer file)")
    p.add_argument("--template", default="auto", help="auto (tokenizer's own, else vicuna) | raw | fschat name "
                                                      "(default: auto)")
    p.add_argument("--quiet", action="store_true", help="print only the summary lines")
    p.add_argument("--warmup", type=int, default=0,
                   help="untimed, unrecorded warm-up generations per mode (first prompt, <= 32 new tokens; "
                        "default: 0)")
    return p.parse_intermixed_args(argv)


_check_only: str = ""  # set by check_args (the launcher's tag): _main stops before torch and the process group
_check_prompts = True  # ... and whether that check reads --prompts-file (the launcher of rank 0's node)


def check_args(argv: list[str], world: int, tag: str = "[launch]", prompts_file: bool = True) -> int:
    """Every rank's shared checks (arguments, config values, modes, prompts, stage root against ``world``),
    run once by :mod:`pipeline.tools.launch` before any rank starts, so the reason cannot be lost in a race
    between ranks: prints one ``<tag> error: ...`` line and returns 2, or returns 0. No torch import.
    ``prompts_file``: also read ``--prompts-file`` (:func:`read_records`); a launcher of another node than rank 0's
    passes False (rank 0 alone reads it, and that node may not have the file)."""
    global _check_only, _check_prompts
    os.environ["WORLD_SIZE"] = str(world)
    _check_only, _check_prompts = tag, prompts_file
    try:
        return _main(list(argv))
    finally:
        _check_only, _check_prompts = "", True


def read_records(args) -> list[dict]:
    """The records this run asks (:func:`model.prompts.prompt_records`), each with at least one non-empty turn; a
    missing or malformed prompts file, an empty range or an empty turn is a :class:`model.prompts.PromptError`.
    Read by rank 0, and once before any rank starts (:func:`check_args`): a bad file is one line, not a rank's
    error relayed by every peer."""
    from model.prompts import PromptError, prompt_records
    records = prompt_records(args.prompt_ids, args.prompts_file, args.begin, args.end,
                             args.prompt or ["Explain in two sentences why the sky is blue."])
    if not records:
        raise PromptError(f"no prompts: {args.prompts_file} has no records in [{args.begin}, {args.end})")
    for rec in records:
        for t in rec["turns"]:
            if not t or (isinstance(t, str) and not t.strip()):
                raise PromptError(f"prompt {rec.get('question_id')} has an empty turn")
    return records


def main(argv: list[str] | None = None, rank0=None) -> int:
    """Run this rank; returns its exit code (or leaves with ``os._exit`` once the process group exists).
    ``rank0`` replaces :func:`run_rank0` (same arguments; ``pipeline.serve`` passes its serving loop)."""
    rank = os.environ.get("RANK", "0")
    try:
        return _main(argv, rank0)
    except SystemExit:
        raise
    except BaseException as e:  # every failure: one line, peers told, non-zero exit
        return _fail(rank, e)


def _fail(rank, e: BaseException) -> int:
    from pipeline import faults
    if debug():
        import traceback
        traceback.print_exc()
    detail = next((l.strip() for l in str(e).splitlines() if l.strip()), "")[:300]
    lost = None
    if isinstance(e, KeyboardInterrupt):
        line, code, reason = f"[rank {rank}] interrupted; exiting", 130, "interrupted"
    elif isinstance(e, UserError):   # the message is the whole story (config.errors)
        line = f"[rank {rank}] {e}" if getattr(e, "operator_stop", False) else f"[rank {rank}] error: {e}"
        code, reason, lost = e.fault_report()
    else:
        line = f"[rank {rank}] error: {type(e).__name__}: {detail}" if detail else f"[rank {rank}] error: {type(e).__name__}"
        line += "" if debug() else " (FLOWSPEC_DEBUG=1 shows the traceback)"
        code, reason = 1, line.split("error: ", 1)[1]
    if faults._peer_hook is not None:  # the process group exists: tell the peers, exit at once
        faults.fatal(line, code, reason, lost)
    print(line, file=sys.stderr, flush=True)
    return code


def _main(argv: list[str] | None = None, rank0=None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    speak = rank == 0 or os.environ.get("LOCAL_RANK", "0") == "0"  # one line per node for shared errors

    def fail(text: str, code: int = 2) -> int:
        if speak:
            print(f"{_check_only or f'[rank {rank}]'} error: {text}", file=sys.stderr, flush=True)
        return code

    from config.modes import MODES, canonical_mode
    from config.run_config import DEFAULT, ConfigError, apply_overrides
    try:
        cfg = apply_overrides(DEFAULT, args.overrides)
        modes = [canonical_mode(m) for m in args.modes.split(",")] if args.modes else [cfg.gen.mode]
        for m in modes:
            if m not in MODES:
                raise ConfigError(f"unknown mode {m!r}; choose one of {', '.join(MODES)}")
        if "sps" in modes and not cfg.sps.draft_dir and "ssm:" not in cfg.draft.sources:
            raise ConfigError("mode sps needs a small draft LM: sps.draft_dir=<dir> or draft.sources=...,ssm:<dir>")
    except ConfigError as e:
        return fail(str(e))
    if args.print_config:  # standalone (no torchrun, no torch): the configuration every rank would use
        if rank == 0 and not _check_only:  # not from pipeline.tools.launch's pre-check
            from config.run_config import format_config
            print(f"# effective configuration ('# default: X' marks overrides); modes: {','.join(modes)}")
            print(format_config(cfg))
            if not cfg.model.stage_dir:
                print(f"# model.stage_dir '' = {DEFAULT_STAGE_DIR}")
        return 0
    if args.answer_file and len(modes) > 1 and "{mode}" not in args.answer_file:
        return fail("--answer-file with several --modes needs {mode} in its path (one answer file per mode)")
    if world < 2:
        return fail("needs at least 2 ranks (rank 0 drafts, ranks 1..N hold layers); launch with ./run_pipe.sh or "
                    "python -m pipeline.tools.launch --nproc_per_node=<stages> -m pipeline.run")
    for i, text in enumerate(args.prompt):  # argv is the same on every rank: check before connecting
        if not text.strip():
            return fail(f"--prompt number {i + 1} is empty")
    for ids in args.prompt_ids:
        if not all(t.strip().isdigit() for t in ids.split(",")):
            return fail(f"--prompt-ids takes comma-separated token ids, got {ids[:60]!r}")

    from model.stage_format import StageDirError, check_world
    stage_root = Path(cfg.model.stage_dir or DEFAULT_STAGE_DIR)
    try:
        manifest = check_world(stage_root, world)  # before importing torch: a wrong root or world fails at once
    except StageDirError as e:
        return fail(str(e))
    from model.tp_split import check_tp_modes  # tensor-parallel splits run modes tp/galaxy (pipeline/tp_run.py)
    if (tp_error := check_tp_modes(manifest, modes, cfg)) is not None:
        return fail(tp_error)
    if _check_only:  # pipeline.tools.launch checking the arguments once, before any rank starts
        if _check_prompts and args.prompts_file:
            from model.prompts import PromptError
            try:
                read_records(args)
            except PromptError as e:
                return fail(str(e))
        return 0

    import torch

    from model.stage_model import DTYPES
    torch.set_num_threads(cfg.model.num_threads)
    device = cfg.model.device
    if cfg.comm.backend == "nccl" and device != "cuda":
        return fail("comm.backend=nccl needs device=cuda (NCCL moves CUDA tensors); use comm.backend=gloo on CPU")
    if device == "cuda":
        if not torch.cuda.is_available():
            return fail("device=cuda but CUDA is not available")
        from model.devices import DevicePlanError, rank_devices
        try:  # every rank of a host computes the same plan: a bad one fails here, before anyone connects
            index = rank_devices(cfg.comm.backend, rank, int(os.environ.get("LOCAL_RANK", "0")),
                                 int(os.environ.get("LOCAL_WORLD_SIZE", str(world))), world,
                                 torch.cuda.device_count(), cfg.model.devices)
        except DevicePlanError as e:
            return fail(str(e))
        torch.cuda.set_device(index)
        device = f"cuda:{index}"
    dtype = DTYPES[cfg.model.dtype]

    from pipeline.comm import Comm
    from pipeline.trace import Tracer
    tracer = Tracer(rank, enabled=cfg.comm.trace)
    comm = Comm(cfg.comm.backend, cfg.comm.timeout_s, cfg.comm.heartbeat_s, device, tracer)
    from pipeline.emulation import install as install_emulation
    install_emulation(comm, cfg, device)  # emulated edge testbed when emu.profile is set (else a no-op)
    # from here on every error goes through main()'s _fail: one line, peers told, os._exit
    if manifest.get("tp"):
        from pipeline.tp_run import run_tp_rank
        code = run_tp_rank(args, cfg, modes, comm, stage_root, dtype, device, rank0 or run_rank0)
        tracer.dump(cfg.comm.trace_dir)
        comm.close()
        return code
    print(loading_line(rank, manifest, stage_root), file=sys.stderr, flush=True)
    from pipeline import faults
    faults.hit("load")  # test-only fault injection point (FLOWSPEC_FAULT=rank=R,at=load)
    model = load_rank_stage(cfg, stage_root, rank, world, dtype, device)
    if rank == 0:
        code = (rank0 or run_rank0)(args, cfg, modes, comm, model, stage_root, dtype, device)
    else:
        from pipeline.build import make_stage_worker
        worker = make_stage_worker(cfg, comm, model, dtype, device)
        comm.wait_for_rank0()   # rank 0 may load for longer than timeout_s (its docstring)
        worker.run()
        code = 0
    tracer.dump(cfg.comm.trace_dir)
    comm.close()
    return code


def run_rank0(args, cfg, modes, comm, model, stage_root: Path, dtype, device) -> int:
    from model.prompts import PromptError, chat_prompt_ids, eos_ids, stop_token_ids
    from pipeline.engine import GenSettings, prompt_fit_error, timed_generation
    from pipeline.modes import new_decoder

    try:  # prompts first: a bad prompt fails before tokenizer and draft head load
        records = read_records(args)
    except PromptError as e:
        raise SetupError(str(e)) from None

    gen_cfg = generation_config(stage_root)
    tokenizer = None
    if not args.prompt_ids:
        tokenizer = load_tokenizer(stage_root)
        stop_ids = stop_token_ids(tokenizer, gen_cfg)
    else:
        stop_ids = eos_ids(gen_cfg, getattr(model.config, "eos_token_id", None))

    from draft.protocol import forget_requests
    from pipeline.outputs import AnswerFile, OutputFileError, drafter_fields, head_identity, provenance, resume_rows
    needs_head = any(m != "ar" for m in modes)
    prov = provenance(cfg, stage_root, head_identity(cfg.model.head_dir, head_choice(cfg, stage_root), needs_head),
                      args.template, comm.world)
    try:  # an --output of another configuration is refused before the draft head loads
        done = resume_rows(Path(args.output), prov) if args.output else {}
        answer_files = {m: AnswerFile(args.answer_file.replace("{mode}", m),   # llm_judge: model_id = file stem
                                      args.model_id or Path(args.answer_file.replace("{mode}", m)).stem)
                        for m in modes} if args.answer_file else {}
    except OutputFileError as e:
        raise SetupError(str(e)) from None
    if done:
        print(f"[rank 0] resuming {args.output}: {len(done)} generation(s) already there are skipped",
              file=sys.stderr, flush=True)

    if not args.quiet:  # say which mode runs and, when nobody chose it, why it is the default
        chosen = args.modes or any(o.split("=", 1)[0] in ("mode", "gen.mode") for o in args.overrides)
        why = ("chosen" if chosen else "FlowSpec, the default; --modes ar,naive,continuous compares modes, "
               "README.md#modes lists them")
        print(f"[rank 0] mode={','.join(modes)} ({why})", file=sys.stderr, flush=True)
    engine = make_engine(cfg, comm, model, stage_root, modes, stop_ids, dtype, device)
    drafter = engine.drafter
    stop_text = None
    if cfg.gen.stop_strings():
        if tokenizer is None:
            raise SetupError("gen.stop needs text: it cannot be used with --prompt-ids (no tokenizer)")
        from model.prompts import StopText
        stop_text = StopText(tokenizer, cfg.gen.stop_strings())
    stream = None if args.quiet or tokenizer is None else TokenStream(tokenizer, stop_ids)
    settings = GenSettings.from_config(cfg.gen, stop_text=stop_text,
                                       on_commit=stream.write if stream is not None else None)
    max_positions = getattr(model.config, "max_position_embeddings", None)

    def check_len(ids: list[int], qid) -> None:
        if not ids:
            raise SetupError(f"prompt {qid} has no tokens")
        if max(ids) >= model.config.vocab_size:
            raise SetupError(f"prompt {qid}: token id {max(ids)} is outside the vocabulary "
                             f"(size {model.config.vocab_size})")
        if (why := prompt_fit_error(len(ids), cfg.gen.max_new_tokens, cfg, comm.world, max_positions)) is not None:
            raise SetupError(f"prompt {qid}: {why}")

    out_f = open(args.output, "a", encoding="utf-8") if args.output else None
    turns_limit = 1 if args.first_turn_only else None
    def prompt_ids(turns: list, answers: list[str]) -> list[int]:
        if tokenizer is None:
            return list(turns[-1])
        return chat_prompt_ids(tokenizer, turns, answers, cfg.gen.system_prompt, args.template)

    for rec in records:  # check every first turn before any work
        check_len(prompt_ids(rec["turns"][:1], []), rec.get("question_id"))
    measured: dict[str, tuple[int, float]] = {}   # mode -> (new tokens, decode seconds): the closing context line
    try:
        for mode in modes:
            for _ in range(args.warmup if records else 0):  # warm-up: excluded from results, not streamed
                timed_generation(engine, prompt_ids(records[0]["turns"][:1], []), new_decoder(mode),
                                 settings.replace(max_new_tokens=min(32, cfg.gen.max_new_tokens), on_commit=None))
            forget_requests(drafter)   # each mode drafts as a run of it alone would (not from the answers above)
            for rec in records:
                answers: list[str] = []
                for ti, _ in enumerate(rec["turns"][:turns_limit]):
                    old = done.get((rec.get("question_id"), ti, mode))
                    if old is not None:  # resumed: this turn's answer is fed back as when it was generated
                        answers.append(str(old.get("text", "")).strip())
                        continue
                    ids = prompt_ids(rec["turns"][:ti + 1], answers)
                    check_len(ids, rec.get("question_id"))
                    if stream is not None:   # the answer appears as its tokens commit
                        print_header(mode, rec.get("question_id"), ti, str(rec["turns"][ti]))
                        stream.begin()
                    res = timed_generation(engine, ids, new_decoder(mode), settings)
                    if stream is not None:
                        stream.end()
                    n, s = measured.get(mode, (0, 0.0))
                    measured[mode] = (n + res.new_tokens, s + res.decode_s)
                    text = "" if tokenizer is None else tokenizer.decode(
                        [t for t in res.output_ids if t not in stop_ids], skip_special_tokens=True)
                    answers.append(text.strip())
                    row = {"question_id": rec.get("question_id"), "category": rec.get("category"), "turn": ti,
                           "mode": mode, "temperature": cfg.gen.temperature, "prompt_ids": ids,
                           "output_ids": res.output_ids, "text": text, "new_tokens": res.new_tokens,
                           "rounds": res.rounds, "tau": round(res.tau, 4), "accept_lengths": res.accept_lengths,
                           "pipeline_steps": res.pipeline_steps, "prefill_s": round(res.prefill_s, 6),
                           "decode_s": round(res.decode_s, 6),
                           "tokens_per_s": round(res.new_tokens / res.decode_s, 3) if res.decode_s else None,
                           "busy_fraction": [round(b, 4) for b in res.busy_fraction], "world_size": comm.world}
                    row.update(res.meter_fields)  # emu_* fidelity fields when the emulated testbed is on
                    row.update(drafter_fields(drafter if mode != "ar" else None))  # drafter_version (draft/osd.py)
                    row.update(prov)
                    if out_f:
                        out_f.write(json.dumps(row) + "\n")
                        out_f.flush()
                    print_result(row, str(rec["turns"][ti]), args.quiet, streamed=stream is not None)
                if mode in answer_files and tokenizer is not None:
                    answer_files[mode].add(rec.get("question_id"), answers)
    finally:
        if out_f:
            out_f.close()
    engine.shutdown()
    if not args.quiet and measured:
        from pipeline.headline import context_line, load_headline
        gpus = 0
        if str(device).startswith("cuda"):
            import torch
            gpus = len(set(cfg.model.devices.split(","))) if cfg.model.devices else torch.cuda.device_count()
        print("\n" + context_line(measured, comm.world, os.cpu_count(), load_headline(), gpus), flush=True)
    return 0


class TokenStream:
    """Rank 0's answer on stdout as its tokens commit (the generation's ``on_commit``): ``begin`` prints
    ``ASSISTANT: ``, every commit the text it adds (:class:`model.prompts.TextDeltas`), ``end`` the rest and a
    newline. What it prints is exactly the answer's text (the ``text`` of ``--output`` rows)."""

    def __init__(self, tokenizer, stop_ids: set[int]) -> None:
        self.tokenizer, self.stop_ids, self.deltas = tokenizer, stop_ids, None

    def begin(self) -> None:
        from model.prompts import TextDeltas
        self.deltas = TextDeltas(self.tokenizer, self.stop_ids)
        sys.stdout.write("ASSISTANT: ")
        sys.stdout.flush()

    def write(self, tokens: list[int]) -> None:
        sys.stdout.write(self.deltas.push(tokens))
        sys.stdout.flush()

    def end(self) -> None:
        sys.stdout.write(self.deltas.finish() + "\n")
        sys.stdout.flush()


def model_name(stage_root: Path) -> str:
    """The split's source model folder name (``SmolLM2-135M-Instruct``), for answer-file model ids."""
    try:
        src = json.loads((Path(stage_root) / "manifest.json").read_text()).get("source") or ""
    except (OSError, ValueError):
        src = ""
    return Path(src).name or Path(stage_root).resolve().name


def print_header(mode: str, qid, turn: int, prompt: str) -> None:
    print(f"\n=== [{mode}] question {qid} turn {turn} ===")
    print(f"USER: {prompt[:500]}", flush=True)


def print_result(row: dict, prompt: str, quiet: bool, streamed: bool = False) -> None:
    """The answer (unless ``quiet``, or ``streamed``: already shown as it committed) and the metrics line."""
    if not quiet and not streamed:
        print_header(row["mode"], row["question_id"], row["turn"], prompt)
        print(f"ASSISTANT: {row['text']}")
    busy = " ".join(f"{b:.0%}" for b in row["busy_fraction"])
    tps = row["tokens_per_s"] or 0.0
    print(f"[{row['mode']}] new_tokens={row['new_tokens']} rounds={row['rounds']} "
          f"tau={row['tau']:.2f} (accepted tokens per verification incl. bonus) decode={tps:.1f} tok/s "
          f"prefill={row['prefill_s'] * 1000:.0f} ms busy(rank0..{len(row['busy_fraction']) - 1})={busy}",
          flush=True)


def exit_on_signals(graceful=None, grace_s: float = 0.0) -> None:
    """SIGINT (Ctrl-C; torchrun's terminal sends it to every rank) and SIGTERM end this rank at once with
    one line and tell its peers. A dedicated thread takes them with ``sigwait``: the main thread may sit
    in a gloo wait that would not return to Python (and so not raise KeyboardInterrupt) for a long time.

    ``graceful`` (the server's ranks, :func:`pipeline.serve.entry`): the first SIGTERM is a graceful stop instead.
    ``graceful()`` returns rank 0's stop once it serves (:meth:`pipeline.serve.RequestManager.begin_stop`, called
    with ``grace_s``; one line says so), else None; rank 0 then ends normally, sending the stages the ring's
    ``Shutdown``, and the stage ranks keep computing until then. A second signal stops at once; a rank still alive
    ``grace_s`` + 30 s after the first leaves anyway (a backstop: the launcher kills its ranks after the grace too).
    SIGTERM before rank 0 serves stops it at once.

    Everything the thread needs is imported here, before it starts: an import made by the thread at signal time
    raced with the main thread's own imports (a rank still importing torch saw ``typing`` half initialized and
    died with an AttributeError instead of the signal's exit code)."""
    import faulthandler
    import signal
    import threading
    import time

    from pipeline import faults
    sigs = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, sigs)  # inherited by every thread started later
    rank = os.environ.get("RANK", "0")

    def leave(sig) -> None:
        if debug():
            faulthandler.dump_traceback(all_threads=True)
        line = f"[rank {rank}] interrupted by {sig.name}; exiting"
        if sig == signal.SIGTERM and faults.peer_failed():
            line = ""  # e.g. torchrun stopping the survivors of a failed rank, which printed the cause
        elif sig == signal.SIGTERM and "TORCHELASTIC_RUN_ID" in os.environ:
            line = f"[rank {rank}] stopped by torchrun (SIGTERM): another rank failed or the job was interrupted"
        faults.fatal(line, 128 + sig.value, f"interrupted by {sig.name}")

    def backstop(sig) -> None:
        time.sleep(grace_s + 30.0)
        leave(sig)

    def wait() -> None:
        sig = signal.Signals(signal.sigwait(sigs))
        stop = graceful() if graceful is not None else None
        if graceful is None or sig != signal.SIGTERM or (rank == "0" and stop is None):
            leave(sig)
        if stop is not None:
            print(f"[rank {rank}] SIGTERM: stopping; the request in flight may finish (at most {grace_s:g}s), new "
                  f"requests get 503; a second signal stops at once", file=sys.stderr, flush=True)
            stop(grace_s)
        threading.Thread(target=backstop, args=(sig,), daemon=True, name="flowspec-stop-backstop").start()
        leave(signal.Signals(signal.sigwait(sigs)))

    threading.Thread(target=wait, daemon=True, name="flowspec-signals").start()


def whole_lines(streams=None) -> None:
    """Make each printed line one ``write`` on the file descriptor, so that the ranks sharing a terminal or a pipe
    interleave by lines, never inside one. Under ``python -u`` / ``PYTHONUNBUFFERED`` (set by many CI images and
    containers) a text stream writes through, and ``print(a, b)`` is one ``write`` per argument and separator: two
    ranks printing together gave "rankrank  01  argsargs" on CI. Line buffering keeps a line whole (a pipe write
    under ``PIPE_BUF`` is atomic) and still shows it at once; an explicit ``flush`` (streamed tokens) flushes."""
    for stream in (sys.stdout, sys.stderr) if streams is None else streams:
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True, write_through=False)


def entry(argv: list[str] | None = None) -> int:
    """What ``python -m pipeline.run`` runs (tests fork ranks through it too)."""
    if not debug():
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's C++ warnings carry stack dumps
    whole_lines()
    exit_on_signals()
    return main(argv)


def exit_now(code: int) -> None:
    """Leave a launched rank without interpreter finalization, after ``atexit`` work (the online drafter's save)
    and flushed output. Daemon threads (watchdog, heartbeats) may still be inside c10d/gloo calls when a clean
    run returns; tearing the interpreter down under them raced with C++ destructors ("terminate called without
    an active exception", SIGABRT after all output was written: 2 of about 40 launched runs in one test pass)."""
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(entry())
