"""Serve the pipeline: an OpenAI-compatible HTTP endpoint, a live page and an in-process request API.

``./run_serve.sh [key=value ...] [--host 127.0.0.1] [--port 8000]`` launches every rank as
``python -m pipeline.tools.launch --standalone --nproc_per_node=N -m pipeline.serve ...``. Ranks 1..N run the
unchanged :class:`pipeline.worker.StageWorker`; rank 0 builds the engine and drafter once (as
``pipeline.run`` does) and then

* its **main thread** runs the pipeline: it takes requests one at a time (batch 1, the pipeline's design)
  from a bounded FIFO queue and runs :func:`pipeline.engine.timed_generation` with the request's mode and
  sampling settings; while idle it sends a no-op message around the ring every few seconds so the stage
  ranks' receives never reach ``comm.timeout_s``; with ``serve.max_active=N > 1`` it runs up to N requests at
  once instead, each in its own thread on its own lane of the ring (:func:`serve_lanes`, ``pipeline/lanes.py``);
* a **uvicorn thread** serves the FastAPI app (``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/models``, ``/health``, ``/metrics``, ``/`` the live page), bound to 127.0.0.1 by default;
* the **in-process API** (:class:`RequestManager`: ``submit(prompt or messages, **sampling) -> Request``,
  iterate a request's committed tokens, read its stats) is what the HTTP layer uses; Python code can use it
  directly through ``main(argv, client=fn)`` (``fn(manager)`` runs in a thread of rank 0).

Invariants:

* requests start in submission order (``seq``); each is answered exactly once (a result, or an error);
  the queue holds at most ``--queue-size`` waiting requests (more: HTTP 429);
* every request gets a fresh :class:`pipeline.verify.Sampler` with its own generator seeded with its seed,
  so sampling at T > 0 stays the modes' lossless rule and a seeded request is reproducible;
* a cancel (client disconnect, stop string) sets the :class:`pipeline.engine.OutputBuffer` cancel flag; the
  generation ends at its next commit through the mode's normal round ending, so every stage's KV cache stays
  consistent, and the next request's prefill resets the caches anyway;
* a fatal error on rank 0 (a lost rank, Ctrl-C) answers every pending request with 503 before the process
  exits (:func:`pipeline.faults.on_fatal`); the existing fault machinery then stops every rank within
  ``comm.timeout_s``, naming the lost rank;
* SIGTERM is a graceful stop (:func:`entry`): new requests get 503, the request in flight finishes
  or, after ``--stop-grace-s``, ends at its next commit (``finish_reason`` "cancelled"), then every rank exits;
  a second signal (or Ctrl-C) stops at once;
* what a client sends is bounded before any work: the body (``--max-body-bytes``, HTTP 413), the prompt's
  characters (``--max-prompt-chars``, before tokenising), JSON of any depth (a 400, never a 500); JSON
  decoding and tokenising run off the event loop, so ``/health`` and streams never wait behind them;
* ``n`` choices are ``n`` requests admitted together or not at all (:meth:`RequestManager.submit_n`), choice i
  seeded :func:`choice_seed` (seed, i), sharing one prefill of the prompt when ``serve.max_active`` > 1
  (:class:`pipeline.lanes.SharedPrefill`: the later choices start from a copy of a running choice's KV prefix); ``logprobs`` are the target's raw log-softmax at the logits each
  committed token was chosen from (``GenSettings.logprobs``: nothing is computed unless asked for);
* response ids are random (unique across restarts); ``system_fingerprint`` is the configuration hash
  (:func:`system_fingerprint`); ``/metrics`` is prometheus_client's exposition of the manager's own registry
  (counters, gauges, latency histograms: :func:`metrics_registry`).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import os
import secrets
import socket
import sys
import threading
import time
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from config.modes import COMPARED_MODES

try:  # module level: FastAPI resolves handler annotations here (absent only where --help runs without the venv)
    from starlette.requests import Request as HTTPRequest
except ImportError:
    HTTPRequest = None

STATIC = Path(__file__).resolve().parent / "static"
MAX_BODY_BYTES = 1 << 20      # --max-body-bytes default (OpenAI-style 413 above it)
CHARS_PER_SLOT = 16           # --max-prompt-chars default: this many characters per KV slot (model.max_seq_len)
STOP_GRACE_S = 30.0           # --stop-grace-s default
ALL_MODES = ",".join(COMPARED_MODES)

EXAMPLES = """examples:
  ./run_serve.sh --port 8000                              # default SmolLM2 pipeline, 5 ranks, every mode
  ./run_serve.sh mode=continuous --queue-size 8 --port 8001
  curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
       -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}'
Config overrides are key=value words as for pipeline.run (mode= sets the default mode of requests)."""


class UsageError(ValueError):
    """A bad server flag, as one line (``parse_args(..., one_line=True)``: the launcher checks them once)."""


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def parse_args(argv: list[str] | None = None, one_line: bool = False) -> argparse.Namespace:
    """The server's flags; ``one_line``: raise :class:`UsageError` instead of printing the usage and exiting."""
    from config.invocation import prog
    p = (_OneLineParser if one_line else argparse.ArgumentParser)(
        prog=prog("pipeline.serve"),
        description="Serve the pipeline over HTTP from rank 0 (OpenAI-compatible API, live page). Launch one "
                    "process per rank (./run_serve.sh does).",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides key=value")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (0: any free port; the URL is printed)")
    p.add_argument("--queue-size", type=int, default=64, help="max waiting requests; more get HTTP 429")
    p.add_argument("--modes", default=ALL_MODES,
                   help=f"modes a request may ask for (default {ALL_MODES}); the draft head loads unless only ar")
    p.add_argument("--template", default="auto", help="chat formatting: auto (tokenizer's own, else vicuna) | "
                                                      "raw | an fschat template name")
    p.add_argument("--model-name", default=None, help="model id in /v1/models (default: the checkpoint's name)")
    p.add_argument("--warmup", type=int, default=0, help="untimed warm-up generations per mode before serving")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn access log)")
    p.add_argument("--no-http", action="store_true", help="no HTTP server (in-process API only: main(client=...))")
    p.add_argument("--no-share-prefill", action="store_true",
                   help="n > 1: every choice prefills the prompt itself (default: with serve.max_active > 1 the "
                        "choices share one prefill, pipeline.lanes.SharedPrefill; for measurements)")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help=f"largest request body accepted (default {MAX_BODY_BYTES}); larger: HTTP 413")
    p.add_argument("--max-prompt-chars", type=int, default=0,
                   help=f"longest prompt in characters, all messages together, checked before tokenising (default "
                        f"0: {CHARS_PER_SLOT} x model.max_seq_len); longer: HTTP 400 context_length_exceeded")
    p.add_argument("--stop-grace-s", type=float, default=STOP_GRACE_S,
                   help=f"SIGTERM: seconds the request in flight may still run before it is cut at its next commit "
                        f"(default {STOP_GRACE_S:g}); new requests get 503 meanwhile; a second signal stops at once")
    args = p.parse_intermixed_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"--port {args.port} is not a TCP port")
    if args.queue_size < 1:
        p.error("--queue-size must be >= 1")
    if args.max_body_bytes < 1024 or args.max_prompt_chars < 0:
        p.error("--max-body-bytes must be >= 1024 and --max-prompt-chars >= 0")
    if not 0 <= args.stop_grace_s <= 3600:
        p.error("--stop-grace-s must be in [0, 3600]")
    return args


