"""Builds what every entry point needs from a configuration: a rank's stage, rank 0's drafter and engine,
the tokenizer's stop ids, and the default paths (``config/paths.py``).

``pipeline.run`` (the rank entry point), ``pipeline.serve``, ``pipeline.tp_run``, the tools (simulator, reports,
benchmarks) and the tests construct these through here, so a new drafter kind or engine option is wired once.
Every failure that is the user's input (a missing head, a head that does not fit, a bad stage root) is one
:class:`SetupError` with a one-line message.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from config.errors import UserError
from config.paths import DEFAULT_HEAD_DIR, DEFAULT_STAGE_DIR


class SetupError(UserError, RuntimeError):
    pass


def loading_line(rank: int, manifest: dict, stage_root: Path) -> str:
    """The one line a rank prints (to stderr) before loading its stage; nothing else follows on success."""
    split = manifest.get("split", [])
    start = sum(split[:rank])
    what = "embeddings + lm_head + draft head" if rank == 0 else f"layers {start}-{start + split[rank] - 1}"
    size = sum(int(v.get("bytes", 0)) for k, v in manifest.get("files", {}).items()
               if k.startswith(f"stage_model_{rank}/"))
    return f"[rank {rank}] loading stage {rank} ({what}, {size / 1e6:.0f} MB) ..."


def load_rank_stage(cfg, stage_root: Path, rank: int, world: int, dtype, device: str):
    """Rank ``rank``'s stage model with its EAGLE-3 taps set (every rank derives the same tapped layers from
    ``model.eagle3_taps``; auto = the head's own). Stage-root and head problems are one :class:`SetupError`."""
    from draft.eagle3 import stage_taps
    from draft.head_io import HeadError
    from model.stage_format import StageDirError, stage_dir
    from model.stage_model import load_stage
    try:
        model = load_stage(stage_root, rank, world, dtype, device, cfg.model.verify_checksums,
                           cfg.model.quant if rank > 0 else "none")
    except StageDirError as e:
        raise SetupError(str(e)) from None
    except (OSError, ValueError) as e:  # e.g. a garbage config.json
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise SetupError(f"cannot load stage {rank} from {stage_dir(stage_root, rank)}: "
                         f"{type(e).__name__}: {first}") from None
    from model.layers import set_lean
    set_lean(model, cfg.model.lean_layers)
    try:
        model.set_taps(stage_taps(cfg.model.eagle3_taps, head_choice(cfg, stage_root), model.config.num_hidden_layers))
    except HeadError as e:
        raise SetupError(str(e)) from None
    return model


def generation_config(stage_root: Path) -> dict:
    """Stage 0's ``generation_config.json`` ({} when absent): the model's own eos ids."""
    from model.stage_format import stage_dir
    path = stage_dir(stage_root, 0) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer(stage_root: Path, light: bool = False):
    """The tokenizer stored with stage 0; an unusable one is a :class:`SetupError`. ``light``: read with the
    ``tokenizers`` library alone where :func:`model.tokenizer.load_light_tokenizer` reproduces transformers' (the
    same ids, text and chat template; no transformers import: the one-process API), else ``AutoTokenizer``."""
    from model.stage_format import stage_dir
    sdir = stage_dir(stage_root, 0)
    if light:
        from model.tokenizer import load_light_tokenizer
        tok = load_light_tokenizer(sdir)
        if tok is not None:
            return tok
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(sdir)
    except Exception as e:
        raise SetupError(f"no usable tokenizer in {sdir}: {str(e).splitlines()[0][:200]}") from None


def make_engine(cfg, comm, model, stage_root: Path, modes: list[str], stop_ids: set[int], dtype, device: str,
                drafter=None):
    """Rank 0's :class:`pipeline.engine.Engine` for ``modes``: with a drafter (``drafter``, else
    :func:`make_drafter`) unless every mode is ``ar``, and with ``sps`` among the modes its small LM
    (:func:`make_sps_drafter`). Each generation's own settings are an argument of
    :func:`pipeline.engine.timed_generation`, not part of the engine."""
    from pipeline.engine import Engine
    if drafter is None and any(m != "ar" for m in modes):
        drafter = make_drafter(cfg, stage_root, model, dtype, device)
    from pipeline.emulation import instrument_rank0
    engine = Engine(model, comm, drafter, stop_ids, cfg)
    instrument_rank0(engine, comm)   # the emulated testbed's meters when emu.profile is set
    if "sps" in modes:   # after instrumentation: the small LM is metered like the engine's own model work
        engine.sps_drafter = make_sps_drafter(cfg, drafter, model, dtype, engine.meter)
    return engine


