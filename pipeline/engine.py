"""Rank 0's shared machinery: prefill, lm_head, the output buffer, stats. Modes build on it."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol

import torch

from draft.protocol import DraftSampling, TreeDrafter, target_observer
from model.devices import HOST
from model.meter import OpMeter, SpanMeter, counter_fields, run_rows, take_counters
from model.stage_model import StageModel
from pipeline.messages import Context, Shutdown, Stats
from pipeline.transport import Transport
from pipeline.verify import Sampler

Tensor = torch.Tensor
PREFILL_WINDOW = 16   # prefill chunks rank 0 keeps in flight (well below pipeline.comm.MAX_PENDING)
MAX_TOP_LOGPROBS = 20  # GenSettings.logprobs: alternatives per token at most (OpenAI's top_logprobs limit)


class TokenLogprob(NamedTuple):
    """One committed token's ``logprob`` under the target's raw distribution and the ``top`` alternatives,
    ``[(token, logprob), ...]`` most likely first (``[]`` when none were asked for)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: Tensor, tokens: list[int], k: int) -> list[TokenLogprob]:
    """``tokens[i]``'s log-probability under ``log_softmax(logits[i])`` and the row's ``k`` best tokens.

    The *raw* distribution: the target's logits as the verifier received them, before temperature, top-k or
    top-p (vLLM's default, ``logprobs_mode=raw_logprobs``), so the numbers describe the model whatever the
    request's sampling, and a greedy token is its row's argmax (rank 1 of ``top``). Rows are the logits that
    *produced* each token: the prefill's last row for the first token, then the verified node each token was
    chosen at (``OutputBuffer.extend``'s ``rows``). Pure; float32 arithmetic as the logits come (host, float32).
    Ties in ``top`` are broken by ``torch.topk`` (not by token id)."""
    if logits.dim() != 2 or logits.shape[0] != len(tokens):
        raise ValueError(f"token_logprobs: {len(tokens)} tokens need as many logits rows, got {tuple(logits.shape)}")
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if k > 0:
        vals, idx = torch.topk(lp, min(k, lp.shape[1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(int(t), c, top) for t, c, top in zip(tokens, chosen, tops)]


def host_float(logits: Tensor) -> Tensor:
    """Logits as float32 on the host (what the verifier reads)."""
    return logits.float().to(HOST)


class DecodeResult(NamedTuple):
    """What a mode's decode loop returns: ``rounds`` (trees drafted from a fresh root), ``accept_lengths``
    (tokens committed per verification, bonus token included) and ``pipeline_steps`` (messages rank 0
    received while decoding)."""

    rounds: int
    accept_lengths: list[int]
    pipeline_steps: int


class Decoder(Protocol):
    """A mode's rank-0 decode loop for one generation (``pipeline.modes.new_decoder``). It starts after
    prefill with the target's ``logits`` of the last prompt token and every prompt token's ``features``,
    commits tokens into ``out`` until ``out.finished``, and leaves every stage ready for the next
    generation."""

    def __call__(self, engine: "Engine", logits: Tensor, features: Tensor, prompt_ids: list[int],
                 out: "OutputBuffer") -> DecodeResult: ...


class StepObserver(Protocol):
    """Instrumentation of verification outcomes, attached from outside (``engine.step_observers``): called with
    every verified step of the tree modes -- the tree the step's indices refer to, the accepted ``path`` (node
    indices, root first), the target's ``token`` after it and whether the generation ``finished`` with it --
    before the tree is re-rooted or dropped. It must not change the tree (e.g.
    :class:`pipeline.tree_stats.TreeStats`)."""

    def __call__(self, tree, path: list[int], token: int | None, finished: bool) -> None: ...


@dataclass
class GenResult:
    """One generation. ``accept_lengths[i]`` = tokens committed by verification step ``i`` counting the
    bonus token (τ = mean); ``pipeline_steps`` counts messages rank 0 received during decode."""

    output_ids: list[int]
    prefill_s: float
    decode_s: float
    rounds: int
    accept_lengths: list[int] = field(default_factory=list)
    pipeline_steps: int = 0
    busy_fraction: list[float] = field(default_factory=list)
    meter_fields: dict = field(default_factory=dict)   # the meters' counters as row fields (e.g. emu_*), or {}
    drafted_tokens: int = 0   # draft tokens sent to the target for verification (OutputBuffer.drafted)

    @property
    def accepted_draft_tokens(self) -> int:
        """Committed tokens that were drafted: every verification step's commit less its one target token
        (the bonus), as vLLM's ``num_accepted_tokens`` counts them. ``ar``: 0."""
        return sum(self.accept_lengths) - len(self.accept_lengths)

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))


