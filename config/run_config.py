"""Run configuration: edit the defaults below, or override any field on the command line.

Overrides are ``key=value`` words, e.g. ``mode=continuous max_new_tokens=64 tree.init_depth=5``.
A key is ``section.field`` or a bare ``field`` when the name is unique across sections; a bare name that
two sections share (``top_k``: ``tree.top_k`` the draft tree's beam width, ``gen.top_k`` sampling top-k) is an
error naming both. An unknown key fails with a did-you-mean suggestion; a bad value names the expected type.
``python -m pipeline.run --print-config [overrides]`` prints the effective configuration.

HF ``generate`` names: ``do_sample=false`` forces ``temperature=0`` (``do_sample=true`` with temperature 0 is
an error: give a temperature); ``gen.top_k``/``top_p``/``temperature``/``max_new_tokens`` mean what they
mean there; ``top_k_sampling`` is a deprecated alias of ``gen.top_k``; ``stop`` (HF's ``stop_strings``) is ``gen.stop``.
``repetition_penalty`` is not implemented and fails with one clear line (it would change the target
distribution that every mode's lossless verification reproduces).

Tree parameters follow the FlowSpec paper's code (``init_*`` for a round's first tree, ``expand_*`` for
dynamic expansion). ``total_token`` counts the root, as in EAGLE (60 = 59 drafted tokens + root).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

from config.errors import UserError
from config.modes import DEFAULT_MODE, MODES, canonical_mode

DTYPES = ("float32", "float16", "bfloat16", "float64")
DEVICES = ("cpu", "cuda")
QUANTS = ("none", "int8", "nf4", "fp4")
BACKENDS = ("gloo", "nccl")
GRAPHS = ("auto", "on", "off", "eager", "replay", "compile")   # model.graphs (model/graphs.py: resolve_executor)


class ConfigError(UserError, ValueError):
    pass


_SCALARS = {"int": int, "float": float, "bool": bool, "str": str}


class Checked:
    """A configuration section that refuses, in one line (:class:`ConfigError`), an attribute it does not have
    (naming the nearest valid one: ``cfg.gen.max_new_token = 5``) and a value of the wrong type
    (``cfg.gen.max_new_tokens = "x"``). An int is taken for a float field (as a float); a bool is not a number.
    Properties with a setter (``gen.top_k_sampling``) stay settable. Why: a typo'd attribute on a Python
    ``RunConfig`` used to be a silent no-op, and a wrong type surfaced as a raw ``TypeError`` deep in a rank."""

    def __setattr__(self, name: str, value) -> None:
        spec = {f.name: f.type for f in fields(self)}
        if name not in spec:
            if isinstance(getattr(type(self), name, None), property):
                object.__setattr__(self, name, value)
                return
            import difflib
            options = [*spec, *(k for k, v in vars(type(self)).items() if isinstance(v, property))]
            close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
            hint = f"; did you mean {self._where()}{close[0]}?" if close else ""
            raise ConfigError(f"{type(self).__name__} has no setting {self._where()}{name}{hint}")
        want = _SCALARS.get(spec[name]) or globals().get(spec[name])
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(want, type) and (not isinstance(value, want) or (want is not bool and isinstance(value, bool))):
            raise ConfigError(f"{self._where()}{name}={value!r} must be {want.__name__}, "
                              f"not {type(value).__name__}")
        object.__setattr__(self, name, value)

    def _where(self) -> str:
        """``"gen."`` for a section of :class:`RunConfig` (its key prefix), "" for the whole config."""
        return next((f"{f.name}." for f in fields(RunConfig) if f.type == type(self).__name__), "")


@dataclass
class ModelConfig(Checked):
    stage_dir: str = ""          # split checkpoint root ("" = the embedded default SmolLM2 split 0+8+8+7+7)
    head_dir: str = ""           # draft head dir ("" = the default model's head; untrained = a random head)
    dtype: str = "float32"       # compute dtype of every stage
    device: str = "cpu"          # cpu | cuda (each rank uses cuda:<local_rank % device_count>, or model.devices)
    devices: str = ""            # cuda only: GPU index per rank, rank 0 first, e.g. "0,0,1,1,2" (model/devices.py)
    quant: str = "none"          # none | int8 | nf4 | fp4 (bitsandbytes, verification stages only)
    max_seq_len: int = 2048      # KV slots per stage (prompt + new tokens + tree nodes)
    verify_checksums: bool = True
    num_threads: int = 1         # torch threads per rank on CPU (several ranks share the cores)
    lean_layers: bool = True     # decoder layers (stages, EAGLE head) run model/lean_layer.py's forward on their own
                                 # weights: fewer dispatches than transformers' layer, same math; false = transformers'
    eagle3_taps: str = "auto"    # layer outputs the stages forward for an EAGLE-3 head: auto (from head_dir) | none | 1,14,26
    draft_vocab: int = -1        # EAGLE-1/2 head: draft only over the N tokens the target emits most (draft/vocab.py;
                                 # cuts rank 0's draft lm_head to N/V; output unchanged); 0 = the whole vocabulary;
                                 # -1 = auto: 16384 where the head ships token counts (the default heads), else 0
    draft_vocab_counts: str = ""  # token counts that rank them ("" = <head dir>/token_counts.safetensors)
    draft_vocab_context: bool = True  # with draft_vocab: the context's own tokens (prompt, output) join the vocabulary
    draft_vocab_full_root: bool = True  # with draft_vocab: a tree's first level (one row) keeps the whole vocabulary
    graphs: str = "auto"         # stage forwards and draft-head levels on static shapes (model/graphs.py): on = CUDA
                                 # graphs on CUDA ranks, the eager static twin on CPU; off = dynamic shapes; auto = off
                                 # until measured on a GPU; eager / replay = the twin / recorded replays (tests)
    graph_buckets: str = "1,4,8,16,32,64"  # row counts a static forward pads to (the head also to the beam widths)


@dataclass
class TreeConfig(Checked):
    total_token: int = 60        # naive: nodes per tree incl. root (EAGLE-2 default)
    depth: int = 5               # naive: beam expansions after the first level
    top_k: int = 10              # naive: beam width / children per node
    init_total_token: int = 80   # pruned/continuous: first tree of a round
    init_depth: int = 6
    init_topk: int = 10
    subseq_token: int = 16       # max nodes per segment when filling the pipeline
    budget: str = ""             # pruned/continuous: emulation profile (name or JSON path) whose costs size
                                 # every segment (pipeline/budget.py: choose_segment_size); "" = fixed sizes
    first_levels: int = 2        # continuous (incremental): levels of a round's first tree drafted before its
                                 # first segment (subseq_token nodes) goes out; the rest grows while it travels
                                 # (0 = draft the whole first tree first)
    expand_total_token: int = 64  # continuous: tree drafted from each new root (0 = no expansion after a
                                  # verified step; ahead_levels still applies)
    expand_depth: int = 6
    expand_topk: int = 10
    expand_subseq_token: int = -1  # max nodes sent per step after the fill (-1 = all waiting nodes)
    expand_levels: int = 2       # continuous: levels grown per step below the best leaves, tree kept to
                                 # expand_total_token nodes (0 = redraft expand_depth levels from each new root)
    lookahead_min_prob: float = 0.0  # continuous (incremental): > 0 keeps the tree D levels deep below the root
                                 # instead of growing expand_levels per step; D = deepest level the target's path
                                 # reaches with probability >= this at the measured per-level acceptance
                                 # (pipeline/budget.py: lookahead_levels); 0 = off
    lookahead_max_levels: int = 4  # ... levels grown per verified step at most (tree.budget: also what the
                                 # profile's ring step leaves rank 0 for drafting, affordable_levels)
    ahead_levels: int = 0        # continuous: when a ring link is free and nothing waits, grow this many levels
                                 # below the best leaves and send them (draft ahead; 0 = off)
    ahead_min_prob: float = 0.02  # ... only while the best new node's draft path probability is at least this
    fuse_commit: bool = False    # continuous (incremental): commit the accepted tokens and re-feed the surviving
                                 # tree in ONE draft-head forward (the root's children keep their drafted input;
                                 # issue 41: one forward fewer per verified step; changes the trees, not the output)
    prefetch_level: bool = True   # continuous (incremental), implies fuse_commit: after each ring send, draft the
                                 # next expansion's first level for every leaf (a re-feed + one log-prob call while
                                 # the stages compute), so a verified step's turnaround holds one head forward and
                                 # one log-prob call (issue 41; changes the trees, not the output; default since
                                 # docs/results.md §48: ξ +5.7% what-if, +4.8% edge)
    early_level: bool = True     # continuous, with prefetch_level: after a verified step's re-root, send the next
                                 # expansion's first level (chosen from the prefetched candidates, no model call)
                                 # before the commit and the rest of the expansion (issue 41; the turnaround holds
                                 # no head forward; changes the trees, not the output; default with early_whole
                                 # since docs/results.md §63)
    early_whole: int = 80        # continuous, with prefetch_level and expand_levels=2: while the stages compute,
                                 # also prefetch the children of N first-level candidates (the likeliest beams), so
                                 # that a verified step whose beam is covered sends its WHOLE expansion (both levels)
                                 # in one segment right after the re-root, no model call before the send; otherwise
                                 # the early level (with early_level) or the plain prefetched expansion (issue 41;
                                 # 0 = off; changes the trees, not the output; 20 answers: xi +5.6% edge, +1.7%
                                 # what-if with early_level, against neither)
    early_cover: float = 1.0     # continuous, with early_whole: the share of a step's first-level beam whose
                                 # children must have been prefetched for the whole early send; a beam covered
                                 # less falls back as early_whole says (1 = every member; below 1 the uncovered
                                 # members' children are left out, their room going to the next-best candidates;
                                 # issue 41, results §66: lost on both profiles; changes
                                 # the trees, not the output)
    early_split: int = 0         # continuous, with early_whole: a whole early send leaves as two segments at once
                                 # (its first-level run, then the rest) when at least this many links are free
                                 # (0 = off; at least 2; issue 41, results §66: edge up,
                                 # what-if down; a schedule only)
    root_first: bool = False     # pruned/continuous: after a truncation, send the next round's root alone at once,
                                 # then commit the accepted tokens and draft its first tree (issue 41: a round
                                 # start's turnaround holds no draft call; changes the schedule, not the output)
    pipedec_topk: int = 16       # pipedec: nodes per new tree layer


@dataclass
class GenerationConfig(Checked):
    mode: str = DEFAULT_MODE     # continuous = FlowSpec (config/modes.py lists every mode)
    max_new_tokens: int = 128
    temperature: float = 0.0     # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0               # sampling top-k, 0 = off (``top_k_sampling`` is a deprecated alias)
    seed: int = 0
    prefill_chunk: int = 64      # prompt tokens per prefill message (chunked, pipelined prefill)
    system_prompt: str = ""
    stop: str = ""               # stop strings: one string, or a JSON list '["###", "\\n\\n"]' (see stop_strings)

    def stop_strings(self) -> list[str]:
        """``stop`` as a list: ``""`` -> none, a JSON list -> its strings, anything else -> that one string."""
        text = self.stop
        if not text:
            return []
        if text.lstrip().startswith("["):
            import json
            try:
                items = json.loads(text)
            except ValueError:
                raise ConfigError(f"gen.stop={text!r}: a JSON list of strings, e.g. '[\"###\", \"END\"]'") from None
            if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
                raise ConfigError(f"gen.stop={text!r}: a JSON list of non-empty strings")
            return items
        return [text]

    @property
    def top_k_sampling(self) -> int:
        """Deprecated name of ``top_k`` (sampling top-k), kept for old code and command lines."""
        return self.top_k

    @top_k_sampling.setter
    def top_k_sampling(self, value: int) -> None:
        self.top_k = value


@dataclass
class CommConfig(Checked):
    backend: str = "gloo"
    timeout_s: float = 30.0      # a dead rank makes every other rank exit within this time
    heartbeat_s: float = 0.5
    trace: bool = False          # write per-rank JSON timelines
    trace_dir: str = "traces"


@dataclass
class EmulationConfig(Checked):
    """Emulated edge testbed (pipeline/emulation.py): stage compute and links take a profile's modeled time."""
    profile: str = ""            # "" = off; a JSON path or a builtin name in profiles/ (edge_orin_7b, zero)
    model_rank0: bool = True     # pad rank 0's draft head / lm_head calls to the profile's rank0 model too
    flag_threshold: float = 0.05  # flag a row when overruns exceed this fraction of the modeled time (all ranks)
    time_scale: float = 1.0      # time dilation: every modeled duration x this (>1 when the host is slower than
                                 # the modeled devices); eval reports throughput in undilated (modeled) time
    tp_layers: int = 32          # modes tp/galaxy: decoder layers of the modeled model (LLaMA-7B: 32)
    tp_profile_stages: int = 4   # ... and how many stages the profile's stage cost splits it into (edge_orin_7b: 4)
    stage_cost_scale: float = 1.0  # pipeline stages: modeled stage time x this (4/3: the profile's model on 3 stages
                                   # instead of 4; the simulator's --stage-cost-scale)
    bandwidth_mbps: float = 0.0  # > 0: every link of the profile at this rate instead of its own