def make_stage_worker(cfg, comm, model, dtype, device: str):
    """A verification stage's :class:`pipeline.worker.StageWorker`, with the emulated testbed's meter when
    ``emu.profile`` is set."""
    from pipeline.emulation import instrument_stage
    from pipeline.worker import StageWorker
    worker = StageWorker(model, comm, cfg.model.max_seq_len, dtype, device)
    worker.static = make_static_stage(cfg, model, device)
    instrument_stage(worker, comm)
    return worker


def make_static_stage(cfg, model, device: str):
    """The stage's forward on static shapes for ``model.graphs`` (:func:`model.graphs.static_stage`: CUDA graphs
    per bucket on a CUDA rank, the eager twin on a CPU one), or None (dynamic shapes)."""
    from config.run_config import parse_graph_buckets
    from model.graphs import resolve_executor, static_stage
    return static_stage(model, resolve_executor(cfg.model.graphs, device), parse_graph_buckets(cfg.model.graph_buckets))


def make_static_head(cfg, head, device: str):
    """The EAGLE-1/2 head's tree forward on static shapes for ``model.graphs`` (:mod:`draft.static_head`; buckets:
    the trees' beam widths and ``model.graph_buckets``), or None. None with ``osd.enabled`` too: online learning
    may replace the head's weights, which a recorded graph has baked in."""
    from config.run_config import parse_graph_buckets
    from draft.static_head import head_buckets, static_head
    from model.graphs import resolve_executor
    if cfg.osd.enabled:
        return None
    t = cfg.tree
    widths = (t.top_k, t.init_topk, t.expand_topk, t.pipedec_topk)
    return static_head(head, resolve_executor(cfg.model.graphs, device),
                       head_buckets(widths, parse_graph_buckets(cfg.model.graph_buckets)))


def make_sps_drafter(cfg, drafter, model, dtype, meter):
    """The small LM of mode ``sps``: ``sps.draft_dir`` (loaded here and metered with rank 0's ``meter``, like
    the engine's own model work), else ``drafter`` if it is one, else the small LM among a merged drafter's
    sources (``draft.sources=...,ssm:<dir>``). No small LM is a :class:`SetupError`."""
    from draft.merged import MergedDrafter
    from draft.ssm import SmallLMDrafter, SmallLMError
    if cfg.sps.draft_dir:
        if not (Path(cfg.sps.draft_dir) / "config.json").is_file():
            raise SetupError(f"sps.draft_dir={cfg.sps.draft_dir}: no config.json there (a Hugging Face causal LM)")
        try:
            ssm = SmallLMDrafter(cfg.sps.draft_dir, model.lm_head.out_features, dtype, model.lm_head.weight.device,
                                 vocab_model=model)
        except SmallLMError as e:
            raise SetupError(f"sps.draft_dir={cfg.sps.draft_dir}: {e}") from None
        from draft.protocol import install_meter
        install_meter(ssm, meter)
        return ssm
    if isinstance(drafter, SmallLMDrafter):
        return drafter
    if isinstance(drafter, MergedDrafter) and drafter.source(SmallLMDrafter) is not None:
        return drafter.source(SmallLMDrafter)
    raise SetupError("mode sps needs a small draft LM: sps.draft_dir=<dir> or draft.sources=ssm:<dir>")


UNTRAINED = "untrained"   # model.head_dir=untrained: a random head (seed 0), e.g. to learn from scratch with osd.*


def head_choice(cfg, stage_root: Path) -> Path | None:
    """The head folder ``make_drafter`` loads (None = untrained head); for provenance only."""
    if cfg.model.head_dir == UNTRAINED:
        return None
    if cfg.model.head_dir:
        return Path(cfg.model.head_dir)
    if stage_root.resolve() == DEFAULT_STAGE_DIR.resolve() and DEFAULT_HEAD_DIR.is_dir():
        return DEFAULT_HEAD_DIR
    return None