@dataclass(frozen=True)
class GenSettings:
    """One generation's own settings, handed to :func:`timed_generation` as an argument: the same engine serves
    generations with other settings without anything being swapped on it or on its configuration
    (``pipeline.serve`` per request, ``pipeline.run``'s warm-up, the simulator per recorded answer,
    ``pipeline.api``).

    ``max_new_tokens``, ``temperature`` / ``top_p`` / ``top_k`` (HF ``generate``'s warpers, :class:`Sampler`) and
    ``seed`` (the sampler's generator is seeded with it at the start of the generation, so a generation is a
    function of its prompt and its settings); ``stop_text(ids) -> bool`` (stop strings,
    :class:`model.prompts.StopText`), ``on_commit(tokens)`` (called with the tokens each commit took) and
    ``cancel`` (anything with ``is_set()``) are :class:`OutputBuffer`'s hooks. ``logprobs``: None (default:
    nothing is computed) or k in [0, 20]: every committed token's log-probability under the target's *raw*
    distribution plus its k most likely alternatives (:func:`token_logprobs`); ``on_commit`` then gets them too,
    ``on_commit(tokens, logprobs)``. The engine-wide choices (mode strategy, tree shapes, drafter) stay in the
    engine's configuration.
    """

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_text: Callable[[list[int]], bool] | None = None
    on_commit: Callable[..., None] | None = None
    cancel: Any = None
    logprobs: int | None = None

    def __post_init__(self) -> None:
        from config.run_config import ConfigError
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ConfigError(f"logprobs={self.logprobs!r} must be None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not self.temperature >= 0:
            raise ConfigError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p!r} must be in (0, 1]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k!r} must be an integer >= 0 (0 = off)")

    @classmethod
    def from_config(cls, gen, **changes) -> "GenSettings":
        """The settings ``gen`` (a :class:`config.run_config.GenerationConfig`) gives, with ``changes``."""
        base = dict(max_new_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k,
                    seed=gen.seed)
        return cls(**{**base, **changes})

    def replace(self, **changes) -> "GenSettings":
        return dataclasses.replace(self, **changes)

    def new_sampler(self) -> Sampler:
        """A fresh :class:`Sampler` of these settings, its generator seeded with ``seed``."""
        return Sampler(float(self.temperature), float(self.top_p), int(self.top_k),
                       torch.Generator(device="cpu").manual_seed(int(self.seed)))