@dataclass
class DraftConfig(Checked):
    """Several drafters in one tree (draft/merged.py) and their knobs. Default: the EAGLE head and prompt lookup
    (faster than the head alone in every mode at T = 0, about even at T = 1: docs/results.md §18, "Several drafters in one
    tree"); "eagle" (or "") = the EAGLE head alone."""
    sources: str = "eagle,lookup"  # e.g. eagle, eagle,lookup,ssm:<dir> (eagle = what model.head_dir selects)
    lookup_max_ngram: int = 3    # prompt lookup: longest suffix n-gram searched (draft/lookup.py)
    lookup_min_ngram: int = 1
    lookup_max_matches: int = 8  # most recent occurrences whose continuations form the lookup tree
    lookup_token_prob: float = 0.6  # prior probability that one copied token is right (its score)
    suffix_min_match: int = 1    # suffix retrieval (draft/suffix.py, docs/suffix.md): shortest match that proposes
    suffix_threshold: int = 3    # match length from which copied tokens get suffix_long_token_prob (SAM's rule)
    suffix_token_prob: float = 0.3   # prior probability that one copied token is right below the threshold
    suffix_long_token_prob: float = 0.8  # ... and at or above it (both measured: docs/suffix.md)
    suffix_max_children: int = 8  # most frequent continuations kept per trie node (and state slots)
    suffix_max_depth: int = 0    # levels of a suffix trie (0 = the tree's depth + 1, as lookup's); more lets a long
                                 # match copy past the head's depth within the same node budget
    suffix_history_tokens: int = 32768  # earlier requests of the process kept for retrieval (0 = none)
    suffix_corpus: str = ""      # static corpus to retrieve from: .txt (a text a line) or .jsonl (text/turns/token_ids)
    suffix_other_threshold: int = 8  # suffix_threshold for matches in other texts: earlier requests, the corpus
                                 # (less often right than the request's own at the same length: docs/suffix.md)
    recycle_k: int = 8           # token recycling (draft/recycle_source.py): the target's top-k kept per token (row width)
    recycle_log_p0: float = -1.4   # score of a row's best entry (<= 0): log of its hit rate on records < 30 (-1.36,
                                 # scripts/recycle_calibrate.py; docs/results.md §72)
    recycle_log_step: float = -0.6  # score change per rank (<= 0): rank r scores log_p0 + r * log_step (fit: -0.59)
    recycle_persist: bool = True  # the table outlives a request (serving drafts from earlier requests' rows)
    tree_shape: str = "eagle2"   # how the head's tree search spends its rows: eagle2 (fixed beam: top_k rows per level,
                                 # depth levels) or confidence (draft/shape.py: only nodes that can still enter the
                                 # tree, as few per level as cover shape_cover of its mass, deeper where sure)
    shape_cover: float = 0.9     # confidence: share of a level's probability mass its expanded nodes cover (1 = all)
    shape_max_depth: int = 0     # confidence: most levels of the head's tree (0 = twice the call's depth + 1)
    shape_rows: int = 0          # confidence: most head rows per tree (0 = EAGLE-2's depth * top_k for the call)
    ssm_sample: bool = True      # T > 0: small LMs draw sampled children (SpecInfer), verified by walk_proposals
    eagle_sample: bool = False   # T > 0: the eagle source (model.head_dir's drafter) draws sampled chains from its own
                                 # law instead of its top-k beam (BeamTreeDrafter.sampled_tree, walk_proposals)
    sample_chains: int = 0       # chains of the eagle source's sampled trees (0: the tree's top_k)
    ssm_temperature: float = -1.0  # temperature of the small LM's proposal q (-1 = each generation's temperature)
    ssm_score_scale: float = -1.0  # merge calibration: a small LM's log-scores x this before the merge (> 1 trusts
                                   # it less; its own tree is unchanged; draft/merged.py); -1 = the student's own
                                   # calibrated value (merge_score_scale in its config.json, else 1)