def make_drafter(cfg, stage_root: Path, model, dtype, device: str):
    """Rank 0's drafter: :func:`_head_drafter`, or with ``draft.sources`` several drafters merged into one tree
    (``draft/merged.py``; ``eagle`` there is the head drafter). With ``osd.enabled`` that drafter is wrapped in
    :class:`draft.osd.OnlineDrafter`, which learns its EAGLE head and small LMs from the served traffic (output
    unchanged)."""
    if not cfg.draft.sources:
        drafter = _head_drafter(cfg, stage_root, model, dtype, device)
    else:
        if cfg.model.draft_vocab > 0 and "eagle" not in [s.split(":")[0].strip() for s in cfg.draft.sources.split(",")]:
            raise SetupError(f"model.draft_vocab applies to the EAGLE head drafter, and draft.sources="
                             f"{cfg.draft.sources} has none (add eagle, or leave model.draft_vocab=0)")
        from draft.merged import SourceError, build_sources
        try:
            drafter = build_sources(cfg, model.lm_head.out_features,
                                    lambda: _head_drafter(cfg, stage_root, model, dtype, device), dtype, device,
                                    vocab_model=model)
        except SourceError as e:
            raise SetupError(str(e)) from None
    if cfg.draft.tree_shape != "eagle2":              # draft.tree_shape: every EAGLE-2 search of the drafter
        from draft.shape import TreeShape, install_shape
        install_shape(drafter, TreeShape.from_config(cfg.draft))
    return _online_drafter(cfg, drafter, model) if cfg.osd.enabled else drafter


def _online_drafter(cfg, inner, model):
    """``osd.enabled``: the drafter wrapped for online learning; the learners stop (and ``osd.save_dir`` is
    written) at exit."""
    import atexit

    from draft.osd import OnlineDrafter, OsdSettings, learnable_slots
    if not learnable_slots(inner):
        raise SetupError("osd.enabled needs a drafter it can learn: an EAGLE-1/2 head (model.head_dir) or a small "
                         "draft LM (draft.sources=...,ssm:<dir>); not a test drafter, lookup alone or EAGLE-3")
    od = OnlineDrafter(inner, model.lm_head, OsdSettings.from_config(cfg.osd))
    atexit.register(od.close)
    print(f"[rank 0] online speculative decoding of {', '.join(od.slots)}: loss={cfg.osd.loss} "
          f"sample_source={cfg.osd.sample_source} "
          f"update_interval={cfg.osd.update_interval} lr={cfg.osd.lr} "
          f"({'inline' if cfg.osd.sync else 'background thread'}, swap at {cfg.osd.swap_at})", file=sys.stderr)
    return od


def _head_drafter(cfg, stage_root: Path, model, dtype, device: str):
    """Rank 0's drafter for ``cfg.model.head_dir`` (the default head for the default split, a test drafter
    ``oracle[@noise]:``/``adversary:<full model dir>`` (:mod:`draft.oracle`), or, with no head at all or
    ``model.head_dir=untrained``, a clearly labelled untrained head)."""
    from draft.drafter import Drafter
    from draft.eagle import init_untrained_head
    from draft.head_io import HeadError
    from draft.load_head import load_draft_head
    from draft.oracle import OracleDrafter, parse_reference_drafter, reference_drafter_kind

    head_dir = head_choice(cfg, stage_root)
    try:
        if head_dir is not None and reference_drafter_kind(cfg.model.head_dir):
            try:
                kind, noise, path = parse_reference_drafter(cfg.model.head_dir)
            except ValueError as e:
                raise SetupError(str(e)) from None
            if cfg.model.draft_vocab > 0:
                raise SetupError("model.draft_vocab applies to EAGLE heads, not to the oracle/adversary test drafters")
            what = f"{kind} drafter" + (f" with Gumbel noise {noise:g}" if noise else "")
            print(f"[rank 0] using the {what} (full model {path}); for tests and ablations", file=sys.stderr)
            drafter = OracleDrafter(path, adversarial=(kind == "adversary"), dtype=dtype, device=device, noise=noise)
            _set_eagle_sampling(drafter, cfg)
            return drafter
        if head_dir is None:
            print(f"[rank 0] WARNING: {'model.head_dir=untrained' if cfg.model.head_dir else 'no draft head given'}: "
                  "using an UNTRAINED random head "
                  "(acceptance near zero; output stays exact). Set head_dir=... for real speed-ups.",
                  file=sys.stderr)
            head = init_untrained_head(model.config).to(device=device, dtype=dtype).eval()
            head.embed_tokens.weight.data.copy_(model.embed_tokens.weight.data)
        else:
            head = load_draft_head(head_dir, model.config, model.embed_tokens.weight.data, dtype, device)
        check_taps(head, getattr(model, "taps", []))
        from model.layers import set_lean
        set_lean(head, cfg.model.lean_layers)
        if cfg.model.draft_vocab > 0:   # before the counts are looked up: their error would be the wrong one
            from draft.vocab import require_shared_lm_head
            require_shared_lm_head(head)
        drafter = Drafter(head, model.lm_head, cfg.model.max_seq_len + 64,
                          draft_ids=_draft_ids(cfg, head_dir, model, head),
                          context_vocab=cfg.model.draft_vocab_context, full_root=cfg.model.draft_vocab_full_root)
        _set_eagle_sampling(drafter, cfg)
        drafter.static_head = make_static_head(cfg, head, device)
        return drafter
    except HeadError as e:
        raise SetupError(str(e)) from None