def run_argv(sargs: argparse.Namespace) -> list[str]:
    """The ``pipeline.run`` arguments every rank of the server runs with (and the launcher checks once)."""
    return [*sargs.overrides, "--modes", sargs.modes, "--template", sargs.template]


# -- the in-process API ---------------------------------------------------------------------------------
class RequestError(ValueError):
    """A bad request (HTTP ``status``, 400 by default). ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


class QueueFull(RuntimeError):
    """The FIFO queue is full (HTTP 429)."""


class Unavailable(RuntimeError):
    """The server is stopping or the pipeline failed (HTTP 503)."""


MAX_N = 16                    # most choices (n) one request may ask for (each is a generation; see submit_n)
TEXT_CONTEXT = 4              # ids before a token that decide its text in logprobs (RequestManager.token_text)


@dataclass
class Params:
    """Per-request settings. ``seed`` is always set (drawn at random when the client gave none). ``logprobs``:
    None (off) or the number of alternatives per token (``GenSettings.logprobs``)."""
    mode: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed`` (``n`` > 1): ``seed`` itself for choice 0 (so
    choice 0 of ``n=2`` is the ``n=1`` answer), else the first 8 bytes of sha256("seed:index"). Pure and
    deterministic: a seeded request with ``n`` > 1 reproduces every choice, and distinct indices get
    independent-looking generators (the choices are independent samples at T > 0; at T = 0 they are equal)."""
    if index == 0:
        return seed
    import hashlib
    return int.from_bytes(hashlib.sha256(f"{seed}:{index}".encode()).digest()[:8], "big")


def inter_token_latencies(commits: list[tuple[float, int]]) -> list[float]:
    """Inter-token latency samples of one generation from its commits ``[(time, tokens), ...]`` (in order):
    every token of a commit after the first gets the gap since the previous commit divided by the commit's
    tokens, so the samples sum to the time from the first token to the last and there is one per token after
    the first commit (a speculative commit of k tokens counts as k tokens arriving at an even pace; vLLM's
    ``time_per_output_token`` likewise). Pure."""
    out = []
    for (t0, _), (t1, k) in zip(commits, commits[1:]):
        if k > 0:
            out += [(t1 - t0) / k] * k
    return out


class Request:
    """One generation. Written by rank 0's main thread (commits, result), read by any thread.

    ``ids`` are the committed new tokens; ``text`` the decoded text that is safe to show: it only ever grows
    (an incomplete UTF-8 character, or a possible stop string's first characters, are held back until the
    end). Iterating a request yields the new token ids of each commit until it is done; ``wait()`` blocks
    until it is; ``stats`` is the ``speculative`` object of the HTTP responses.
    """

    def __init__(self, seq: int, prompt_ids: list[int], params: Params, decode, stop_ids: set[int],
                 index: int = 0) -> None:
        self.seq, self.prompt_ids, self.params, self.index = seq, prompt_ids, params, index
        self._decode, self._stop_ids = decode, stop_ids
        self.created = time.time()
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_end: float | None = None
        self.order: int | None = None          # position in the service order (0-based)
        self.state = "queued"                  # queued | running | done | cancelled | failed
        self.ids: list[int] = []
        self.text = ""
        self.commits = 0                       # OutputBuffer commits (the first one is the prefill token)
        self.commit_log: list[tuple[float, int]] = []   # (time, tokens) of every commit (latency histograms)
        self.logprobs: list = []               # pipeline.engine.TokenLogprob per id (params.logprobs set)
        self.finish_reason: str | None = None
        self.result = None                     # pipeline.engine.GenResult once done
        self.drafter: dict = {}                # pipeline.outputs.drafter_fields of the drafter that served it
        self.error: tuple[int, str] | None = None  # (HTTP status, message) when failed
        self.cancel_event = threading.Event()
        self.delivered = threading.Event()     # the HTTP layer has sent the final response
        self.http = False
        self._stop_at: int | None = None       # text index of the first stop string
        self._cond = threading.Condition()
        self._waiters: list = []               # (event loop, asyncio.Event) of async readers
        self.version = 0
        self.share = None                      # pipeline.lanes.SharedPrefill of the n choices (n > 1), else None
        self.prefill_shared = False            # started from another choice's prefill (a Fork), no prefill of its own

    # -- reading ------------------------------------------------------------------------------------
    @property
    def final(self) -> bool:
        return self.state in ("done", "cancelled", "failed")

    def cancel(self) -> None:
        """Stop this request: dropped if still queued, else ended at the generation's next commit."""
        self.cancel_event.set()

    def wait(self, timeout: float | None = None) -> "Request":
        with self._cond:
            self._cond.wait_for(lambda: self.final, timeout)
        return self

    def __iter__(self):
        seen = 0
        while True:
            with self._cond:
                self._cond.wait_for(lambda: len(self.ids) > seen or self.final)
                new, final = self.ids[seen:], self.final
            seen += len(new)
            if new:
                yield new
            if final:
                return

    @property
    def stats(self) -> dict:
        """The ``speculative`` object: final statistics once done, progress so far before. Once done it holds
        ``num_draft_tokens`` (draft tokens sent to the target for verification: tree nodes but each round's
        root), ``num_accepted_tokens`` (committed tokens that were drafted: every step's commit less its bonus
        token) and ``acceptance_rate`` (their ratio; None without drafts, e.g. ``ar``)."""
        p = self.params
        out = {"mode": p.mode, "seq": self.seq, "index": self.index, "order": self.order, "seed": p.seed,
               "new_tokens": len(self.ids)}
        r = self.result
        if r is not None:
            drafted, accepted = r.drafted_tokens, r.accepted_draft_tokens
            out.update(prefill_shared=self.prefill_shared)
            out.update(steps=len(r.accept_lengths), tau=round(r.tau, 4), accept_lengths=r.accept_lengths,
                       num_draft_tokens=drafted, num_accepted_tokens=accepted,
                       acceptance_rate=round(accepted / drafted, 4) if drafted else None,
                       decode_s=round(r.decode_s, 6), prefill_s=round(r.prefill_s, 6), rounds=r.rounds,
                       pipeline_steps=r.pipeline_steps, busy_fraction=[round(b, 4) for b in r.busy_fraction],
                       **self.drafter)
        else:
            steps = max(0, self.commits - 1)
            out.update(steps=steps, tau=round((len(self.ids) - 1) / steps, 4) if steps else None)
        if self.t_start is not None:
            out["queue_s"] = round(self.t_start - self.t_submit, 6)
            if self.t_first is not None:
                out["ttft_s"] = round(self.t_first - self.t_submit, 6)
            out["elapsed_s"] = round((self.t_end or time.perf_counter()) - self.t_start, 6)
        return out

    # -- writing (rank 0's threads) -------------------------------------------------------------------
    def _notify(self) -> None:
        self.version += 1
        self._cond.notify_all()
        for loop, ev in list(self._waiters):
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that loop is closed
                pass

    def _full_text(self) -> str:
        return self._decode([t for t in self.ids if t not in self._stop_ids])

    def _commit(self, tokens: list[int], logprobs: list | None = None) -> None:
        """OutputBuffer's ``on_commit`` (main thread): record tokens (and their log-probabilities when asked
        for), update the safe text, stop strings."""
        now = time.perf_counter()
        with self._cond:
            self.ids.extend(int(t) for t in tokens)
            if logprobs is not None:
                self.logprobs.extend(logprobs)
            self.commits += 1
            self.commit_log.append((now, len(tokens)))
            if self.t_first is None:
                self.t_first = now
            if self._stop_at is None:
                full = self._full_text()
                stops = self.params.stop
                if stops:
                    hits = [i for i in (full.find(s) for s in stops) if i >= 0]
                    if hits:
                        self._stop_at = min(hits)
                        self.cancel_event.set()   # stop string: end the generation at the next commit
                        safe = full[:self._stop_at]
                    else:
                        safe = full[:max(0, len(full) - max(len(s) for s in stops) + 1)]
                else:
                    safe = full
                safe = safe.rstrip("\ufffd")      # an incomplete UTF-8 sequence: wait for its next bytes
                if len(safe) > len(self.text) and safe.startswith(self.text):
                    self.text = safe
            self._notify()

    def _start(self, order: int) -> None:
        with self._cond:
            self.state, self.order, self.t_start = "running", order, time.perf_counter()
            self._notify()

    def _finish(self, result, cancelled: bool) -> None:
        with self._cond:
            self.result, self.t_end = result, time.perf_counter()
            full = self._full_text()
            if self._stop_at is not None:
                full, self.finish_reason = full[:self._stop_at], "stop"
            elif self.ids and self.ids[-1] in self._stop_ids:
                self.finish_reason = "stop"
            elif len(self.ids) >= self.params.max_tokens:
                self.finish_reason = "length"
            else:
                self.finish_reason = "cancelled"
            if full.startswith(self.text):
                self.text = full
            self.state = "cancelled" if self.finish_reason == "cancelled" and cancelled else "done"
            self._notify()

    def _fail(self, status: int, message: str) -> None:
        with self._cond:
            if self.final:
                return
            self.error, self.state, self.t_end = (status, message), "failed", time.perf_counter()
            self._notify()


