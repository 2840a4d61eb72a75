"""The public one-process API: the whole pipeline in this process, loaded once, generating on demand.

```python
from pipeline.api import FlowSpec
fs = FlowSpec.load()                                  # the default model, or FlowSpec.load("stages", "mode=naive")
out = fs.generate("Write a haiku.", max_new_tokens=64, on_token=lambda t: print(t, end="", flush=True))
print(out.text, out.stats.tau)
```

It runs the real ranks' code (as :func:`pipeline.inprocess.run_threaded` does): rank 0's engine, drafter and mode
in the calling thread, every stage's :class:`pipeline.worker.StageWorker` in its own thread, the ring a
:class:`pipeline.local_ring.LocalRing` (the real wire codec). The stage threads live from :meth:`FlowSpec.load` to
:meth:`FlowSpec.close` (or the end of a ``with`` block): models load once. Output is what the launched pipeline
gives: greedy output equals Hugging Face ``generate(do_sample=False)`` on the unsplit model in every mode.

Settings: :meth:`FlowSpec.load` takes the same ``key=value`` overrides as ``./run_pipe.sh`` or the
:class:`config.run_config.RunConfig` the command line builds (``config=``); each :meth:`FlowSpec.generate` takes
its own generation settings (max_new_tokens, temperature, top_p, top_k, seed, stop, mode, callbacks, cancel) as
arguments of that generation (:class:`pipeline.engine.GenSettings`): nothing of the engine or the
configuration changes between generations. Bad input raises :class:`config.errors.UserError` subclasses with
one-line messages.

Several generations at once: ``FlowSpec.load(..., lanes=N)`` lets up to ``N`` generations run through the ring
together, each on its own lane (:mod:`pipeline.lanes`, what a server with ``serve.max_active=N`` runs): call
:meth:`FlowSpec.generate` from several threads, or hand a list to :meth:`FlowSpec.generate_many`. Every answer is
the one the same call gives alone (greedy: HF's; sampled: the same seed, the same draws); what several lanes change
is throughput (a stage computes the lanes' waiting segments in one forward) and each one's latency.

Start-up: for the supported families the whole path imports neither transformers nor ``torch._dynamo`` (stages and
EAGLE-1/2 heads built from :mod:`model.light`, the tokenizer from :mod:`model.tokenizer`): the README's example on
stories260K stages runs in about 3 s on a 2-core CPU, ``import torch`` a third of it (docs/results.md, "The API
example under 5 s").
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from config.errors import UserError


class GenerationError(UserError, ValueError):
    """A generation request this pipeline cannot serve (bad prompt, too long, unknown mode)."""


@dataclass(frozen=True)
class Stats:
    """The speculative statistics of one generation (``pipeline.engine.GenResult``'s): ``tau`` = tokens
    committed per verification counting the bonus token (``ar``: 1), ``accept_lengths`` one entry per
    verification, ``rounds`` trees drafted from a fresh root, ``pipeline_steps`` results rank 0 received,
    ``prefill_s`` / ``decode_s`` wall seconds in this process, ``busy_fraction`` per rank over the decode."""

    new_tokens: int
    tau: float
    accept_lengths: list[int]
    rounds: int
    pipeline_steps: int
    prefill_s: float
    decode_s: float
    busy_fraction: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Output:
    """One generation: ``text`` (decoded without the stop token, cut before a stop string), ``ids`` (the new
    token ids, the stop token or the token that completed a stop string included), ``prompt_ids``,
    ``finish_reason`` (``stop``, ``length`` or ``cancelled``), ``mode`` and ``stats``."""

    text: str
    ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    mode: str
    stats: Stats


class _Either:
    """``is_set()`` of either event (the caller's ``cancel``, may be None, and :meth:`FlowSpec.generate_many`'s own):
    what a generation's ``cancel`` reads."""

    def __init__(self, a, b) -> None:
        self.a, self.b = a, b

    def is_set(self) -> bool:
        return self.b.is_set() or (self.a is not None and self.a.is_set())


class FlowSpec:
    """A loaded pipeline in this process. Build with :meth:`load`; one generation at a time (calls from several
    threads wait for each other), or with ``lanes=N`` up to ``N`` at once, each on its own lane;
    :meth:`close` ends the stage threads (also at ``with`` exit). ``engine`` is rank 0's engine (with lanes, the
    one the lane engines were forked from: the generations run on ``pool.engines``)."""

    def __init__(self, engine, tokenizer, stop_ids: set[int], cfg, stage_root: Path, threads, errors,
                 template: str, pool=None) -> None:
        self.engine, self.tokenizer, self.stop_ids, self.cfg = engine, tokenizer, stop_ids, cfg
        self.stage_root, self.template = stage_root, template
        self._threads, self._errors = threads, errors
        self.pool = pool               # pipeline.lanes.LanePool with lanes > 1, else None
        self._lock = threading.Lock()  # one generation at a time (no pool); close() against a generation
        self._idle = threading.Condition()
        self._inflight = 0             # generations running (with a pool: close() waits for them)
        self._closed = False

    @property
    def lanes(self) -> int:
        """Generations that may run at once (``load``'s ``lanes``)."""
        return self.pool.size if self.pool is not None else 1

    # -- building -----------------------------------------------------------------------------------------
    @classmethod
    def load(cls, stage_dir: str | Path | None = None, *overrides: str, config=None,
             template: str = "auto", lanes: int | None = None) -> "FlowSpec":
        """Load a split checkpoint (``stage_dir``; None: ``model.stage_dir``, else the default SmolLM2 split)
        into one process. ``overrides``: ``key=value`` words as on the command line (``"mode=naive"``,
        ``"head_dir=..."``), applied on top of ``config`` (a :class:`config.run_config.RunConfig`, e.g. the one
        ``pipeline.run`` builds; default: the defaults). ``template``: chat formatting of text prompts
        (``auto``: the tokenizer's own template, else Vicuna; ``raw``: none). ``lanes``: generations that may run
        at once (1 to 64; module docstring; None: ``serve.max_active`` when it is set, else 1, so the server's
        knob means the same here, but its auto is one at a time): each lane has its own drafter state and, on
        every stage, its own KV cache of ``model.max_seq_len`` slots, allocated when the lane first runs;
        ``serve.ring_share`` and ``serve.lane_rows`` apply as in a server. Settings this process cannot honour
        are refused, not ignored: ``emu.profile`` (the emulated testbed models launched ranks' links) and
        ``comm.trace``."""
        import torch

        from config.modes import TP_MODES
        from config.paths import DEFAULT_STAGE_DIR
        from config.run_config import DEFAULT, apply_overrides
        from model.prompts import eos_ids, stop_token_ids
        from model.stage_format import StageDirError, read_manifest
        from model.stage_model import DTYPES
        from pipeline.build import (SetupError, generation_config, load_rank_stage, load_tokenizer, make_drafter,
                                    make_engine, make_static_stage)
        from pipeline.local_ring import LocalComm, LocalRing
        from pipeline.worker import StageWorker

        cfg = apply_overrides(config if config is not None else DEFAULT, list(overrides))
        if lanes is None:
            lanes = cfg.serve.max_active or 1
        if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= 64:
            raise SetupError(f"lanes={lanes!r}: give an integer from 1 to 64 (generations at once)")
        from pipeline.inprocess import _wait_s, not_in_process
        if (why := not_in_process(cfg)) is not None:    # refused, not ignored (emu.profile, comm.trace)
            raise SetupError(why)
        if lanes > 1 and cfg.osd.enabled:   # why: draft/osd.py, "Lanes" (as serve.max_active)
            raise SetupError(f"lanes={lanes} with osd.enabled: online learning keeps one request's record and one "
                             f"live head version at a time; load with lanes=1")
        if stage_dir is not None:
            cfg.model.stage_dir = str(stage_dir)
        if cfg.gen.mode in TP_MODES:
            raise SetupError(f"mode {cfg.gen.mode} needs a tensor-parallel launch (pipeline/tp_run.py), not this API")
        if cfg.model.device != "cpu" and not torch.cuda.is_available():
            raise SetupError(f"device={cfg.model.device} but CUDA is not available")
        root = Path(cfg.model.stage_dir or DEFAULT_STAGE_DIR)
        try:
            world = len(read_manifest(root)["split"])
        except (StageDirError, OSError, KeyError, ValueError) as e:
            hint = " (./run_pipe.sh or python -m model.default_model converts the default model once)" \
                if root == DEFAULT_STAGE_DIR else ""
            raise SetupError(f"no usable split checkpoint at {root}: {str(e).splitlines()[0][:200]}{hint}") from None
        dtype, device = DTYPES[cfg.model.dtype], cfg.model.device
        models = [load_rank_stage(cfg, root, r, world, dtype, device) for r in range(world)]
        gen_cfg = generation_config(root)
        try:
            tokenizer = load_tokenizer(root, light=True)   # no transformers import where it can (model/tokenizer.py)
            stop_ids = stop_token_ids(tokenizer, gen_cfg)
        except SetupError:   # a split without a tokenizer: token-id prompts only
            tokenizer = None
            stop_ids = eos_ids(gen_cfg, getattr(models[0].config, "eos_token_id", None))
        ring = LocalRing(world)
        drafter = make_drafter(cfg, root, models[0], dtype, device) if cfg.gen.mode != "ar" else None
        rank0 = LocalComm(ring, 0, timeout_s=_wait_s(cfg))   # comm.timeout_s when longer than the ring's 60 s
        engine = make_engine(cfg, rank0, models[0], root, [cfg.gen.mode], stop_ids, dtype, device, drafter=drafter)
        pool = None
        if lanes > 1:   # before the stage threads: a drafter that cannot be forked is one error, nothing to stop
            from pipeline.lanes import LaneError, LanePool
            try:
                pool = LanePool(engine, lanes, timeout_s=_wait_s(cfg), report_idle=False)
            except LaneError as e:
                raise SetupError(str(e).replace("serve.max_active > 1", f"lanes={lanes}")) from None
        errors: list[BaseException] = []

        def stage(r: int) -> None:
            try:  # no receive timeout: an idle stage waits for the next generation as long as the process lives
                worker = StageWorker(models[r], LocalComm(ring, r, timeout_s=None), cfg.model.max_seq_len, dtype,
                                     device)
                worker.static = make_static_stage(cfg, models[r], device)   # model.graphs
                worker.run()
            except BaseException as e:   # surfaced by the next generate()
                errors.append(e)

        threads = [threading.Thread(target=stage, args=(r,), daemon=True, name=f"flowspec-stage-{r}")
                   for r in range(1, world)]
        for t in threads:
            t.start()
        return cls(engine, tokenizer, stop_ids, cfg, root, threads, errors, template, pool)

    # -- generating ---------------------------------------------------------------------------------------
    def prompt_ids(self, prompt) -> list[int]:
        """Token ids of ``prompt``: text (chat-formatted with ``template``), a list of token ids (as is), or
        chat messages (``[{"role": "system"|"user"|"assistant", "content": ...}, ...]`` ending with the user)."""
        from model.prompts import PromptError, chat_prompt_ids, split_messages
        if isinstance(prompt, str):
            if not prompt.strip():
                raise GenerationError("the prompt is empty")
            return chat_prompt_ids(self._need_tokenizer(), [prompt], [], self.cfg.gen.system_prompt, self.template)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in prompt):
            vocab = self.engine.model.config.vocab_size
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise GenerationError(f"prompt token ids must be in [0, {vocab})")
            return list(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
            try:
                system, turns, answers = split_messages(list(prompt), self.cfg.gen.system_prompt)
            except PromptError as e:
                raise GenerationError(str(e)) from None
            return chat_prompt_ids(self._need_tokenizer(), turns, answers, system, self.template)
        raise GenerationError("prompt must be text, a non-empty list of token ids, or a list of chat messages")

    def generate(self, prompt, *, max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int | None = None,
                 stop: str | list[str] | None = None, mode: str | None = None,
                 on_token: Callable[[str], None] | None = None,
                 on_commit: Callable[[list[int]], None] | None = None, cancel=None) -> Output:
        """Generate an answer to ``prompt`` (see :meth:`prompt_ids`). Settings left None are the loaded
        configuration's (``gen.*``, ``mode``). ``stop``: stop strings (the answer ends at the token that
        completes one; ``text`` is cut before it). ``on_token(text)``: the text each commit adds, as it commits
        (their concatenation is ``text`` up to a stop string); ``on_commit(ids)``: the committed token ids;
        ``cancel``: anything with ``is_set()`` (a ``threading.Event``) ends the generation at its next commit.
        ``mode``: any pipeline mode the loaded drafter serves (``ar`` always)."""
        from config.modes import MODES, TP_MODES
        from model.prompts import StopText, TextDeltas
        from pipeline.engine import GenSettings, prompt_fit_error

        g = self.cfg.gen
        mode = g.mode if mode is None else mode
        if mode not in MODES or mode in TP_MODES:
            raise GenerationError(f"mode {mode!r}: choose one of {', '.join(m for m in MODES if m not in TP_MODES)}")
        if mode != "ar" and self.engine.drafter is None:
            raise GenerationError(f"mode {mode}: this pipeline was loaded with mode=ar (no drafter); load it with "
                                  f"mode={mode}")
        if mode == "sps" and self.engine.sps_drafter is None:
            raise GenerationError("mode sps: load the pipeline with mode=sps and a small draft LM (sps.draft_dir=...)")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise GenerationError("stop must be a non-empty string or a list of them")
        if (stops or on_token is not None) and self.tokenizer is None:
            raise GenerationError("stop strings and on_token need a tokenizer, and this split has none "
                                  "(on_commit streams token ids)")
        ids = self.prompt_ids(prompt)
        deltas = TextDeltas(self.tokenizer, self.stop_ids) if on_token is not None else None

        def committed(tokens: list[int]) -> None:
            if on_commit is not None:
                on_commit(list(tokens))
            if deltas is not None and (piece := deltas.push(tokens)):
                on_token(piece)

        try:
            settings = GenSettings(g.max_new_tokens if max_new_tokens is None else max_new_tokens,
                                   g.temperature if temperature is None else temperature,
                                   g.top_p if top_p is None else top_p, g.top_k if top_k is None else top_k,
                                   g.seed if seed is None else seed,
                                   stop_text=StopText(self.tokenizer, stops) if stops else None,
                                   on_commit=committed if (on_commit or deltas) else None, cancel=cancel)
        except UserError as e:
            raise GenerationError(str(e)) from None
        why = prompt_fit_error(len(ids), settings.max_new_tokens, self.cfg, self.engine.comm.world,
                               getattr(self.engine.model.config, "max_position_embeddings", None))
        if why is not None:
            raise GenerationError(why)
        with self._running():
            try:
                res = self._run(ids, mode, settings)
            except Exception:
                self._check_alive()   # a stage's own error explains a rank-0 timeout best
                raise
        if deltas is not None and (piece := deltas.finish()):
            on_token(piece)
        return self._output(res, ids, mode, stops, settings.max_new_tokens, cancel)

    def _run(self, ids: list[int], mode: str, settings):
        """One generation: on the engine under the one-at-a-time lock, or on a free lane (waiting for one)."""
        from pipeline.engine import timed_generation
        from pipeline.modes import new_decoder
        if self.pool is None:
            with self._lock:
                self._check_alive()
                return timed_generation(self.engine, ids, new_decoder(mode), settings)
        lane = self.pool.acquire()
        try:
            return timed_generation(self.pool.engines[lane], ids, new_decoder(mode), settings)
        finally:
            self.pool.release(lane)

    @contextmanager
    def _running(self):
        """Count a generation in flight (:meth:`close` and :meth:`forget_requests` wait until none is); refused once
        closed or broken."""
        with self._idle:
            self._check_alive()
            self._inflight += 1
        try:
            yield
        finally:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def generate_many(self, prompts, *, on_output: Callable[[int, "Output"], None] | None = None,
                      cancel=None, progress: bool = False, **settings) -> list["Output"]:
        """:meth:`generate` for every prompt of ``prompts`` with the same ``settings`` (``max_new_tokens``,
        ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``mode``), up to :attr:`lanes` at once; the
        outputs in the prompts' order, each equal to its prompt's :meth:`generate` alone. ``on_output(i, out)``:
        called as each finishes (from a worker thread). ``progress``: a progress bar on stderr (answers done, new
        tokens). ``cancel``: ends every generation at its next commit. A failed generation cancels those still
        running; its error is raised once all have returned."""
        from concurrent.futures import ThreadPoolExecutor, wait
        for bad in ("on_token", "on_commit"):
            if bad in settings:
                raise GenerationError(f"generate_many does not stream ({bad}): use on_output, or generate per prompt")
        prompts = list(prompts)
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(prompts), unit="answer", desc=f"generate_many ({self.lanes} at once)")
            tokens, user_hook = [0], on_output

            def on_output(i: int, out: "Output") -> None:      # (worker threads: tqdm's update is locked)
                tokens[0] += out.stats.new_tokens
                bar.set_postfix_str(f"{tokens[0]} new tokens", refresh=False)
                bar.update(1)
                if user_hook is not None:
                    user_hook(i, out)
        failed = threading.Event()
        stop = _Either(cancel, failed)
        outs: list = [None] * len(prompts)

        def one(i: int) -> None:
            if failed.is_set():    # another one failed: the call raises its error, no need to start this one
                return
            try:
                outs[i] = self.generate(prompts[i], cancel=stop, **settings)
                if on_output is not None:
                    on_output(i, outs[i])
            except BaseException:
                failed.set()
                raise

        ex = ThreadPoolExecutor(max_workers=max(1, min(self.lanes, len(prompts))), thread_name_prefix="flowspec-many")
        try:
            futures = [ex.submit(one, i) for i in range(len(prompts))]
            wait(futures)
        except BaseException:      # e.g. Ctrl-C while waiting: the generations end at their next commit
            failed.set()
            raise
        finally:
            ex.shutdown(wait=True)
            if bar is not None:
                bar.close()
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        return outs

    def _output(self, res, ids: list[int], mode: str, stops: list[str], max_new: int, cancel) -> Output:
        text = ""
        reason = "length" if len(res.output_ids) >= max_new else "cancelled"
        if self.tokenizer is not None:
            text = self.tokenizer.decode([t for t in res.output_ids if t not in self.stop_ids],
                                         skip_special_tokens=True)
            cut = [i for i in (text.find(s) for s in stops) if i >= 0]
            if cut:
                text, reason = text[:min(cut)], "stop"
        if res.output_ids and res.output_ids[-1] in self.stop_ids:
            reason = "stop"
        if reason == "cancelled" and not (cancel is not None and cancel.is_set()):
            reason = "length"
        stats = Stats(res.new_tokens, res.tau, list(res.accept_lengths), res.rounds, res.pipeline_steps, res.prefill_s,
                      res.decode_s, list(res.busy_fraction))
        return Output(text, list(res.output_ids), ids, reason, mode, stats)

    # -- lifetime -----------------------------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise GenerationError(f"{self.stage_root} has no tokenizer: give the prompt as token ids")
        return self.tokenizer

    def _check_alive(self) -> None:
        if self._closed:
            raise GenerationError("this FlowSpec is closed")
        if self._errors:
            e = self._errors[0]
            raise RuntimeError(f"a stage thread failed: {type(e).__name__}: {e}") from e
        if self.pool is not None and self.pool.mux.error is not None:
            e = self.pool.mux.error
            raise RuntimeError(f"the ring failed: {type(e).__name__}: {e}") from e

    def forget_requests(self) -> None:
        """Forget what earlier generations taught the drafter (the suffix source's store, recycle's table, online
        learning's weights: :func:`draft.protocol.forget_requests`). Like a server, a :class:`FlowSpec` keeps that memory across calls;
        call this before comparing modes or settings on the same prompts, or the later calls copy the earlier
        answers (docs/results.md §89)."""
        from draft.protocol import forget_requests
        with self._idle:      # between generations: waits for those in flight, none starts meanwhile
            self._idle.wait_for(lambda: self._inflight == 0)
            forget_requests(self.engine.drafter)
            for e in self.pool.engines if self.pool is not None else ():   # every lane's drafter has its own memory
                forget_requests(e.drafter)

    def close(self) -> None:
        """End the stage threads once the generations in flight have returned (idempotent)."""
        with self._idle:
            if self._closed:
                return
            self._closed = True                         # no new generation starts
            self._idle.wait_for(lambda: self._inflight == 0)
        with self._lock:
            broken = self._errors or (self.pool is not None and self.pool.mux.error is not None)
            if not broken:
                if self.pool is not None:
                    self.pool.shutdown()
                else:
                    self.engine.shutdown()
            elif self.pool is not None:
                self.pool.mux.close()
            for t in self._threads:
                t.join(timeout=30)

    def __enter__(self) -> "FlowSpec":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