def _set_eagle_sampling(drafter, cfg) -> None:
    """``draft.eagle_sample``: the eagle source samples its trees at T > 0
    (:meth:`draft.drafter.BeamTreeDrafter.set_sampling`), its q its own law at the generation's temperature; set
    here for the run's ``gen`` settings, then per generation by its ``start`` (a
    :class:`draft.protocol.DraftSampling` argument)."""
    from draft.protocol import DraftSampling
    t = cfg.gen.temperature
    drafter.set_sampling(cfg.draft.eagle_sample, t if t > 0 else 1.0, cfg.gen.seed, cfg.draft.sample_chains)
    drafter.take_sampling(DraftSampling(t, cfg.gen.seed))


def _draft_ids(cfg, head_dir: Path | None, model, head):
    """``model.draft_vocab=N``: the N most frequent target ids (:mod:`draft.vocab`), ranked by
    ``model.draft_vocab_counts`` or the counts beside the head; None = the whole vocabulary. The default (auto,
    -1) is :func:`draft.vocab.resolve_draft_vocab`'s: 16384 for a head whose counts ship beside it."""
    from draft.head_io import HeadError
    from draft.vocab import counts_path, draft_vocab_ids, resolve_draft_vocab
    counts = counts_path(cfg.model.draft_vocab_counts, head_dir)
    found = bool(cfg.model.draft_vocab_counts) or (counts is not None and counts.is_file())  # a named file: its error
    from model.graphs import resolve_executor
    static = resolve_executor(cfg.model.graphs, model.lm_head.weight.device.type) is not None
    n = resolve_draft_vocab(cfg.model.draft_vocab, counts_found=found,
                            shares_lm_head=not hasattr(head, "draft_logits"), vocab_size=model.lm_head.out_features,
                            static_levels=static)
    if not n:
        return None
    if counts is None:
        raise HeadError("model.draft_vocab needs token counts: set model.draft_vocab_counts=<file> "
                        "(an untrained head has none beside it)")
    ids = draft_vocab_ids(n, counts, model.lm_head.out_features)
    if ids is not None:
        print(f"[rank 0] drafting over the {ids.numel()} most frequent of {model.lm_head.out_features} tokens"
              f"{' and the context' if cfg.model.draft_vocab_context else ''} (model.draft_vocab)", file=sys.stderr)
    return ids


def check_taps(head, taps: list[int]) -> None:
    """The stages must forward exactly the layers an EAGLE-3 head fuses, and nothing for other heads."""
    from draft.head_io import HeadError
    want = list(getattr(head, "aux_layers", []))
    if list(taps) != want:
        raise HeadError(f"the draft head needs the outputs of layers {want or 'none'} forwarded but the stages tap "
                        f"{list(taps) or 'none'}: set model.eagle3_taps={','.join(map(str, want)) or 'none'} "
                        "(the same on every rank)")