async def changes_of(reqs: list[Request]):
    """Async generator: yields (nothing) once per change of any of ``reqs`` (the choices of one HTTP request),
    from any event loop thread, until every one is final.

    Invariant: the last yield comes after every request's final change, i.e. it ends only when every request was
    final *before* its latest yield (versions unchanged since). Why: the consumer reads the requests while it holds
    a yield, and a request may finish in between; ending on "all final now" would drop that last change (a choice's
    finish chunk never sent: ``tests/test_serve.py::test_changes_of_yields_after_a_change_made_during_a_yield``)."""
    loop = asyncio.get_running_loop()
    ev = asyncio.Event()
    entry = (loop, ev)
    for r in reqs:
        with r._cond:
            r._waiters.append(entry)
    try:
        seen = None
        while True:
            ev.clear()
            v = tuple(r.version for r in reqs)
            if v != seen:
                seen = v
                yield
                continue
            if all(r.final for r in reqs):   # final before the latest yield: nothing left unseen
                return
            await ev.wait()
    finally:
        for r in reqs:
            with r._cond:
                r._waiters.remove(entry)


class RequestManager:
    """Validates and queues requests (thread-safe); rank 0's main thread serves them in FIFO order.

    ``submit`` raises :class:`RequestError` (bad input), :class:`QueueFull` or :class:`Unavailable`.
    """

    def __init__(self, tokenizer, stop_ids: set[int], modes: list[str], default_mode: str, cfg, model_config,
                 world: int, queue_size: int, model_name: str, template: str = "auto",
                 max_prompt_chars: int = 0, fingerprint: str | None = None) -> None:
        self.tokenizer, self.stop_ids = tokenizer, stop_ids
        self.modes, self.default_mode, self.cfg = modes, default_mode, cfg
        self.world, self.queue_size, self.model_name, self.template = world, queue_size, model_name, template
        self.vocab = model_config.vocab_size
        self.max_prompt_chars = max_prompt_chars or CHARS_PER_SLOT * cfg.model.max_seq_len
        self.max_positions = getattr(model_config, "max_position_embeddings", None) or (1 << 30)
        self._queue: collections.deque[Request] = collections.deque()
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._order = itertools.count()
        self.current: Request | None = None
        self.stopping = False
        self.failed: str | None = None
        self.started = time.time()
        self.m = collections.Counter()         # metrics counters
        self.busy_weighted = [0.0] * world     # sum of busy fraction x generation wall time
        self.busy_wall = 0.0
        self.last_busy = [0.0] * world
        self.live: list[Request] = []          # every request not yet final (for the fatal hook)
        self.fingerprint = fingerprint         # system_fingerprint of the responses (system_fingerprint())
        self.share_prefill = True              # n > 1: the choices share one prefill (--no-share-prefill: off)
        self.registry, self.hist = metrics_registry(self)

    # -- submission -----------------------------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, context: list[int], token: int, base: str | None = None) -> str:
        """``token``'s text after ``context`` (a few ids before it) as the logprobs show it: what decoding it
        adds to the context, so a SentencePiece token keeps its leading space and the texts of a generation's
        tokens concatenate to its text (special tokens included; a piece of a UTF-8 character shows as U+FFFD,
        its bytes too, as vLLM's). Falls back to the token decoded alone when the context's text changes.
        ``base``: the context's own text when the caller has it."""
        dec = self.tokenizer.decode
        if base is None:
            base = dec(context, skip_special_tokens=False)
        full = dec(list(context) + [token], skip_special_tokens=False)
        return full[len(base):] if full.startswith(base) else dec([token], skip_special_tokens=False)

    def logprob_texts(self, req: "Request", lo: int, hi: int):
        """``token_text(j, t)`` for :func:`format_logprobs` of ``req``'s entries ``[lo, hi)``: token ``t`` at
        output position ``lo + j``, after the ``TEXT_CONTEXT`` ids before that position (prompt included); each
        position's context is decoded once, whatever the number of alternatives."""
        seq, start = req.prompt_ids + req.ids[:hi], len(req.prompt_ids) + lo
        bases: dict[int, tuple[list[int], str]] = {}

        def text(j: int, t: int) -> str:
            if j not in bases:
                ctx = seq[max(0, start + j - TEXT_CONTEXT):start + j]
                bases[j] = (ctx, self.tokenizer.decode(ctx, skip_special_tokens=False))
            ctx, base = bases[j]
            return self.token_text(ctx, t, base)
        return text

    def check_chars(self, n: int, param: str) -> None:
        """Refuse a prompt of more than ``max_prompt_chars`` characters before tokenising it (a tokenizer's time
        and memory grow with the text; no prompt that long fits the stages' KV slots anyway)."""
        if n > self.max_prompt_chars:
            raise RequestError(f"the prompt has {n} characters, more than this server accepts "
                               f"({self.max_prompt_chars}, --max-prompt-chars)", param, "context_length_exceeded")

    def prompt_ids(self, prompt=None, messages=None) -> list[int]:
        from model.prompts import PromptError, chat_prompt_ids, split_messages
        if (prompt is None) == (messages is None):
            raise RequestError("give exactly one of prompt or messages", "prompt" if prompt is None else "messages")
        if messages is not None:
            if not isinstance(messages, list) or not messages:
                raise RequestError("messages must be a non-empty list", "messages")
            try:   # the one rule for message order (model.prompts.split_messages, shared with pipeline.api)
                system, turns, answers = split_messages(messages, self.cfg.gen.system_prompt, _content_text)
            except PromptError as e:
                raise RequestError(str(e), "messages") from None
            self.check_chars(sum(map(len, turns)) + sum(map(len, answers)) + len(system or ""), "messages")
            return chat_prompt_ids(self.tokenizer, turns, answers, system, self.template)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RequestError("prompt is empty", "prompt")
            self.check_chars(len(prompt), "prompt")
            return list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if min(prompt) < 0 or max(prompt) >= self.vocab:
                raise RequestError(f"prompt token ids must be in [0, {self.vocab})", "prompt")
            return list(prompt)
        raise RequestError("prompt must be a string or a non-empty list of token ids (one prompt per request)",
                           "prompt")

    def params(self, mode=None, max_tokens=None, temperature=None, top_p=None, top_k=None, seed=None,
               stop=None, logprobs=None) -> Params:
        mode = self.default_mode if mode is None else mode
        if mode not in self.modes:
            raise RequestError(f"mode {mode!r} is not served; choose one of {', '.join(self.modes)}", "mode")
        max_tokens = self.cfg.gen.max_new_tokens if max_tokens is None else max_tokens
        if not _is_int(max_tokens) or max_tokens < 1:
            raise RequestError("max_tokens must be an integer >= 1", "max_tokens")
        temperature = 0.0 if temperature is None else temperature
        if not _is_num(temperature) or not 0 <= temperature <= 100:
            raise RequestError("temperature must be a number in [0, 100]", "temperature")
        top_p = 1.0 if top_p is None else top_p
        if not _is_num(top_p) or not 0 < top_p <= 1:
            raise RequestError("top_p must be a number in (0, 1]", "top_p")
        top_k = 0 if top_k is None or top_k == -1 else top_k
        if not _is_int(top_k) or top_k < 0:
            raise RequestError("top_k must be an integer >= 0 (0 or -1: off)", "top_k")
        if seed is None:
            seed = secrets.randbits(63)
        elif not _is_int(seed) or not -(1 << 63) <= seed < (1 << 64):
            raise RequestError("seed must be a 64-bit integer", "seed")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("stop must be a non-empty string or a list of at most 4 of them", "stop")
        from pipeline.engine import MAX_TOP_LOGPROBS
        if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per token)",
                               "logprobs")
        return Params(mode, int(max_tokens), float(temperature), float(top_p), int(top_k), int(seed) % (1 << 64),
                      list(stop), logprobs)

    def check_length(self, ids: list[int], max_tokens: int, param: str) -> None:
        from pipeline.engine import prompt_fit_error
        why = prompt_fit_error(len(ids), max_tokens, self.cfg, self.world, self.max_positions, "max_tokens")
        if why is not None:
            raise RequestError(why, param, "context_length_exceeded")

    def submit(self, prompt=None, messages=None, **sampling) -> Request:
        """Queue a generation of ``prompt`` (text or token ids; no chat template) or ``messages`` (OpenAI
        chat messages, formatted with the chat template). ``sampling``: mode, max_tokens, temperature,
        top_p, top_k, seed, stop, logprobs. Returns at once; the request is served in FIFO order."""
        return self.submit_n(1, prompt, messages, **sampling)[0]

    def check_n(self, n) -> int:
        """``n`` (choices per request) as a 400 unless an integer in [1, min(MAX_N, queue size)]: more could never
        be admitted at once (they take one queue place each)."""
        top = min(MAX_N, self.queue_size)
        if n is None:
            return 1
        if not _is_int(n) or not 1 <= n <= top:
            raise RequestError(f"n must be an integer in [1, {top}]", "n")
        return n

    def submit_n(self, n: int, prompt=None, messages=None, **sampling) -> list[Request]:
        """``n`` independent generations of one prompt (OpenAI's ``n``), admitted together or not at all (429
        unless the queue has room for all ``n``). Choice ``i`` is a :class:`Request` of its own with ``index`` i
        and seed :func:`choice_seed` (seed, i); the prompt is validated and tokenised once.

        The prompt's prefill is shared (``serve.max_active`` > 1): the choices carry one
        :class:`pipeline.lanes.SharedPrefill`; the first to start prefills, the others start from a ``Fork`` of
        its lane's KV prefix (``pipeline.messages.Fork``), so each choice's output is still its ``n = 1`` answer
        with its seed. With ``serve.max_active = 1`` the stages hold one KV cache, which every generation's
        prefill resets, so each choice prefills again (the hook falls back to the engine's prefill). Shared
        always: validation, tokenising, and one admission."""
        n = self.check_n(n)
        try:
            params = self.params(**sampling)
        except TypeError as e:
            raise RequestError(str(e)) from None
        ids = self.prompt_ids(prompt, messages)
        self.check_length(ids, params.max_tokens, "messages" if messages is not None else "prompt")
        with self._cond:
            if self.stopping or self.failed:
                raise Unavailable(self.failed or "the server is stopping")
            if len(self._queue) + n > self.queue_size:
                self.m["rejected_queue_full"] += 1
                raise QueueFull(f"the request queue is full ({len(self._queue)} of {self.queue_size} waiting, "
                                f"{n} asked for); retry later")
            reqs = [Request(next(self._seq), ids, dataclasses.replace(params, seed=choice_seed(params.seed, i)),
                            self.decode, self.stop_ids, index=i) for i in range(n)]
            if n > 1 and self.share_prefill:
                from pipeline.lanes import SharedPrefill
                share = SharedPrefill(ids)
                for r in reqs:
                    r.share = share
            self._queue.extend(reqs)
            self.live.extend(reqs)
            self._cond.notify_all()
        return reqs

    # -- the serving side (rank 0's main thread) -------------------------------------------------------
    def next(self, timeout: float) -> Request | None:
        """The oldest waiting request not cancelled (cancelled ones are answered and dropped), or None
        after ``timeout`` seconds / when stopping."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while self._queue:
                    req = self._queue.popleft()
                    if req.cancel_event.is_set():
                        self.m["cancelled"] += 1
                        self._retire(req)
                        req._finish(None, True)
                        continue
                    self.current = req
                    req._start(next(self._order))
                    return req
                left = deadline - time.monotonic()
                if self.stopping or left <= 0:
                    return None
                self._cond.wait(left)

    def _retire(self, req: Request) -> None:
        if req in self.live:
            self.live.remove(req)

    def record(self, req: Request) -> None:
        """Account a finished generation in the metrics."""
        r = req.result
        with self._cond:
            self.current = None
            self._retire(req)
            self.m["cancelled" if req.state == "cancelled" else "completed"] += 1
            self.m["prompt_tokens"] += len(req.prompt_ids)
            self.m["generated_tokens"] += len(req.ids)
            if r is not None:
                self.m["verification_steps"] += len(r.accept_lengths)
                self.m["accepted_tokens"] += sum(r.accept_lengths)
                self.m["decode_s"] += r.decode_s
                self.m["prefill_s"] += r.prefill_s
                wall = r.decode_s + r.prefill_s
                self.last_busy = list(r.busy_fraction)
                for i, b in enumerate(r.busy_fraction[:self.world]):
                    self.busy_weighted[i] += b * wall
                self.busy_wall += wall
                self.m["draft_tokens"] += r.drafted_tokens
                self.m["accepted_draft_tokens"] += r.accepted_draft_tokens
            if req.seq >= 0:   # not a warm-up generation
                if req.t_first is not None:
                    self.hist["ttft"].observe(req.t_first - req.t_submit)
                for gap in inter_token_latencies(req.commit_log):
                    self.hist["itl"].observe(gap)
                if req.t_end is not None:
                    self.hist["e2e"].observe(req.t_end - req.t_submit)

    def queue_length(self) -> int:
        with self._cond:
            return sum(not r.cancel_event.is_set() for r in self._queue)

    def stop(self) -> None:
        """Finish the request in flight, answer the waiting ones with 503, end the serving loop."""
        with self._cond:
            self.stopping = True
            waiting = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for r in waiting:
            self._retire(r)
            r._fail(503, "the server is stopping")

    def begin_stop(self, grace_s: float) -> None:
        """A graceful stop (SIGTERM): refuse new requests (503), answer the waiting ones 503, let the request in
        flight finish, and cut it at its next commit (``finish_reason`` "cancelled") once ``grace_s`` has passed;
        the serving loop then ends and every rank exits normally. Returns at once."""
        self.stop()

        def cut() -> None:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline:
                with self._cond:
                    if self.current is None:
                        return
                    self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            cur = self.current
            if cur is not None:
                cur.cancel()

        threading.Thread(target=cut, daemon=True, name="flowspec-stop-grace").start()

    def fail_all(self, reason: str, wait_s: float = 2.0) -> None:
        """The pipeline is going down: answer every pending request 503, give HTTP a moment to send it."""
        with self._cond:
            self.failed = reason or "the pipeline stopped"
            pending = list(self.live)
            self._queue.clear()
            self._cond.notify_all()
        for r in pending:
            r._fail(503, f"the pipeline failed: {self.failed}")
        deadline = time.monotonic() + wait_s
        for r in pending:
            if r.http:
                r.delivered.wait(max(0.0, deadline - time.monotonic()))

    def busy_mean(self) -> list[float]:
        return [b / self.busy_wall if self.busy_wall > 0 else 0.0 for b in self.busy_weighted]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _content_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{i}].content must be a string or a list of text parts", "messages")


# -- rank 0's serving loop -------------------------------------------------------------------------------
def serve_rank0(sargs, client, args, cfg, modes, comm, model, stage_root: Path, dtype, device) -> int:
    """Rank 0 (``pipeline.run.main``'s ``rank0`` hook): build the engine, start HTTP, serve until stopped."""
    import torch

    from model.prompts import stop_token_ids
    from pipeline import faults
    from pipeline.build import SetupError, generation_config, load_tokenizer, make_engine
    from pipeline.engine import GenSettings, timed_generation
    from pipeline.modes import new_decoder
    from pipeline.outputs import drafter_fields
    from pipeline.run import model_name

    sock = None
    if not sargs.no_http:  # bind first: a taken port fails before anything else loads
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in sargs.host else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((sargs.host, sargs.port))
            sock.listen(128)
        except OSError as e:
            raise SetupError(f"cannot listen on {sargs.host}:{sargs.port}: {e.strerror or e}") from None
    tokenizer = load_tokenizer(stage_root)
    stop_ids = stop_token_ids(tokenizer, generation_config(stage_root))
    engine = make_engine(cfg, comm, model, stage_root, modes, stop_ids, dtype, device)
    default_mode = cfg.gen.mode if cfg.gen.mode in modes else modes[0]
    name = sargs.model_name or model_name(stage_root)
    manager = RequestManager(tokenizer, stop_ids, modes, default_mode, cfg, model.config, comm.world,
                             sargs.queue_size, name, sargs.template, sargs.max_prompt_chars,
                             system_fingerprint(cfg, stage_root, modes, sargs.template, comm.world))
    manager.share_prefill = not sargs.no_share_prefill
    faults.on_fatal(manager.fail_all)
    global _graceful_stop
    _graceful_stop = manager.begin_stop   # SIGTERM from here on: a graceful stop (entry)

    def generate(req: Request, eng=engine) -> None:
        p = req.params      # the request's own settings: an argument of its generation, nothing swapped
        settings = GenSettings(p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed,
                               on_commit=req._commit, cancel=req.cancel_event, logprobs=p.logprobs)
        share = req.share.hook(lambda: setattr(req, "prefill_shared", True)) if req.share is not None else None
        res = timed_generation(eng, req.prompt_ids, new_decoder(p.mode), settings, share)
        # + the emulated testbed's fidelity (emu.profile set): how far real work overran the modeled times
        req.drafter = {**(drafter_fields(eng.drafter) if p.mode != "ar" else {"drafter_version": None}),
                       **{k: res.meter_fields[k] for k in ("emu_overrun_ratio", "emu_flag") if k in res.meter_fields}}
        req._finish(res, req.cancel_event.is_set())
        manager.record(req)

    for mode in modes:  # warm-up: untimed, unrecorded
        for _ in range(sargs.warmup):
            warm = Request(-1, manager.prompt_ids(messages=[{"role": "user", "content": "Hello"}]),
                           Params(mode, min(16, cfg.gen.max_new_tokens)), manager.decode, stop_ids)
            generate(warm)
    manager.m.clear()

    server = None
    if sock is not None:
        server = _start_http(manager, sock, sargs.access_log, sargs.max_body_bytes)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"[serve] ready: http://{shown}:{port}/ (OpenAI API at /v1, {comm.world} ranks, modes "
              f"{','.join(modes)}, default {default_mode}, queue {sargs.queue_size}); Ctrl-C stops every rank",
              file=sys.stderr, flush=True)
    if client is not None:
        def run_client() -> None:
            try:
                client(manager)
            except Exception as e:  # the user's code: report it and stop serving
                print(f"[serve] client function failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
                manager.stop()
        threading.Thread(target=run_client, daemon=True, name="flowspec-client").start()

    from pipeline.messages import Stats
    keepalive_s = max(0.2, min(5.0, cfg.comm.timeout_s / 4))
    from pipeline.lanes import auto_max_active
    active = auto_max_active(cfg.serve.max_active, cfg.osd.enabled)
    if active > 1:   # several requests in flight, each on its own lane (pipeline/lanes.py)
        serve_lanes(manager, engine, generate, active, keepalive_s, sargs.stop_grace_s)
    last_ring = time.monotonic()
    while active == 1:
        req = manager.next(timeout=max(0.05, keepalive_s - (time.monotonic() - last_ring)))
        if req is not None:
            generate(req)
            last_ring = time.monotonic()
        elif manager.stopping:
            break
        elif time.monotonic() - last_ring >= keepalive_s:  # idle: keep the stages' receives alive
            comm.send_next(Stats(torch.zeros(comm.world, dtype=torch.float64)))
            comm.recv_prev()
            last_ring = time.monotonic()
    if server is not None:
        server.should_exit = True
        server.thread.join(5)
    if active == 1:   # serve_lanes shut its lanes' stages down itself
        engine.shutdown()
    return 0


def system_fingerprint(cfg, stage_root: Path, modes: list[str], template: str, world: int) -> str:
    """``fp_`` + the run's configuration hash: :func:`pipeline.outputs.provenance`'s ``config_hash`` (every setting
    that decides what is generated, the stages' manifest checksum, the head's weights checksum, template, world
    size) with the served modes folded in. Equal for two servers that answer a seeded request alike (the same
    configuration and model), different when any of that changes; a restart keeps it."""
    import hashlib

    from pipeline.build import head_choice
    from pipeline.outputs import head_identity, provenance
    needs_head = any(m != "ar" for m in modes)
    prov = provenance(cfg, stage_root, head_identity(cfg.model.head_dir, head_choice(cfg, stage_root), needs_head),
                      template, world)
    return "fp_" + hashlib.sha256(f"{prov['config_hash']}|{','.join(sorted(modes))}".encode()).hexdigest()[:16]


def serve_lanes(manager: RequestManager, engine, generate, lanes: int, keepalive_s: float, grace_s: float) -> None:
    """``serve_rank0``'s loop with ``serve.max_active = lanes > 1``: up to ``lanes`` requests in flight, each
    generated by ``generate(req, lane_engine)`` in its own thread on its own lane (:class:`pipeline.lanes.LanePool`;
    the others wait in the manager's bounded queue, 429 beyond it). A lane is free again the moment its generation
    returns (a cancelled or disconnected request ends at its next commit: ``OutputBuffer.cancel``). Idle: a
    keep-alive ``Stats`` trip on the control lane every ``keepalive_s``. Stopping: no new request starts; the
    ones in flight may run ``grace_s`` more seconds, then are cut at their next commit; then every stage is shut
    down. A lane's error (a lost rank) is raised here, in the serving thread (``pipeline.run``'s fault path; every
    in-flight request is answered 503 by ``manager.fail_all`` through ``faults.on_fatal``)."""
    from pipeline.lanes import LanePool
    pool = LanePool(engine, lanes)
    errors: list[BaseException] = []
    running: dict[int, Request] = {}

    def run(req: Request, lane: int) -> None:
        try:
            generate(req, pool.engines[lane])
        except BaseException as e:  # noqa: BLE001 - raised by the serving thread
            errors.append(e)
        finally:
            running.pop(lane, None)
            if req.share is not None:   # before the release: a Fork's source must be live (lanes.SharedPrefill)
                req.share.drop(lane)
            pool.release(lane)

    last_ring = time.monotonic()
    stop_seen = None
    while True:
        if errors:
            raise errors[0]
        if pool.busy:
            last_ring = time.monotonic()
        if not manager.stopping and pool.wait_free(timeout=0.05):
            req = manager.next(timeout=max(0.01, min(0.05, keepalive_s - (time.monotonic() - last_ring))))
            if req is not None:
                lane = pool.acquire(timeout=0)   # free: only this thread acquires
                running[lane] = req
                threading.Thread(target=run, args=(req, lane), daemon=True, name=f"flowspec-lane-{lane}").start()
                continue
        if manager.stopping:
            stop_seen = stop_seen or time.monotonic()
            if not pool.busy:
                break
            if time.monotonic() - stop_seen > grace_s:
                for r in list(running.values()):
                    r.cancel()
            time.sleep(0.02)
        elif not pool.busy and time.monotonic() - last_ring >= keepalive_s:  # idle: keep the stages' receives alive
            pool.keepalive()
            last_ring = time.monotonic()
    if errors:
        raise errors[0]
    pool.shutdown()


def _start_http(manager: RequestManager, sock: socket.socket, access_log: bool, max_body_bytes: int = MAX_BODY_BYTES):
    import uvicorn
    app = make_app(manager, max_body_bytes)
    config = uvicorn.Config(app, log_level="warning", access_log=access_log, lifespan="off",
                            timeout_graceful_shutdown=2, timeout_keep_alive=5)
    server = uvicorn.Server(config)
    server.thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                                     name="flowspec-http")
    server.thread.start()
    deadline = time.monotonic() + 30
    while not server.started and server.thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    if not server.started:
        from pipeline.build import SetupError
        raise SetupError("the HTTP server did not start")
    return server