@dataclass
class SpsConfig(Checked):
    """Mode ``sps``: chain speculative sampling with a small LM (pipeline/modes/sps.py)."""
    variant: str = "google"      # google (Leviathan et al.) | deepmind (Chen et al.): same law, see sps.py
    gamma: int = 4               # draft tokens per chain
    draft_dir: str = ""          # the small LM ("" = the first ssm:<dir> of draft.sources)


@dataclass
class OsdConfig(Checked):
    """Online speculative decoding (draft/osd.py, docs/osd.md): the EAGLE head learns from served traffic."""
    enabled: bool = False        # wrap the EAGLE drafter in draft.osd.OnlineDrafter (output stays exact)
    loss: str = "fkl"            # fkl KL(p||q) | rkl KL(q||p) | jsd (generalised, jsd_beta) on top-k buckets
    sample_source: str = "teacher"  # teacher | student | mix_token | mix_request (draft.osd.rollout_levels)
    mix_ratio: float = 0.5       # mix_*: probability of the student's own state (per token / per request)
    jsd_beta: float = 0.5
    teacher_topk: int = 32       # teacher distribution kept as its top-k log-probs + the tail mass
    buffer_tokens: int = 16384   # replay buffer capacity in entries (FIFO of whole requests)
    update_interval: int = 128   # new generated tokens before an update is attempted (cost gate)
    steps: int = 4               # optimizer steps per update
    batch_tokens: int = 512      # entries per optimizer step (whole requests, at least one)
    lr: float = 1e-4
    rollout: int = 2             # levels of the head's own rollout for student / mix sources (depth 1..rollout)
    holdout: int = 1             # newest requests held out to score candidate vs live weights
    min_gain: float = 0.0        # publish only if held-out agreement gains at least this (and strictly > 0)
    max_busy: float = 0.5        # the learner thread's busy share of wall time is kept at most this
    feature_weight: float = 1.0  # + this x SmoothL1 feature regression (EAGLE's term)
    window: int = 4              # requests per version before the rollback check
    rollback_tol: float = 0.1    # roll back when tau falls below (1 - tol) x the previous version's
    swap_at: str = "generation"  # generation (OnlineDrafter.start) | commit (round boundary, cache rebuilt)
    on_reject: str = "keep"      # keep training a rejected candidate | restart the next one from the live weights
    train_prompt: bool = False   # also learn on prompt positions (default: generated tokens only, as OSD)
    sync: bool = False           # learn inline at request boundaries instead of a background thread
    save_dir: str = ""           # save the live head there at exit (EAGLE layout, loadable as model.head_dir)