class OutputBuffer:
    """Committed new tokens; stops exactly like HF generate (stop token included, max_new_tokens).

    ``sampler``: the generation's :class:`Sampler` (the modes choose and verify through ``out.sampler``: it is a
    property of the generation, not of the engine). ``draft_sampling``: the generation's
    :class:`draft.protocol.DraftSampling`, which the modes hand the drafter's ``start`` (None: the drafter's own).

    Serving hooks (both optional, both used only inside :meth:`extend`): ``on_commit(tokens)`` is called
    with the tokens each ``extend`` took (``on_commit(tokens, logprobs)`` with ``logprobs`` set); ``cancel`` (anything with ``is_set()``, e.g. a
    ``threading.Event`` set by another thread) ends the generation at the next commit by setting
    ``finished``, so every mode leaves through its normal round-ending path and the stages stay consistent.

    Stop strings (``stop_text``, optional): a pure function of the committed ids, asked after every appended
    token (in order), that says whether the text now contains a stop string. The buffer finishes on the
    first token that completes one, so the cut depends only on the token sequence: every mode, whatever
    its verification granularity, stops at the same token as ``ar`` (and the target's law is untouched:
    stopping is a function of the tokens already drawn).

    Log-probabilities (``logprobs`` = k, None: off): the modes hand :meth:`extend` the target's logits that
    produced the tokens (no copy: a reference and row indices), and only a buffer asked for them computes
    :func:`token_logprobs` of the tokens it took, into ``logprobs`` (one entry per id of ``ids``).
    ``drafted``: draft tokens the mode sent to the target for verification (set by the tree modes' loops).

    The drafter's feed (issue 45; the seam's rule: :func:`draft.protocol.target_observer`): ``observe_target(tokens,
    logits)``, optional, is called in :meth:`extend` with the rows the taken tokens were chosen from and, per row,
    the committed token it follows (``prompt_last``, the prompt's last token, before the first one). Every mode
    commits through :meth:`extend` with its logits, so a drafter watches committed positions with no mode knowing.
    """

    def __init__(self, stop_ids: set[int], max_new_tokens: int, on_commit=None, cancel=None,
                 stop_text=None, sampler: Sampler | None = None, logprobs: int | None = None,
                 observe_target=None, prompt_last: int | None = None,
                 draft_sampling: DraftSampling | None = None) -> None:
        self.ids: list[int] = []
        self.draft_sampling = draft_sampling
        self.observe_target = observe_target
        self.prompt_last = prompt_last
        self.sampler = sampler if sampler is not None else Sampler()
        self.stop_ids = stop_ids
        self.max_new = max_new_tokens
        self.finished = False
        self.on_commit = on_commit
        self.cancel = cancel
        self.cancelled = False
        self.stop_text = stop_text
        self.top_logprobs = logprobs
        self.logprobs: list[TokenLogprob] = []
        self.drafted = 0

    def extend(self, tokens: list[int], logits: Tensor | None = None, rows: list[int] | None = None) -> int:
        """Append until a stop condition; returns how many tokens were taken. ``logits[rows[i]]`` (``rows``
        None: ``logits[i]``) are the target's logits ``tokens[i]`` was chosen from; read only with
        ``logprobs`` set, and then required (a mode that cannot give them fails loudly rather than misalign)."""
        taken = 0
        before = self.ids[-1] if self.ids else self.prompt_last     # the committed token the first row follows
        for t in tokens:
            if self.finished:
                break
            self.ids.append(int(t))
            taken += 1
            if int(t) in self.stop_ids or len(self.ids) >= self.max_new:
                self.finished = True
            elif self.stop_text is not None and self.stop_text(self.ids):
                self.finished = True
        if taken and self.observe_target is not None and logits is not None and before is not None:
            picked = logits[list(rows[:taken]) if rows is not None else slice(0, taken)]
            self.observe_target([before] + self.ids[len(self.ids) - taken:-1], picked)
        if taken and self.top_logprobs is not None:
            if logits is None:
                raise RuntimeError("logprobs were asked for but this mode's commit gave no logits")
            picked = logits[list(rows[:taken]) if rows is not None else slice(0, taken)]
            entries = token_logprobs(picked, self.ids[-taken:], self.top_logprobs)
            self.logprobs += entries
            if self.on_commit is not None:
                self.on_commit(self.ids[-taken:], entries)
        elif taken and self.on_commit is not None:
            self.on_commit(self.ids[-taken:])
        if self.cancel is not None and self.cancel.is_set() and not self.finished:
            self.finished = self.cancelled = True
        return taken