# -- HTTP ----------------------------------------------------------------------------------------------
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                 "stream_options", "n", "user", "mode", "presence_penalty", "frequency_penalty",
                 "return_token_ids"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs"}
LOGPROB_FLOOR = -9999.0   # a log-probability of -inf (a token of probability 0 in float32) as JSON shows it


def requested_logprobs(body: dict, chat: bool) -> int | None:
    """The alternatives per token a body asks for (None: no logprobs). Chat: ``logprobs: true`` and
    ``top_logprobs`` k (0 when absent; ``top_logprobs`` without ``logprobs: true`` is a 400, as OpenAI answers);
    completions: ``logprobs`` k (an integer; 0 = the chosen tokens' only). Range checks: ``Params``."""
    if chat:
        on, k = body.get("logprobs"), body.get("top_logprobs")
        if on is not None and not isinstance(on, bool):
            raise RequestError("logprobs must be a boolean", "logprobs")
        if not on:
            if k is not None:
                raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        if k is not None and (not _is_int(k) or not 0 <= k <= 20):
            raise RequestError("top_logprobs must be an integer in [0, 20]", "top_logprobs")
        return 0 if k is None else k
    k = body.get("logprobs")
    if k is not None and (not _is_int(k) or not 0 <= k <= 20):
        raise RequestError("logprobs must be an integer in [0, 20]", "logprobs")
    return k


