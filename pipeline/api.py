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

Start-up: for the supported families the whole path imports neither transformers nor ``torch._dynamo`` (stages and
EAGLE-1/2 heads built from :mod:`model.light`, the tokenizer from :mod:`model.tokenizer`): the README's example on
stories260K stages runs in about 3 s on a 2-core CPU, ``import torch`` a third of it (docs/results.md, "The API
example under 5 s").
"""
from __future__ import annotations

import threading
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


class FlowSpec:
    """A loaded pipeline in this process. Build with :meth:`load`; one generation at a time (calls from several
    threads wait for each other); :meth:`close` ends the stage threads (also at ``with`` exit)."""

    def __init__(self, engine, tokenizer, stop_ids: set[int], cfg, stage_root: Path, threads, errors,
                 template: str) -> None:
        self.engine, self.tokenizer, self.stop_ids, self.cfg = engine, tokenizer, stop_ids, cfg
        self.stage_root, self.template = stage_root, template
        self._threads, self._errors = threads, errors
        self._lock = threading.Lock()
        self._closed = False

    # -- building -----------------------------------------------------------------------------------------
    @classmethod
    def load(cls, stage_dir: str | Path | None = None, *overrides: str, config=None,
             template: str = "auto") -> "FlowSpec":
        """Load a split checkpoint (``stage_dir``; None: ``model.stage_dir``, else the default SmolLM2 split)
        into one process. ``overrides``: ``key=value`` words as on the command line (``"mode=naive"``,
        ``"head_dir=..."``), applied on top of ``config`` (a :class:`config.run_config.RunConfig`, e.g. the one
        ``pipeline.run`` builds; default: the defaults). ``template``: chat formatting of text prompts
        (``auto``: the tokenizer's own template, else Vicuna; ``raw``: none)."""
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
        engine = make_engine(cfg, LocalComm(ring, 0), models[0], root, [cfg.gen.mode], stop_ids, dtype, device,
                             drafter=drafter)
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
        return cls(engine, tokenizer, stop_ids, cfg, root, threads, errors, template)

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
        from pipeline.engine import GenSettings, prompt_fit_error, timed_generation
        from pipeline.modes import new_decoder

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
        with self._lock:
            self._check_alive()
            try:
                res = timed_generation(self.engine, ids, new_decoder(mode), settings)
            except Exception:
                self._check_alive()   # a stage's own error explains a rank-0 timeout best
                raise
        if deltas is not None and (piece := deltas.finish()):
            on_token(piece)
        return self._output(res, ids, mode, stops, settings.max_new_tokens, cancel)

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

    def forget_requests(self) -> None:
        """Forget what earlier generations taught the drafter (the suffix source's store, recycle's table, online
        learning's weights: :func:`draft.protocol.forget_requests`). Like a server, a :class:`FlowSpec` keeps that memory across calls;
        call this before comparing modes or settings on the same prompts, or the later calls copy the earlier
        answers (docs/results.md §89)."""
        from draft.protocol import forget_requests
        forget_requests(self.engine.drafter)

    def close(self) -> None:
        """End the stage threads (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._errors:
                self.engine.shutdown()
            for t in self._threads:
                t.join(timeout=30)

    def __enter__(self) -> "FlowSpec":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
