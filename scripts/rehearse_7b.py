"""7B-scale rehearsal: a random-weight checkpoint with LLaMA-7B's shapes in Vicuna's layout, split, served by five
ranks, checked against HF generate on the unsplit checkpoint; peak memory and times reported.

What it does, one step after the other (never two big processes at once):

1. writes a random LLaMA checkpoint in the layout of ``lmsys/vicuna-7b-v1.3``: Vicuna's ``config.json`` (LLaMA-1:
   hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000), two ``.bin`` shards
   ``pytorch_model-0000{1,2}-of-00002.bin`` (the first ~74% of the bytes, as Vicuna's 9.98 + 3.50 GB) and
   ``pytorch_model.bin.index.json``, in bfloat16; and a random EAGLE-1 head in the layout of
   ``yuhuili/EAGLE-Vicuna-7B-v1.3`` (:func:`draft.head_layouts.write_eagle1`, ``vicuna``);
2. splits it 0+8+8+8+8 with ``split_and_save_models.py`` in its own process (peak RSS from ``wait4``);
3. loads each rank's stage alone in a fresh process (load time, RSS once loaded);
4. runs the five ranks (``pipeline.run``, one process each, traced) for a few tokens in ``ar``, ``naive`` and
   ``continuous`` (small trees: bf16 matrix products are slow on CPUs without bf16 instructions);
5. runs HF ``generate(do_sample=False)`` on the unsplit checkpoint in bfloat16, in its own process;
6. prints the goals (splitter peak <= largest shard + 1.5 GiB; each rank <= its weights + 1.5 GiB; every mode equal
   to HF) and writes ``summary.json``; exits 1 when a check fails.

``--layers N`` (and ``--hidden``/``--intermediate``/``--heads``/``--vocab``) makes a smaller variant of the same
layout for a quick check (``tests/test_rehearsal.py`` runs one). The full 7B needs about 30 GB of disk and, at
its peak (five ranks), about 15 GiB of memory: check ``free -g`` first.

Example::

    .venv/bin/python -m scripts.rehearse_7b --work /tmp/r7b                        # the real shapes (long)
    .venv/bin/python -m scripts.rehearse_7b --work /tmp/r7b_small --layers 2 --hidden 256 --intermediate 512 \\
        --heads 4 --vocab 1000 --tokens 4
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from config.paths import REPO
from pipeline.tools.ranks import child_env, free_port

GIB = 1 << 30
SLACK = int(1.5 * GIB)
VICUNA_CONFIG = {  # lmsys/vicuna-7b-v1.3 config.json (torch_dtype follows the tensors written here: bfloat16)
    "_name_or_path": "vicuna-7b-v1.3", "architectures": ["LlamaForCausalLM"], "bos_token_id": 1,
    "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 11008, "max_position_embeddings": 2048, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "pad_token_id": 0, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.28.1",
    "use_cache": True, "vocab_size": 32000}
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "transformers_version": "4.28.1"}
FIRST_SHARD_SHARE = 9.98 / 13.48      # Vicuna-7B's first shard holds this share of the bytes
SMALL_TREES = ["tree.total_token=6", "tree.depth=2", "tree.top_k=2", "tree.init_total_token=6", "tree.init_depth=2",
               "tree.subseq_token=3", "tree.expand_total_token=6", "tree.expand_depth=2", "tree.expand_topk=2"]


def log(msg: str) -> None:
    print(f"[rehearse {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# 1. The checkpoint and the head
# ---------------------------------------------------------------------------------------------------------------

def vicuna_config(layers: int, hidden: int, intermediate: int, heads: int, vocab: int) -> dict:
    cfg = dict(VICUNA_CONFIG)
    cfg.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=intermediate,
               num_attention_heads=heads, vocab_size=vocab)
    return cfg


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a LLaMA checkpoint in HF's order (the order its shards follow)."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (v, h))]
    for g in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{g}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (h, h)),
                (p + "self_attn.v_proj.weight", (h, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def shard_plan(specs, first_share: float = FIRST_SHARD_SHARE) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Two shards in order: the first takes tensors while it stays under ``first_share`` of the bytes."""
    total = sum(math.prod(s) for _, s in specs)
    first, second, acc = [], [], 0
    for name, shape in specs:
        n = math.prod(shape)
        if not second and acc + n <= first_share * total:
            first.append((name, shape))
            acc += n
        else:
            second.append((name, shape))
    if not second:
        second.append(first.pop())
    return [first, second]