def response_id(chat: bool) -> str:
    """A response id unique across requests and restarts (128 random bits), OpenAI's prefixes."""
    import uuid
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def format_logprobs(entries: list, token_text, chat: bool, text_start: int = 0) -> dict:
    """OpenAI's ``logprobs`` object of ``entries`` (:class:`pipeline.engine.TokenLogprob`); ``token_text(j, id)``:
    the text of token ``id`` in place of entry ``j`` (:meth:`RequestManager.logprob_texts`). Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal"}``;
    completions: ``{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}] (None when k = 0),
    "text_offset"}`` (offsets into the concatenated token texts, from ``text_start``: a stream's chunks go on
    where the previous one ended). Pure; -inf shows as ``LOGPROB_FLOOR``."""
    def lp(x: float) -> float:
        return max(float(x), LOGPROB_FLOOR)

    if chat:
        def item(j: int, t: int, v: float) -> dict:
            text = token_text(j, t)
            return {"token": text, "logprob": lp(v), "bytes": list(text.encode("utf-8"))}
        return {"content": [{**item(j, e.token, e.logprob), "top_logprobs": [item(j, t, v) for t, v in e.top]}
                            for j, e in enumerate(entries)], "refusal": None}
    tokens, offsets, pos = [], [], text_start
    for j, e in enumerate(entries):
        text = token_text(j, e.token)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
    tops = None
    if entries and entries[0].top:
        tops = [{token_text(j, t): lp(v) for t, v in e.top} for j, e in enumerate(entries)]
    return {"tokens": tokens, "token_logprobs": [lp(e.logprob) for e in entries], "top_logprobs": tops,
            "text_offset": offsets}