@dataclass
class ServeConfig(Checked):
    """Serving (``pipeline.serve``): ``max_active`` requests in flight through the ring at once, each on its own
    lane (``pipeline/lanes.py``; 1 = one at a time, exactly as before lanes); every stage then holds up to
    ``max_active`` KV caches of ``model.max_seq_len`` slots. ``ring_share``: live segments per ring link that the
    active requests share (``pipeline.lanes.ring_share``; a request alone keeps one per link whatever it is).
    ``lane_rows``: most nodes per segment of a request while several are active (``pipeline.lanes.lane_rows``;
    0 = no limit; a request alone is never limited). ``max_active=0`` (default): chosen by
    ``pipeline.lanes.auto_max_active`` (docs/results.md, §53 ("Four clients"): 4, or 1 with ``osd.enabled``)."""
    max_active: int = 0
    ring_share: float = 0.5      # docs/results.md §53 ("Four clients"): 0.5 against 1.0, four clients 2.57x vs 2.31x
    lane_rows: int = 16          # docs/results.md, §53 ("Four clients") (0 before: every waiting node in one segment)


@dataclass
class RunConfig(Checked):
    model: ModelConfig = field(default_factory=ModelConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    gen: GenerationConfig = field(default_factory=GenerationConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    emu: EmulationConfig = field(default_factory=EmulationConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    sps: SpsConfig = field(default_factory=SpsConfig)
    osd: OsdConfig = field(default_factory=OsdConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def validate(self) -> "RunConfig":
        def choice(name, value, options):
            if value not in options:
                raise ConfigError(f"{name}={value!r} is not valid; choose one of {', '.join(options)}")
        self.gen.mode = canonical_mode(self.gen.mode)   # mode=flowspec is mode=continuous
        choice("mode", self.gen.mode, MODES)
        choice("dtype", self.model.dtype, DTYPES)
        choice("device", self.model.device, DEVICES)
        choice("quant", self.model.quant, QUANTS)
        choice("backend", self.comm.backend, BACKENDS)
        choice("model.graphs", self.model.graphs, GRAPHS)
        parse_graph_buckets(self.model.graph_buckets)
        positive = {"max_new_tokens": self.gen.max_new_tokens, "prefill_chunk": self.gen.prefill_chunk,
                    "max_seq_len": self.model.max_seq_len, "total_token": self.tree.total_token,
                    "init_total_token": self.tree.init_total_token, "top_k": self.tree.top_k,
                    "init_topk": self.tree.init_topk, "expand_topk": self.tree.expand_topk,
                    "pipedec_topk": self.tree.pipedec_topk, "subseq_token": self.tree.subseq_token,
                    "num_threads": self.model.num_threads}
        for sec in fields(self):  # every number finite (nan/inf pass a plain range check)
            for f in fields(getattr(self, sec.name)):
                v = getattr(getattr(self, sec.name), f.name)
                if isinstance(v, float) and not math.isfinite(v):
                    raise ConfigError(f"{sec.name}.{f.name}={v} must be a finite number")
        for k, v in positive.items():
            if v < 1:
                raise ConfigError(f"{k}={v} must be >= 1")
        for k in ("depth", "init_depth", "expand_depth", "expand_total_token", "ahead_levels", "first_levels",
                  "early_whole"):
            if getattr(self.tree, k) < 0:
                raise ConfigError(f"{k}={getattr(self.tree, k)} must be >= 0")
        if self.tree.early_split not in (0,) and self.tree.early_split < 2:
            raise ConfigError(f"tree.early_split={self.tree.early_split} must be 0 (off) or >= 2 (free links)")
        if not 0 <= self.tree.early_cover <= 1:
            raise ConfigError(f"tree.early_cover={self.tree.early_cover} must be in [0, 1]")
        if not 0 <= self.serve.max_active <= 64:
            raise ConfigError(f"serve.max_active={self.serve.max_active} must be in [0, 64] (0 = auto)")
        if not 0 < self.serve.ring_share <= 64:
            raise ConfigError(f"serve.ring_share={self.serve.ring_share} must be in (0, 64]")
        if self.serve.lane_rows < 0:
            raise ConfigError(f"serve.lane_rows={self.serve.lane_rows} must be >= 0 (0 = no limit)")
        if self.model.draft_vocab < -1:
            raise ConfigError(f"model.draft_vocab={self.model.draft_vocab} must be >= 0 (0 = the whole vocabulary) "
                              "or -1 (auto)")
        if not 0 <= self.tree.lookahead_min_prob < 1:
            raise ConfigError(f"tree.lookahead_min_prob={self.tree.lookahead_min_prob} must be in [0, 1) (0 = off)")
        if self.tree.lookahead_max_levels < 1:
            raise ConfigError(f"tree.lookahead_max_levels={self.tree.lookahead_max_levels} must be >= 1")
        if not 0 <= self.tree.ahead_min_prob <= 1:
            raise ConfigError(f"tree.ahead_min_prob={self.tree.ahead_min_prob} must be in [0, 1]")
        if self.tree.expand_subseq_token < 1 and self.tree.expand_subseq_token != -1:
            raise ConfigError(f"expand_subseq_token={self.tree.expand_subseq_token} must be >= 1 or -1 (all)")
        if self.gen.temperature < 0:
            raise ConfigError(f"temperature={self.gen.temperature} must be >= 0")
        if not 0 < self.gen.top_p <= 1:
            raise ConfigError(f"top_p={self.gen.top_p} must be in (0, 1]")
        if self.gen.top_k < 0:
            raise ConfigError(f"gen.top_k={self.gen.top_k} must be >= 0 (0 = off)")
        if self.comm.timeout_s <= 0:
            raise ConfigError(f"timeout_s={self.comm.timeout_s} must be > 0")
        if not 0 < self.comm.heartbeat_s < self.comm.timeout_s:
            raise ConfigError(f"heartbeat_s={self.comm.heartbeat_s} must be > 0 and below timeout_s="
                              f"{self.comm.timeout_s} (a rank is declared lost after timeout_s without heartbeats)")
        if self.emu.flag_threshold < 0:
            raise ConfigError(f"emu.flag_threshold={self.emu.flag_threshold} must be >= 0")
        if self.emu.time_scale <= 0:
            raise ConfigError(f"emu.time_scale={self.emu.time_scale} must be > 0")
        if self.emu.stage_cost_scale <= 0:
            raise ConfigError(f"emu.stage_cost_scale={self.emu.stage_cost_scale} must be > 0")
        if self.emu.bandwidth_mbps < 0:
            raise ConfigError(f"emu.bandwidth_mbps={self.emu.bandwidth_mbps} must be >= 0 (0 = the profile's links)")
        if self.emu.tp_layers < 1 or self.emu.tp_profile_stages < 1:
            raise ConfigError("emu.tp_layers and emu.tp_profile_stages must be >= 1")
        for key, name in (("emu.profile", self.emu.profile), ("tree.budget", self.tree.budget)):
            if name:
                from config.profiles import EmulationError, load_profile
                try:
                    load_profile(name)
                except EmulationError as e:
                    raise ConfigError(f"{key}: {e}") from None
        self.gen.stop_strings()    # a malformed stop list is a ConfigError here
        choice("sps.variant", self.sps.variant, ("google", "deepmind"))
        if self.sps.gamma < 1:
            raise ConfigError(f"sps.gamma={self.sps.gamma} must be >= 1")
        if not 1 <= self.draft.lookup_min_ngram <= self.draft.lookup_max_ngram:
            raise ConfigError("draft.lookup_min_ngram and lookup_max_ngram need 1 <= min <= max")
        if self.draft.lookup_max_matches < 1 or not 0 < self.draft.lookup_token_prob <= 1:
            raise ConfigError("draft.lookup_max_matches must be >= 1 and lookup_token_prob in (0, 1]")
        if self.draft.recycle_k < 1 or self.draft.recycle_log_p0 > 0 or self.draft.recycle_log_step > 0:
            raise ConfigError("draft.recycle_k must be >= 1 and recycle_log_p0, recycle_log_step <= 0")
        if self.draft.ssm_score_scale <= 0 and self.draft.ssm_score_scale != -1:
            raise ConfigError(f"draft.ssm_score_scale={self.draft.ssm_score_scale} must be > 0 "
                              "(or -1: the student's own merge_score_scale)")
        choice("draft.tree_shape", self.draft.tree_shape, ("eagle2", "confidence"))
        if not 0 < self.draft.shape_cover <= 1:
            raise ConfigError(f"draft.shape_cover={self.draft.shape_cover} must be in (0, 1]")
        if self.draft.shape_max_depth < 0 or self.draft.shape_rows < 0:
            raise ConfigError("draft.shape_max_depth and draft.shape_rows must be >= 0 (0: from the call's depth)")
        if self.draft.sample_chains < 0:
            raise ConfigError(f"draft.sample_chains={self.draft.sample_chains} must be >= 0 (0: the tree's top_k)")
        if self.draft.ssm_temperature != -1 and self.draft.ssm_temperature <= 0:
            raise ConfigError(f"draft.ssm_temperature={self.draft.ssm_temperature} must be > 0 (or -1: gen.temperature)")
        self._validate_osd()
        if self.draft.sources:
            try:
                parse_sources(self.draft.sources)
            except SourceError as e:
                raise ConfigError(str(e)) from None
        return self

    def _validate_osd(self) -> None:
        o = self.osd
        for name, value, options in (("osd.loss", o.loss, ("fkl", "rkl", "jsd")),
                                     ("osd.sample_source", o.sample_source,
                                      ("teacher", "student", "mix_token", "mix_request")),
                                     ("osd.swap_at", o.swap_at, ("generation", "commit")),
                                     ("osd.on_reject", o.on_reject, ("keep", "restart"))):
            if value not in options:
                raise ConfigError(f"{name}={value!r} is not valid; choose one of {', '.join(options)}")
        for name in ("teacher_topk", "buffer_tokens", "update_interval", "steps", "batch_tokens", "rollout",
                     "holdout", "window"):
            if getattr(o, name) < 1:
                raise ConfigError(f"osd.{name}={getattr(o, name)} must be >= 1")
        if not 0 <= o.mix_ratio <= 1:
            raise ConfigError(f"osd.mix_ratio={o.mix_ratio} must be in [0, 1]")
        if not 0 < o.jsd_beta < 1:
            raise ConfigError(f"osd.jsd_beta={o.jsd_beta} must be in (0, 1)")
        if o.lr <= 0:
            raise ConfigError(f"osd.lr={o.lr} must be > 0")
        if not 0 < o.max_busy <= 1:
            raise ConfigError(f"osd.max_busy={o.max_busy} must be in (0, 1]")
        if o.min_gain < 0 or o.feature_weight < 0 or not 0 <= o.rollback_tol < 1:
            raise ConfigError("osd.min_gain and osd.feature_weight must be >= 0, osd.rollback_tol in [0, 1)")
        if o.enabled and self.serve.max_active > 1:   # why: draft/osd.py, "Lanes"
            raise ConfigError(f"osd.enabled cannot serve several requests at once (serve.max_active="
                              f"{self.serve.max_active}): online learning keeps one request's record and one live "
                              f"head version at a time; use serve.max_active=1 with osd")
        if o.enabled and self.draft.sources:
            try:
                kinds = {k for k, _ in parse_sources(self.draft.sources)}
            except SourceError:
                return      # reported by validate()
            if not kinds & {"eagle", "ssm"}:
                raise ConfigError(f"osd.enabled learns the EAGLE head and small draft LMs; draft.sources="
                                  f"{self.draft.sources} has neither (add eagle or ssm:<dir>)")


ALIASES = {"top_k_sampling": "gen.top_k", "gen.top_k_sampling": "gen.top_k"}   # deprecated names
# HF generate() names with no counterpart here: one clear error instead of "unknown key"
UNSUPPORTED = {
    "repetition_penalty": "repetition_penalty is not implemented: it changes the target distribution, which "
                          "every speculative mode's verification reproduces exactly; leave it out",
    "num_beams": "num_beams (beam search) is not implemented; this decoder is greedy (temperature=0) or samples",
}
# keys handled by apply_overrides itself rather than a dataclass field
SPECIAL = ("do_sample", "gen.do_sample")


def _keys(cfg: RunConfig) -> tuple[dict[str, tuple[str, str]], dict[str, list[str]]]:
    """``(keys, ambiguous)``: every accepted key -> (section, field): ``section.field`` always, a bare ``field``
    only when exactly one section has it, and the deprecated :data:`ALIASES`; and the bare names that more than one
    section has -> their qualified keys (``top_k`` -> tree.top_k, gen.top_k)."""
    out, seen = {}, {}
    for sec in fields(cfg):
        for f in fields(getattr(cfg, sec.name)):
            out[f"{sec.name}.{f.name}"] = (sec.name, f.name)
            seen.setdefault(f.name, []).append(sec.name)
    for name, secs in seen.items():
        if len(secs) == 1:
            out[name] = (secs[0], name)
    for alias, target in ALIASES.items():
        out[alias] = out[target]
    return out, {k: [f"{s}.{k}" for s in secs] for k, secs in seen.items() if len(secs) > 1}


def is_run_key(word: str) -> bool:
    """Whether ``word`` is a ``key=value`` word of a known key (qualified, bare or alias), whatever its value: what a
    tool asks of a free-text argument that may have swallowed a run key (argparse's ``nargs="+"``)."""
    keys, ambiguous = _keys(DEFAULT)
    return "=" in word and word.split("=", 1)[0].strip() in {**keys, **ambiguous}


def _unknown(key: str, keys: dict) -> ConfigError:
    """The error for a key nobody has: a did-you-mean (difflib) instead of the list of every key."""
    import difflib
    bare = key.split(".", 1)[-1]
    if bare in UNSUPPORTED:
        return ConfigError(UNSUPPORTED[bare])
    candidates = sorted(set(keys) | set(SPECIAL))
    close = difflib.get_close_matches(key, candidates, n=6, cutoff=0.6)
    if not close and "." in key:
        close = difflib.get_close_matches(bare, candidates, n=6, cutoff=0.6)
    picked, targets = [], set()
    for c in close:  # one suggestion per field (``max_new_tokens`` and ``gen.max_new_tokens`` are one key)
        target = keys.get(c, c)
        if target not in targets:
            targets.add(target)
            picked.append(c)
    close = picked[:3]
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint} (python -m pipeline.run --print-config lists every key)")


def _convert(raw: str, current):
    """``raw`` (command-line text) as the type of ``current``; ValueError when it does not parse."""
    if isinstance(current, bool):
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError("expected true/false")
    if isinstance(current, int):
        return int(raw)
    if isinstance(current, float):
        return float(raw)
    return raw


def apply_overrides(cfg: RunConfig, overrides: list[str] | dict) -> RunConfig:
    """Return a copy of ``cfg`` with ``key=value`` overrides applied and validated (``cfg`` is unchanged).

    Later words win over earlier ones; ``do_sample`` is applied after all the others, so its place on the
    command line does not matter."""
    cfg = dataclasses.replace(cfg, **{s.name: dataclasses.replace(getattr(cfg, s.name)) for s in fields(cfg)})
    keys, ambiguous = _keys(cfg)
    items = overrides.items() if isinstance(overrides, dict) else [_split(o) for o in overrides]
    do_sample = None
    for key, raw in items:
        if key in SPECIAL:
            try:
                do_sample = raw if isinstance(raw, bool) else _convert(str(raw), True)
            except ValueError:
                raise ConfigError(f"bad value {raw!r} for {key} (expected true/false)") from None
            continue
        if key in ambiguous:
            raise ConfigError(f"config key {key!r} is ambiguous: write {' or '.join(ambiguous[key])}")
        if key not in keys:
            raise _unknown(key, keys)
        sec, name = keys[key]
        section = getattr(cfg, sec)
        current = getattr(section, name)
        try:
            value = raw if not isinstance(raw, str) else _convert(raw, current)
        except ValueError:
            raise ConfigError(f"bad value {raw!r} for {key} (expected {type(current).__name__})") from None
        setattr(section, name, value)
    if do_sample is False:
        cfg.gen.temperature = 0.0
    elif do_sample is True and cfg.gen.temperature == 0:
        raise ConfigError("do_sample=true needs a temperature > 0 (temperature=0 is greedy decoding)")
    return cfg.validate()


def _split(word: str) -> tuple[str, str]:
    if "=" not in word:
        raise ConfigError(f"override {word!r} must look like key=value")
    k, v = word.split("=", 1)
    return k.strip(), v


def format_config(cfg: RunConfig) -> str:
    """``section.key = value`` lines of every field, ``# default: X`` after the ones that differ from a fresh
    :class:`RunConfig`."""
    base = RunConfig()
    lines = []
    for sec in fields(cfg):
        cur, ref = getattr(cfg, sec.name), getattr(base, sec.name)
        for f in fields(cur):
            v, d = getattr(cur, f.name), getattr(ref, f.name)
            mark = f"   # default: {d!r}" if v != d else ""
            lines.append(f"{sec.name}.{f.name} = {v!r}{mark}")
    return "\n".join(lines)


def parse_graph_buckets(text: str) -> tuple[int, ...]:
    """``model.graph_buckets`` ``"1,4,8,16,32,64"`` -> ``(1, 4, 8, 16, 32, 64)``: positive, strictly increasing
    row counts; anything else is one :class:`ConfigError` line."""
    try:
        out = tuple(int(w) for w in str(text).split(",") if w.strip())
    except ValueError:
        out = ()
    if not out or any(b < 1 for b in out) or any(a >= b for a, b in zip(out, out[1:])):
        raise ConfigError(f"model.graph_buckets={text!r} must be positive, strictly increasing row counts, "
                          "e.g. 1,4,8,16,32,64")
    return out


class SourceError(ValueError):
    """A ``draft.sources`` setting that does not parse (draft/merged.py builds the drafters it names)."""


def parse_sources(text: str) -> list[tuple[str, str]]:
    """``"eagle,lookup,ssm:/path"`` -> ``[("eagle", ""), ("lookup", ""), ("ssm", "/path")]``; SourceError on
    anything else (unknown kind, ``ssm`` without a directory, duplicates of eagle/lookup)."""
    out = []
    for word in [w.strip() for w in text.split(",") if w.strip()]:
        kind, _, arg = word.partition(":")
        if kind not in ("eagle", "lookup", "suffix", "recycle", "ssm"):
            raise SourceError(f"draft.sources: unknown source {word!r}; use eagle, lookup, suffix, recycle or "
                              "ssm:<model dir>")
        if kind == "ssm" and not arg:
            raise SourceError("draft.sources: ssm needs a model directory, e.g. ssm:checkpoints/ssm_2l")
        if kind != "ssm" and arg:
            raise SourceError(f"draft.sources: {kind} takes no argument (got {word!r})")
        if kind != "ssm" and any(k == kind for k, _ in out):
            raise SourceError(f"draft.sources: {kind} is listed twice")
        out.append((kind, arg))
    if not out:
        raise SourceError("draft.sources is empty")
    return out


# The configuration used when nothing is overridden. Edit here to change defaults.
DEFAULT = RunConfig().validate()