def write_checkpoint(out: Path, cfg: dict, seed: int = 0) -> dict:
    """The random Vicuna-layout checkpoint (bf16); returns ``{"shards": {name: bytes}, "write_s"}``."""
    import torch
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    plan = shard_plan(tensor_specs(cfg))
    weight_map, sizes = {}, {}
    for k, shard in enumerate(plan, 1):
        fname = f"pytorch_model-{k:05d}-of-{len(plan):05d}.bin"
        state = {}
        for name, shape in shard:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                # lm_head wider than the layers so that greedy choices have margins a bf16 reassociation cannot flip
                std = 0.1 if name == "lm_head.weight" else cfg["initializer_range"]
                t = (torch.randn(shape, generator=g) * std).to(torch.bfloat16)
            state[name] = t
            weight_map[name] = fname
        torch.save(state, out / fname)
        sizes[fname] = (out / fname).stat().st_size
        del state
        log(f"wrote {fname} ({sizes[fname] / GIB:.2f} GiB)")
    total = sum(math.prod(s) * 2 for sh in plan for _, s in sh)
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    return {"shards": sizes, "write_s": time.perf_counter() - t0}


def write_head(out: Path, cfg: dict) -> int:
    from transformers import LlamaConfig

    from draft.head_layouts import write_eagle1
    write_eagle1(out, LlamaConfig(**{k: v for k, v in cfg.items() if not k.startswith("_")}), "vicuna", seed=1)
    return (out / "pytorch_model.bin").stat().st_size


# ---------------------------------------------------------------------------------------------------------------
# Measured child processes
# ---------------------------------------------------------------------------------------------------------------

def run_measured(cmd: list[str], env: dict | None = None, timeout: float = 7200) -> dict:
    """Run ``cmd`` in its own process; ``{"rc", "wall_s", "peak_rss", "stdout", "stderr"}`` (peak RSS in bytes: the
    child's own high-water mark, :func:`_communicate_wait4`)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=REPO, env=env or child_env(TOKENIZERS_PARALLELISM="false"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    out, err = _communicate_wait4(p, timeout)
    return {"rc": p.returncode, "wall_s": time.perf_counter() - t0, "peak_rss": p.peak_rss, "stdout": out,
            "stderr": err}


def _vm(field: str, pid: int | str = "self") -> int:
    """A memory field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``) in bytes (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _communicate_wait4(p: subprocess.Popen, timeout: float):
    """Read the pipes to the end and sample the child's ``VmHWM`` (its resident high-water mark) until it exits.

    Why not ``wait4``'s ``ru_maxrss``: Linux carries a parent's high-water mark into a forked child and keeps it
    across ``exec``, so a child of this script (which held a 9 GiB shard while writing the checkpoint) would
    report at least that. ``VmHWM`` belongs to the child's own address space, made by ``exec``; it only grows,
    so its last sample is the peak unless the peak came in the last 0.1 s before exit."""
    import threading
    bufs = {"out": [], "err": []}
    readers = [threading.Thread(target=lambda s=s, k=k: bufs[k].append(s.read()), daemon=True)
               for s, k in ((p.stdout, "out"), (p.stderr, "err"))]
    for r in readers:
        r.start()
    deadline = time.time() + timeout
    peak = 0
    while True:
        peak = max(peak, _vm("VmHWM", p.pid))
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid:
            break
        if time.time() > deadline:
            p.kill()
            pid, status, ru = os.wait4(p.pid, 0)
            break
        time.sleep(0.1)
    p.returncode = os.waitstatus_to_exitcode(status)
    p.peak_rss = peak
    for r in readers:
        r.join()
    return "".join(bufs["out"]), "".join(bufs["err"])


# ---------------------------------------------------------------------------------------------------------------
# Probes run in child processes (``--probe-load`` / ``--probe-hf``)
# ---------------------------------------------------------------------------------------------------------------

def probe_load(root: str, rank: int, world: int) -> None:
    import torch

    from model.stage_model import load_stage
    t0 = time.perf_counter()
    model = load_stage(root, rank, world, torch.bfloat16)
    dt = time.perf_counter() - t0
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    out = {"rank": rank, "load_s": dt, "rss": _vm("VmRSS"), "hwm": _vm("VmHWM"), "param_bytes": n}
    head = Path(root).parent / "eagle_head"
    if rank == 0 and head.is_dir():      # rank 0 also loads the draft head, as pipeline.run does
        from draft.load_head import load_draft_head
        t0 = time.perf_counter()
        h = load_draft_head(head, model.config, model.embed_tokens.weight.data, torch.bfloat16)
        out.update(head_load_s=time.perf_counter() - t0, rss=_vm("VmRSS"), hwm=_vm("VmHWM"),
                   head_param_bytes=sum(p.numel() * p.element_size() for p in h.parameters()))
    print(json.dumps(out))


def probe_hf(ckpt: str, prompt: list[int], tokens: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).eval()
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=tokens, eos_token_id=[2], pad_token_id=0)
    print(json.dumps({"output_ids": out[0, len(prompt):].tolist(), "load_s": load_s,
                      "generate_s": time.perf_counter() - t0, "hwm": _vm("VmHWM")}))