def usage_of(reqs: list[Request]) -> dict:
    """The ``usage`` object of one response over its choices: the prompt counted once (as OpenAI does),
    completion tokens summed; ``completion_tokens_details`` reports the speculation in OpenAI's predicted-output
    fields (``accepted_prediction_tokens``: drafted tokens committed; ``rejected_prediction_tokens``: drafted
    tokens not committed; unlike OpenAI's predictions they are not billed as completion tokens), and the
    vLLM-named ``num_draft_tokens`` / ``num_accepted_tokens`` / ``acceptance_rate`` repeat them."""
    prompt = len(reqs[0].prompt_ids)
    completion = sum(len(r.ids) for r in reqs)
    drafted = sum(r.result.drafted_tokens for r in reqs if r.result is not None)
    accepted = sum(r.result.accepted_draft_tokens for r in reqs if r.result is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": max(0, drafted - accepted)},
            "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None}


class BodyTooLarge(Exception):
    """The request body is longer than the server's ``--max-body-bytes`` (HTTP 413)."""


async def read_body(request, limit: int) -> bytes:
    """The request body, refused (:class:`BodyTooLarge`) as soon as it is known to exceed ``limit`` bytes: by its
    Content-Length before reading anything, else while it streams in (chunked). Never holds more than ``limit``
    (+ one chunk) in memory."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise BodyTooLarge(int(declared))
        except ValueError:
            pass   # malformed header: the body's real length decides
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size)
        parts.append(chunk)
    return b"".join(parts)


def decode_body(raw: bytes, allowed: set[str]) -> dict:
    """The JSON object of a request body, or :class:`RequestError` (400) for anything malformed: not UTF-8, not
    JSON, nested deeper than the parser's recursion limit (a ``RecursionError``), not an object, unknown fields.
    Pure: the HTTP layer runs it off the event loop."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise RequestError("the request body is not valid JSON (or is nested too deeply)", None,
                           "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_json")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"Unrecognized request argument supplied: {str(unknown[0])[:100]}", str(unknown[0])[:100],
                           "unknown_parameter")
    return body