class Engine:
    """Rank 0's generation machinery for one configuration (``cfg``: mode strategies' tree shapes, prefill chunk,
    defaults of :class:`GenSettings`); it is never changed per generation: each generation's own settings are
    the :class:`GenSettings` argument of :func:`timed_generation`. ``sps_drafter``: the small LM of mode ``sps``
    (``pipeline.build.make_sps_drafter``; None when ``sps`` is not run)."""

    def __init__(self, model: StageModel, comm: Transport, drafter: TreeDrafter | None, stop_ids: set[int],
                 cfg, sps_drafter=None) -> None:
        self.model, self.comm, self.drafter = model, comm, drafter
        self.sps_drafter = sps_drafter
        self.stop_ids = stop_ids
        self.cfg = cfg
        self.tracer = comm.tracer
        self.dtype = next(model.parameters()).dtype
        # rank 0's verification lm_head (model.meter): traced as "lm_head" spans; instrumentation stacks its meters
        # after it (pipeline.build.make_engine) and the meter stack carries their counters (collect_busy)
        self.meter: OpMeter = SpanMeter(self.tracer, {"lm_head": "lm_head"})
        self.last_counters: dict = {}   # the decode window's meter fields (collect_busy)
        self.gen = 0           # generation number: stages ignore decisions of other generations
        # prefill chunks kept in flight; pipeline.lanes sets 1 while other requests share the ring, so a new
        # request's prefill delays their segments by at most one chunk per stage (chunk by chunk interleaving)
        self.prefill_window = PREFILL_WINDOW
        # pipeline.lanes: this request's share of the ring's links while other requests share it (None: all)
        self.ring_share: Callable[[], int] | None = None
        # pipeline.lanes (serve.lane_rows): most nodes one segment of this request carries while others share the
        # ring (None: no limit beyond the mode's own)
        self.lane_rows: Callable[[], int | None] | None = None
        self.step_observers: list[StepObserver] = []   # e.g. pipeline.tree_stats.TreeStats (the simulator's)

    def observe_step(self, tree, path: list[int], token: int | None, finished: bool) -> None:
        """Hand one verified step to every :class:`StepObserver` (modes call it; nothing happens without one)."""
        for observer in self.step_observers:
            observer(tree, path, token, finished)

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        """Target logits of ``hidden`` rows as float32 on the host: the one device->host copy of a
        verification step (``walk_tree`` and the sampler read them node by node on the host). Metered as an
        ``lm_head`` op (:mod:`model.meter`); row-wise, so with several lanes it may share one op with other lanes'
        ``lm_head`` rows (:func:`model.meter.run_rows`, :mod:`pipeline.coalesce`)."""
        head = self.model.lm_head
        return run_rows(self.meter, "lm_head", hidden.to(head.weight.device, self.dtype), head, key=head,
                        post=host_float)

    def prefill(self, prompt_ids: list[int]) -> tuple[Tensor, Tensor]:
        """Chunked, pipelined prefill. Returns (logits of the last prompt token, features of all prompt tokens)."""
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=HOST)[None]
        chunk = self.cfg.gen.prefill_chunk
        pieces = list(torch.split(ids, chunk, dim=1))
        self.gen += 1
        feats = []
        window = max(1, min(PREFILL_WINDOW, self.prefill_window))
        for i, piece in enumerate(pieces):   # pipelined, at most PREFILL_WINDOW chunks in flight (see Comm.send)
            if i >= window:
                feats.append(self.comm.recv_prev().x[0])
            self.comm.send_next(Context(piece, self.gen, reset=(i == 0)))
        while len(feats) < len(pieces):
            feats.append(self.comm.recv_prev().x[0])
        features = torch.cat(feats)
        return self.logits(features[-1:])[0], features

    def _stats_trip(self) -> tuple[Stats, list[list[float]]]:
        """One ring trip of a :class:`Stats` message: every rank writes its busy seconds and its meter's counters
        (``model.meter``; a table of width 0 when rank 0's meter counts nothing). Returns the message and the
        counter table with rank 0's row filled in."""
        world = self.comm.world
        width = len(getattr(self.meter, "counter_names", ()))
        self.comm.send_next(Stats(torch.zeros(world, dtype=torch.float64, device=HOST),
                                  torch.zeros(world, width, dtype=torch.float64, device=HOST)))
        msg = self.comm.recv_prev()
        table = msg.counters.tolist() if msg.counters is not None else [[] for _ in range(world)]
        table[0] = take_counters(self.meter)
        return msg, table

    def collect_busy(self, wall_s: float) -> list[float]:
        """Busy fractions of every rank over ``wall_s`` (then every busy counter restarts); the meters' decode-phase
        fields go to ``last_counters``."""
        msg, table = self._stats_trip()
        self.last_counters = counter_fields(self.meter, table, "decode")
        busy = msg.busy_s.tolist()
        busy[0] = self.tracer.busy_s
        self.tracer.reset_counters()
        return [min(1.0, b / wall_s) if wall_s > 0 else 0.0 for b in busy]

    def start_decode_window(self) -> dict:
        """One untimed ring trip between prefill and decode: every rank restarts its busy counter, so that
        busy fractions cover the decode window only (the definition: :func:`pipeline.trace.busy_fraction`),
        and hands in its meter's prefill counters (returned as row fields; {} when nothing counts)."""
        _, table = self._stats_trip()
        self.tracer.reset_counters()
        return counter_fields(self.meter, table, "prefill")

    def shutdown(self) -> None:
        self.comm.send_direct(Shutdown())   # ends the stages' direct-decision inboxes
        self.comm.send_next(Shutdown())
        self.comm.recv_prev()


def live_segments(engine) -> int:
    """Live segments a streaming mode keeps in flight: one per ring link (``engine.comm.world``), or, while several
    requests share the ring (``pipeline.lanes``), this request's share of the links (``engine.ring_share()``, at
    least 1). Only a schedule: what is computed and verified, hence the output, does not depend on it."""
    world = engine.comm.world
    share = getattr(engine, "ring_share", None)
    return world if share is None else max(1, min(world, int(share())))


def segment_cap(engine, cap: int) -> int:
    """A streaming mode's segment size ``cap`` (``-1``: every waiting node) under this request's lane limit
    (``engine.lane_rows()``, :func:`pipeline.lanes.lane_rows`; None or no limit: ``cap`` unchanged). Only a
    schedule, as :func:`live_segments`: the output does not depend on it."""
    limit = getattr(engine, "lane_rows", None)
    rows = None if limit is None else limit()
    if rows is None:
        return cap
    return rows if cap < 0 else min(cap, rows)