# ---------------------------------------------------------------------------------------------------------------
# The rehearsal
# ---------------------------------------------------------------------------------------------------------------

def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_for_memory(need: int, what: str, patience_s: float) -> bool:
    """Wait up to ``patience_s`` for ``need`` bytes of MemAvailable (the machine is shared); False if it never
    comes (the caller stops rather than push others' processes into the OOM killer)."""
    deadline = time.time() + patience_s
    while True:
        have = mem_available()
        if have >= need:
            return True
        if time.time() > deadline:
            log(f"not enough free memory for {what}: {have / GIB:.1f} GiB available, {need / GIB:.1f} GiB needed")
            return False
        log(f"waiting for memory for {what}: {have / GIB:.1f} of {need / GIB:.1f} GiB available")
        time.sleep(30)


def stage_bytes(root: Path) -> dict[int, int]:
    man = json.loads((root / "manifest.json").read_text())
    return {int(k.split("/")[0].rsplit("_", 1)[1]): v["bytes"] for k, v in man["files"].items()}


def run_ranks(root: Path, head: Path, world: int, prompt: list[int], tokens: int, modes: str, out: Path,
              trace_dir: Path, extra: list[str]) -> list[dict]:
    """The ``world`` ranks of ``pipeline.run``, one process each; per rank ``{rc, wall_s, peak_rss, stderr}``."""
    port = free_port()
    args = [sys.executable, "-m", "pipeline.run", f"model.stage_dir={root}", "dtype=bfloat16", f"head_dir={head}",
            f"max_new_tokens={tokens}", "comm.timeout_s=3600", "comm.trace=true", f"comm.trace_dir={trace_dir}",
            "--modes", modes, "--output", str(out), "--quiet", "--prompt-ids", ",".join(map(str, prompt)), *extra]
    import threading
    results: list[dict | None] = [None] * world

    def one(r: int) -> None:
        env = child_env(TOKENIZERS_PARALLELISM="false", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                        WORLD_SIZE=str(world), LOCAL_RANK=str(r))
        results[r] = run_measured(args, env)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def step_times(trace_dir: Path, world: int) -> dict[int, dict]:
    """Per layer rank: the stage forwards (``compute`` spans) of the run, their count and median / max seconds."""
    out = {}
    for r in range(1, world):
        p = trace_dir / f"trace_rank{r}.json"
        if not p.is_file():
            continue
        spans = [e["end"] - e["start"] for e in json.loads(p.read_text())["events"] if e["name"] == "compute"]
        if spans:
            out[r] = {"forwards": len(spans), "median_s": statistics.median(spans), "max_s": max(spans),
                      "min_s": min(spans)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.rehearse_7b", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: .venv/bin/python -m scripts.rehearse_7b --work /tmp/r7b_small --layers 2 --hidden 256 "
               "--intermediate 512 --heads 4 --vocab 1000   (the full 7B: --work /tmp/r7b, about 30 GB of disk)")
    ap.add_argument("--work", required=True, help="scratch directory (checkpoint, head, stages, traces, summary)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (default 32, LLaMA-7B)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--stages", type=int, default=4, help="layer stages (default 4: 0+8+8+8+8 for 32 layers)")
    ap.add_argument("--tokens", type=int, default=4, help="new tokens per mode (default 4)")
    ap.add_argument("--modes", default="ar,naive,continuous")
    ap.add_argument("--prompt-ids", default=None,
                    help="comma-separated prompt token ids (default: 8 ids, 1,319,13563,1546,263,12758,5199,322 folded "
                         "into the vocabulary)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and stages (default: delete at the end)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the checkpoint and head already in --work (same shape), skipping step 1")
    ap.add_argument("--memory-patience", type=float, default=600,
                    help="seconds to wait for enough MemAvailable before the ranks / HF phases (default 600; then "
                         "exit 3 without running them)")
    ap.add_argument("--no-load-probe", action="store_true",
                    help="skip step 3 (each rank's stage loaded alone: load time, RSS once loaded)")
    ap.add_argument("--probe-load", nargs=3, metavar=("ROOT", "RANK", "WORLD"), help=argparse.SUPPRESS)
    ap.add_argument("--probe-hf", nargs=3, metavar=("CKPT", "PROMPT", "TOKENS"), help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="extra pipeline.run overrides (default: small trees)")
    args = ap.parse_args(argv)
    if args.probe_load:
        probe_load(args.probe_load[0], int(args.probe_load[1]), int(args.probe_load[2]))
        return 0
    if args.probe_hf:
        probe_hf(args.probe_hf[0], [int(x) for x in args.probe_hf[1].split(",")], int(args.probe_hf[2]))
        return 0

    from model.stage_format import even_split
    if args.layers < args.stages:
        args.stages = args.layers
    split = even_split(args.layers, args.stages)
    world = len(split)
    if args.prompt_ids is None:
        prompt = [1] + [3 + x % (args.vocab - 3) for x in (319, 13563, 1546, 263, 12758, 5199, 322)]
    else:
        prompt = [int(x) for x in args.prompt_ids.split(",")]
    if max(prompt) >= args.vocab or min(prompt) < 0:
        ap.error(f"--prompt-ids has ids >= --vocab {args.vocab}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt, head, stages, traces = work / "vicuna", work / "eagle_head", work / "stages", work / "traces"
    summary: dict = {"shape": {"layers": args.layers, "hidden": args.hidden, "intermediate": args.intermediate,
                               "heads": args.heads, "vocab": args.vocab}, "split": "+".join(map(str, split)),
                     "tokens": args.tokens, "prompt": prompt, "host": socket.gethostname(),
                     "cpus": os.cpu_count()}
    checks: list[tuple[str, bool, str]] = []

    cfg = vicuna_config(args.layers, args.hidden, args.intermediate, args.heads, args.vocab)
    index = ckpt / "pytorch_model.bin.index.json"
    if args.reuse and index.is_file() and json.loads((ckpt / "config.json").read_text()) == cfg \
            and (head / "pytorch_model.bin").is_file():
        log(f"reusing the checkpoint and head in {work}")
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        summary["checkpoint"] = {"shards": {n: (ckpt / n).stat().st_size for n in names}, "write_s": float("nan")}
        summary["head_bytes"] = (head / "pytorch_model.bin").stat().st_size
    else:
        log(f"writing a random {args.layers}-layer, hidden {args.hidden} checkpoint in Vicuna's layout to {ckpt}")
        summary["checkpoint"] = write_checkpoint(ckpt, cfg)
        summary["head_bytes"] = write_head(head, cfg)
    largest = max(summary["checkpoint"]["shards"].values())

    partial = work / "partial.json"     # the measured phases so far (a rerun with --reuse picks them up)
    before = json.loads(partial.read_text()) if args.reuse and partial.is_file() else {}
    if before.get("split") == summary["split"] and "split_run" in before and (stages / "manifest.json").is_file():
        log(f"reusing the split in {stages} (measured before)")
        summary["split_run"] = before["split_run"]
        sp = {"peak_rss": before["split_run"]["peak_rss"]}
    else:
        log(f"splitting {summary['split']}")
        sp = run_measured([sys.executable, "split_and_save_models.py", "--model", str(ckpt), "--split",
                           summary["split"], "--out", str(stages), "--force", "--no-progress"])
        if sp["rc"]:
            print(sp["stderr"][-3000:], file=sys.stderr)
            return 1
        summary["split_run"] = {"wall_s": sp["wall_s"], "peak_rss": sp["peak_rss"], "largest_shard": largest}
        log(f"split in {sp['wall_s']:.0f} s, peak RSS {sp['peak_rss'] / GIB:.2f} GiB")
        partial.write_text(json.dumps(summary, indent=2))
    checks.append(("splitter peak RSS <= largest shard + 1.5 GiB", sp["peak_rss"] <= largest + SLACK,
                   f"{sp['peak_rss'] / GIB:.2f} GiB vs {largest / GIB:.2f} + 1.5 GiB"))
    sbytes = stage_bytes(stages)

    loads = {int(k): v for k, v in before.get("load", {}).items()} if before.get("split") == summary["split"] else {}
    for r in [r for r in range(0 if args.no_load_probe else world) if r not in loads]:
        pr = run_measured([sys.executable, "-m", "scripts.rehearse_7b", "--work", str(work), "--probe-load",
                           str(stages), str(r), str(world)])
        if pr["rc"]:
            print(pr["stderr"][-3000:], file=sys.stderr)
            return 1
        loads[r] = json.loads(pr["stdout"].strip().splitlines()[-1])
        loads[r]["peak_rss"] = pr["peak_rss"]
        log(f"rank {r}: loaded {sbytes[r] / GIB:.2f} GiB in {loads[r]['load_s']:.1f} s, RSS {loads[r]['rss'] / GIB:.2f} "
            f"GiB, peak {pr['peak_rss'] / GIB:.2f} GiB")
    summary["load"] = loads
    partial.write_text(json.dumps(summary, indent=2))

    need = sum(sbytes.values()) + summary["head_bytes"] + world * GIB // 2 + GIB
    if not wait_for_memory(need, f"{world} ranks", args.memory_patience):
        return 3
    log(f"running {world} ranks: {args.modes}, {args.tokens} tokens")
    out = work / "rows.jsonl"
    out.unlink(missing_ok=True)
    shutil.rmtree(traces, ignore_errors=True)
    t0 = time.perf_counter()
    ranks = run_ranks(stages, head, world, prompt, args.tokens, args.modes, out, traces,
                      args.overrides or SMALL_TREES)
    summary["run_wall_s"] = time.perf_counter() - t0
    if any(r["rc"] for r in ranks):
        for i, r in enumerate(ranks):
            if r["rc"]:
                print(f"rank {i} exited {r['rc']}: {r['stderr'][-2000:]}", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    summary["ranks"] = {}
    for r, res in enumerate(ranks):
        budget = sbytes[r] + (summary["head_bytes"] if r == 0 else 0)
        summary["ranks"][r] = {"peak_rss": res["peak_rss"], "stage_bytes": sbytes[r], "budget": budget + SLACK}
        checks.append((f"rank {r} peak RSS <= its weights{' + head' if r == 0 else ''} + 1.5 GiB",
                       res["peak_rss"] <= budget + SLACK,
                       f"{res['peak_rss'] / GIB:.2f} GiB vs {budget / GIB:.2f} + 1.5 GiB"))
    summary["step_times"] = step_times(traces, world)
    summary["rows"] = [{k: row.get(k) for k in ("mode", "output_ids", "tau", "decode_s", "prefill_s",
                                                  "tokens_per_s", "rounds")} for row in rows]

    if not wait_for_memory(sum(sbytes.values()) + GIB, "HF generate", args.memory_patience):
        return 3
    log("HF generate on the unsplit checkpoint (bfloat16)")
    hf = run_measured([sys.executable, "-m", "scripts.rehearse_7b", "--work", str(work), "--probe-hf", str(ckpt),
                       ",".join(map(str, prompt)), str(args.tokens)])
    if hf["rc"]:
        print(hf["stderr"][-3000:], file=sys.stderr)
        return 1
    ref = json.loads(hf["stdout"].strip().splitlines()[-1])
    ref["peak_rss"] = hf["peak_rss"]
    summary["hf"] = ref
    for row in rows:
        checks.append((f"{row['mode']} equals HF generate", row["output_ids"] == ref["output_ids"],
                       f"{row['output_ids']} vs {ref['output_ids']}"))
    if not rows:
        checks.append(("rows written", False, "no output rows"))

    summary["checks"] = [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks]
    (work / "summary.json").write_text(json.dumps(summary, indent=2))
    print(report(summary))
    if not args.keep:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(stages, ignore_errors=True)
        shutil.rmtree(head, ignore_errors=True)
    return 0 if all(ok for _, ok, _ in checks) else 1


def report(s: dict) -> str:
    """A markdown report of a summary (``summary.json``)."""
    lines = [f"shape {s['shape']}, split {s['split']}, {s['tokens']} new tokens, prompt of {len(s['prompt'])} ids, "
             f"host {s['host']} ({s['cpus']} CPUs)", "",
             f"checkpoint written in {s['checkpoint']['write_s']:.0f} s: " + ", ".join(
                 f"{k} {v / GIB:.2f} GiB" for k, v in s["checkpoint"]["shards"].items()),
             f"splitter: {s['split_run']['wall_s']:.0f} s, peak RSS {s['split_run']['peak_rss'] / GIB:.2f} GiB "
             f"(largest shard {s['split_run']['largest_shard'] / GIB:.2f} GiB)", "",
             "| rank | stage weights GiB | load s (alone) | RSS after load GiB | peak RSS in the run GiB | "
             "stage forwards | median s | max s |", "|---|---|---|---|---|---|---|---|"]
    for r, info in s["ranks"].items():
        ld = s["load"].get(int(r)) or s["load"].get(str(r)) or {"load_s": float("nan"), "rss": float("nan")}
        st = s["step_times"].get(int(r)) or s["step_times"].get(str(r)) or {}
        lines.append(f"| {r} | {info['stage_bytes'] / GIB:.2f} | {ld['load_s']:.1f} | {ld['rss'] / GIB:.2f} | "
                     f"{info['peak_rss'] / GIB:.2f} | {st.get('forwards', '-')} | "
                     f"{st.get('median_s', float('nan')):.2f} | {st.get('max_s', float('nan')):.2f} |")
    lines += ["", f"five-rank run wall {s['run_wall_s']:.0f} s; HF: load {s['hf']['load_s']:.0f} s, generate "
                  f"{s['hf']['generate_s']:.0f} s, peak RSS {s['hf']['peak_rss'] / GIB:.2f} GiB", "",
              "| mode | output ids | tau | prefill s | decode s |", "|---|---|---|---|---|"]
    for row in s["rows"]:
        lines.append(f"| {row['mode']} | {row['output_ids']} | {row['tau']:.2f} | {row['prefill_s']:.1f} | "
                     f"{row['decode_s']:.1f} |")
    lines += ["", f"HF generate: {s['hf']['output_ids']}", ""]
    lines += [f"- [{'x' if c['ok'] else ' '}] {c['check']}: {c['detail']}" for c in s["checks"]]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