def make_app(manager: RequestManager, max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI app over ``manager`` (all endpoints; errors are OpenAI-style JSON bodies, 4xx for anything a
    client can get wrong, and a JSON 500 for the rest)."""
    import concurrent.futures

    from fastapi import FastAPI
    from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="FlowSpec pipeline server", docs_url=None, redoc_url=None, openapi_url=None)
    page = (STATIC / "serve.html").read_text(encoding="utf-8")
    # JSON decoding and tokenising leave the event loop (one worker: the tokenizer is shared, and submission
    # order stays arrival order); /health and the streams keep answering while a large prompt is processed
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="flowspec-parse")

    async def off_loop(fn, *args, **kw):
        return await asyncio.get_running_loop().run_in_executor(worker, lambda: fn(*args, **kw))

    def error(status: int, message: str, type_: str, param=None, code=None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                            status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):
        return error(exc.status_code, str(exc.detail), "invalid_request_error" if exc.status_code < 500
                     else "server_error", None, "not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def server_error(request, exc):   # never a plain-text 500 with a traceback
        return error(500, f"internal error: {type(exc).__name__}", "server_error")

    async def parse(request: HTTPRequest, allowed: set[str]):
        raw = await read_body(request, max_body_bytes)
        body = await off_loop(decode_body, raw, allowed)
        model = body.get("model")
        if model is not None and model != manager.model_name:
            shown = repr(model)[:120] if isinstance(model, str) else f"of type {type(model).__name__}"
            raise RequestError(f"The model {shown} does not exist; this server serves {manager.model_name!r}",
                               "model", "model_not_found", status=404)
        for k in ("presence_penalty", "frequency_penalty"):
            if body.get(k, 0) not in (0, 0.0, None):
                raise RequestError(f"{k} is not supported (only 0)", k)
        if not isinstance(body.get("stream", False), bool):
            raise RequestError("stream must be a boolean", "stream")
        so = body.get("stream_options")
        if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"}):
            raise RequestError("stream_options may only hold include_usage", "stream_options")
        return body

    async def complete(request: HTTPRequest, chat: bool):
        try:
            body = await parse(request, CHAT_FIELDS if chat else COMPLETION_FIELDS)
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
            sampling = dict(mode=body.get("mode"), max_tokens=max_tokens, temperature=body.get("temperature"),
                            top_p=body.get("top_p"), top_k=body.get("top_k"), seed=body.get("seed"),
                            stop=body.get("stop"), logprobs=requested_logprobs(body, chat))
            n = manager.check_n(body.get("n"))
            key = "messages" if chat else "prompt"
            if key not in body:
                raise RequestError(f"{key} is required", key)
            reqs = await off_loop(manager.submit_n, n, **{key: body[key]}, **sampling)
        except BodyTooLarge:
            manager.m["bad_requests"] += 1
            return error(413, f"the request body is larger than this server accepts ({max_body_bytes} bytes, "
                              f"--max-body-bytes)", "invalid_request_error", None, "request_too_large")
        except RequestError as e:
            manager.m["bad_requests"] += 1
            return error(e.status, str(e), "invalid_request_error", e.param, e.code)
        except QueueFull as e:
            return error(429, str(e), "rate_limit_error", None, "queue_full")
        except Unavailable as e:
            return error(503, str(e), "server_error", None, "unavailable")
        for r in reqs:
            r.http = True
        req = reqs[0]
        rid = response_id(chat)
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(req.created), "model": manager.model_name,
                "system_fingerprint": manager.fingerprint}
        with_ids = bool(body.get("return_token_ids"))
        with_logprobs = req.params.logprobs is not None

        def stats_of(r: Request) -> dict:
            s = r.stats
            if with_ids:
                s["prompt_ids"], s["output_ids"] = r.prompt_ids, list(r.ids)
            return s

        def speculative(r: Request | None = None) -> dict:
            """Choice ``r``'s statistics (a streamed chunk's), else choice 0's plus every choice's (n > 1)."""
            if r is not None:
                return stats_of(r)
            s = stats_of(req)
            if len(reqs) > 1:
                s["choices"] = [stats_of(x) for x in reqs]
            return s

        def logprobs_of(r: Request, lo: int, hi: int, text_start: int = 0) -> dict | None:
            if not with_logprobs:
                return None
            return format_logprobs(r.logprobs[lo:hi], manager.logprob_texts(r, lo, hi), chat, text_start)

        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

            def chunk(r: Request, delta: str | None, finish=None, role=False, lp=None) -> str:
                if chat:
                    d = {} if delta is None else {"content": delta}
                    if role:
                        d = {"role": "assistant", "content": ""}
                    choice = {"index": r.index, "delta": d, "logprobs": lp, "finish_reason": finish}
                else:
                    choice = {"index": r.index, "text": delta or "", "logprobs": lp, "finish_reason": finish}
                return "data: " + json.dumps({**base, "choices": [choice], "speculative": speculative(r)}) + "\n\n"

            async def events():
                sent = [0] * len(reqs)            # characters of text sent, per choice
                toks = [0] * len(reqs)            # tokens sent (a chunk per new commit, with their logprobs)
                lp_chars = [0] * len(reqs)        # characters of token texts sent (completions' text_offset)
                closed = [False] * len(reqs)      # finish chunk sent
                try:
                    if chat:
                        for r in reqs:
                            yield chunk(r, None, role=True)
                    async for _ in changes_of(reqs):
                        if any(r.state == "failed" for r in reqs):
                            break
                        for i, r in enumerate(reqs):
                            if closed[i]:
                                continue
                            text, n_ids, final = r.text, len(r.ids), r.final
                            if len(text) > sent[i] or n_ids > toks[i]:
                                lp = logprobs_of(r, toks[i], n_ids, lp_chars[i])
                                if lp is not None and not chat and lp["tokens"]:
                                    lp_chars[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                                yield chunk(r, text[sent[i]:], lp=lp)
                                sent[i], toks[i] = len(text), n_ids
                            if final:
                                yield chunk(r, None, finish=r.finish_reason)
                                closed[i] = True
                        if all(closed):
                            break
                    failed = [r for r in reqs if r.state == "failed"]
                    if failed:
                        status, message = failed[0].error
                        yield "data: " + json.dumps({"error": {"message": message, "type": "server_error",
                                                               "param": None, "code": status}}) + "\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    if include_usage:
                        yield "data: " + json.dumps({**base, "choices": [], "usage": usage_of(reqs),
                                                     "speculative": speculative()}) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    for r in reqs:
                        if not r.final:
                            r.cancel()   # the client went away (or the stream broke): stop at the next commit

            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                     background=BackgroundTask(lambda: [r.delivered.set() for r in reqs]))

        # not streamed: wait for the result, cancelling when the client disconnects
        async def until_final():
            async for _ in changes_of(reqs):
                pass
        waiter = asyncio.ensure_future(until_final())

        def delivered() -> None:
            for r in reqs:
                r.delivered.set()
        try:
            while not waiter.done():
                done, _ = await asyncio.wait({waiter}, timeout=0.25)
                if not done and await request.is_disconnected():
                    for r in reqs:
                        r.cancel()
                    waiter.cancel()
                    delivered()
                    return PlainTextResponse("", status_code=499)
        finally:
            if not waiter.done():
                waiter.cancel()
        bg = BackgroundTask(delivered)
        failed = [r for r in reqs if r.state == "failed"]
        if failed:
            status, message = failed[0].error
            resp = error(status, message, "server_error", None, "unavailable" if status == 503 else None)
            resp.background = bg
            return resp
        choices = [{"index": r.index, **({"message": {"role": "assistant", "content": r.text}} if chat else
                                         {"text": r.text}),
                    "logprobs": logprobs_of(r, 0, len(r.logprobs)), "finish_reason": r.finish_reason} for r in reqs]
        out = {**base, "object": "chat.completion" if chat else "text_completion", "choices": choices,
               "usage": usage_of(reqs), "speculative": speculative()}
        return JSONResponse(out, background=bg)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await complete(request, False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": manager.model_name, "object": "model",
                                            "created": int(manager.started), "owned_by": "flowspec"}]}

    @app.get("/health")
    async def health():
        if manager.failed:
            return error(503, manager.failed, "server_error", None, "unavailable")
        return {"status": "ok", "model": manager.model_name, "world_size": manager.world, "modes": manager.modes,
                "default_mode": manager.default_mode, "queue_length": manager.queue_length(),
                "queue_size": manager.queue_size, "busy": manager.current is not None}

    @app.get("/stats")
    async def stats():
        """JSON numbers for the live page."""
        cur = manager.current
        return {"queue_length": manager.queue_length(), "in_flight": cur.stats if cur is not None else None,
                "last_busy": manager.last_busy, "busy_mean": manager.busy_mean(), "world_size": manager.world,
                "modes": manager.modes, "default_mode": manager.default_mode, "model": manager.model_name,
                "completed": manager.m["completed"]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(manager), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/")
    async def index():
        return HTMLResponse(page)

    return app


# Latency histogram buckets (seconds), vLLM's with finer low ends: a CPU test model commits in milliseconds
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               10.0, 20.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0)


class _ManagerCollector:
    """The counters and gauges of /metrics, read from the manager at scrape time (prometheus_client collector)."""

    def __init__(self, manager: "RequestManager") -> None:
        self.manager = manager

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        manager = self.manager
        m = manager.m
        steps, acc = m["verification_steps"], m["accepted_tokens"]
        drafted, accepted = m["draft_tokens"], m["accepted_draft_tokens"]

        def family(kind, name, help_, value, labels=None, samples=()):
            fam = kind(name, help_, value=None if labels else value, labels=labels)
            for lab, v in samples:
                fam.add_metric(lab, v)
            return fam

        def counter(*a):
            return family(CounterMetricFamily, *a)

        def gauge(*a):
            return family(GaugeMetricFamily, *a)

        yield counter("flowspec_requests", "Requests by outcome", None, ["outcome"],
                      [([k], m[k]) for k in ("completed", "cancelled", "rejected_queue_full", "bad_requests")])
        yield counter("flowspec_prompt_tokens", "Prompt tokens prefilled", m["prompt_tokens"])
        yield counter("flowspec_generated_tokens", "Tokens generated", m["generated_tokens"])
        yield counter("flowspec_verification_steps", "Verification steps that committed tokens", steps)
        yield counter("flowspec_accepted_tokens", "Tokens committed by verification steps (incl. bonus)", acc)
        yield gauge("flowspec_tau", "Mean tokens committed per verification step (incl. bonus), all requests",
                    acc / steps if steps else 0.0)
        yield counter("flowspec_spec_decode_num_draft_tokens",
                      "Draft tokens sent to the target for verification (vLLM's num_draft_tokens)", drafted)
        yield counter("flowspec_spec_decode_num_accepted_tokens",
                      "Drafted tokens committed, bonus tokens excluded (vLLM's num_accepted_tokens)", accepted)
        yield gauge("flowspec_spec_decode_acceptance_rate", "num_accepted_tokens / num_draft_tokens, all requests",
                    accepted / drafted if drafted else 0.0)
        yield counter("flowspec_decode_seconds", "Decode time", m["decode_s"])
        yield counter("flowspec_prefill_seconds", "Prefill time", m["prefill_s"])
        yield gauge("flowspec_rank_busy_fraction", "Busy share of each rank over all generations (time-weighted)",
                    None, ["rank"], [([str(r)], b) for r, b in enumerate(manager.busy_mean())])
        yield gauge("flowspec_queue_length", "Requests waiting", manager.queue_length())
        yield gauge("flowspec_requests_running", "Requests being generated", int(manager.current is not None))


def metrics_registry(manager: "RequestManager"):
    """A prometheus_client registry of the manager's own (not the process-global one: several managers, e.g.
    tests, never collide) with its counters and gauges (:class:`_ManagerCollector`) and the latency histograms,
    returned as ``(registry, {"ttft", "itl", "e2e": Histogram})``."""
    from prometheus_client import CollectorRegistry, Histogram
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ManagerCollector(manager))
    hist = {
        "ttft": Histogram("flowspec_time_to_first_token_seconds", "Submit to first committed token (queue included)",
                          buckets=TTFT_BUCKETS, registry=registry),
        "itl": Histogram("flowspec_inter_token_latency_seconds", "Time per output token after the first (a commit "
                         "of k tokens: its gap / k, k samples)", buckets=ITL_BUCKETS, registry=registry),
        "e2e": Histogram("flowspec_e2e_request_latency_seconds", "Submit to the generation's end",
                         buckets=E2E_BUCKETS, registry=registry),
    }
    return registry, hist


def prometheus_text(manager: RequestManager) -> str:
    """Prometheus exposition format (text 0.0.4) of the server's counters, gauges and latency histograms."""
    from prometheus_client import generate_latest
    return generate_latest(manager.registry).decode()