def tree_room(tree, world: int) -> int:
    """KV slots the draft trees of any mode may hold beyond the prompt and the new tokens (``tree``: a
    :class:`config.run_config.TreeConfig`; ``world``: ranks): a naive tree, a round's first tree plus four
    expansions in flight, or PipeDec's layers over the ring, and 8 spare. The one rule every entry point checks
    prompts with (:func:`prompt_fit_error`)."""
    return max(tree.total_token, tree.init_total_token + 4 * tree.expand_total_token,
               tree.pipedec_topk * (world + 4)) + 8


def prompt_fit_error(prompt_len: int, max_new_tokens: int, cfg, world: int, max_positions: int | None,
                     name: str = "max_new_tokens") -> str | None:
    """Why a prompt of ``prompt_len`` tokens cannot get ``max_new_tokens`` new ones (None: it fits): the model's
    ``max_positions`` (None: unlimited), then the stages' KV slots (``cfg.model.max_seq_len``) less the tree
    room (:func:`tree_room`). ``name``: what the caller calls the new-token limit (``max_tokens`` when
    serving). Pure: ``pipeline.run``, ``pipeline.serve`` and ``pipeline.api`` word their errors with it."""
    need = prompt_len + max_new_tokens
    if max_positions is not None and need > max_positions:
        return f"{prompt_len} prompt tokens + {name} {max_new_tokens} exceed the model's {max_positions} positions"
    room = tree_room(cfg.tree, world)
    if need + room > cfg.model.max_seq_len:
        return (f"{prompt_len} prompt tokens + {name} {max_new_tokens} + tree room {room} exceed "
                f"max_seq_len={cfg.model.max_seq_len} (the stages' KV slots)")
    return None


def timed_generation(engine: Engine, prompt_ids: list[int], decode_fn: Decoder,
                     settings: GenSettings | None = None, prefill=None) -> GenResult:
    """Run prefill + ``decode_fn`` (a fresh :class:`Decoder` per generation: ``pipeline.modes.new_decoder``) with
    this generation's ``settings`` (default: ``engine.cfg.gen``'s). Neither the engine nor its configuration is
    changed; the drafter takes the generation's temperature and seed for its sampled drafts with its prompt, at its
    ``start`` (``out.draft_sampling``, a :class:`draft.protocol.DraftSampling`). ``prefill(engine, prompt_ids) ->
    (logits, features)``: what stands for :meth:`Engine.prefill` (None: it), e.g. another lane's prefill of the same
    prompt shared (:meth:`pipeline.lanes.SharedPrefill.prefill`)."""
    if settings is None:
        settings = GenSettings.from_config(engine.cfg.gen)
    engine.tracer.reset_counters()
    engine.tracer.mark("gen_begin", prompt_tokens=len(prompt_ids))  # timeline windows (trace only)
    t0 = time.perf_counter()
    logits, features = engine.prefill(prompt_ids) if prefill is None else prefill(engine, prompt_ids)
    t1 = time.perf_counter()
    prefill_fields = engine.start_decode_window()  # untimed: busy counters restart, prefill counters
    t1b = time.perf_counter()
    engine.tracer.mark("decode_begin")
    observe = target_observer(getattr(engine, "drafter", None))
    if observe is not None:                    # the feed is drafting work: rank 0's busy time counts it
        hook = observe

        def observe(tokens, logits):
            with engine.tracer.span("draft"):
                hook(tokens, logits)
    out = OutputBuffer(engine.stop_ids, settings.max_new_tokens, settings.on_commit, settings.cancel,
                       settings.stop_text, settings.new_sampler(), settings.logprobs,
                       observe, prompt_ids[-1] if prompt_ids else None,
                       DraftSampling(settings.temperature, settings.seed))
    rounds, accepts, steps = decode_fn(engine, logits, features, prompt_ids, out)   # a DecodeResult
    t2 = time.perf_counter()
    engine.tracer.mark("gen_end", new_tokens=len(out.ids))
    busy = engine.collect_busy(t2 - t1b)  # decode window: pipeline.trace.busy_fraction's definition
    return GenResult(out.ids, t1 - t0, t2 - t1b, rounds, accepts, steps, busy,
                     {**engine.last_counters, **prefill_fields}, out.drafted)