# -- entry point -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None, client=None) -> int:
    """Run this rank of the server. ``client(manager)``, if given, runs in a thread of rank 0 once serving
    starts (the in-process API: ``manager.submit(...)``; call ``manager.stop()`` to end the job)."""
    from pipeline import run
    sargs = parse_args(sys.argv[1:] if argv is None else argv)
    def rank0(args, cfg, modes, comm, model, stage_root, dtype, device):
        return serve_rank0(sargs, client, args, cfg, modes, comm, model, stage_root, dtype, device)

    return run.main(run_argv(sargs), rank0=rank0)


_graceful_stop = None   # rank 0's RequestManager.begin_stop once it serves (set by serve_rank0)


def entry(argv: list[str] | None = None, client=None) -> int:
    """What ``python -m pipeline.serve`` runs: Ctrl-C stops every rank at once, SIGTERM gracefully
    (:func:`pipeline.run.exit_on_signals` with rank 0's ``RequestManager.begin_stop``)."""
    from pipeline import run
    if not run.debug():
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    argv = sys.argv[1:] if argv is None else argv
    try:
        grace = parse_args(argv, one_line=True).stop_grace_s
    except UsageError:
        grace = STOP_GRACE_S   # main() prints the usage
    run.whole_lines()
    run.exit_on_signals(lambda: _graceful_stop, grace)
    return main(argv, client)


if __name__ == "__main__":
    from pipeline.run import exit_now
    exit_now(entry())
