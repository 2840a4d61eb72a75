"""Test helpers: tiny checkpoints, HF reference decoding, and a local multi-process launcher."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from config.paths import DATASETS  # noqa: F401  (re-exported for the tests)
from pipeline.tools.ranks import free_port  # noqa: F401  (re-exported for the tests)

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"
DATA = SHARED / "data"


def tiny_llama(path: Path, seed: int = 0, layers: int = 4, vocab: int = 96, hidden: int = 64,
               tie: bool = False, dtype=torch.float32) -> Path:
    """A random LLaMA with GQA saved with save_pretrained, plus a copied tokenizer-less config."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(dtype)
    # sharper random logits so that greedy choices are stable
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def launch(world: int, args: list[str], timeout: float = 300, env: dict | None = None,
           check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python -m pipeline.run`` on ``world`` local CPU ranks (what torchrun does, minus the agent)."""
    port = free_port()
    procs = []
    for r in range(world):
        e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                 LOCAL_RANK=str(r), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **(env or {}))
        procs.append(subprocess.Popen([sys.executable, "-m", "pipeline.run", *args], cwd=REPO, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            o, er = p.communicate(timeout=timeout)
            outs.append((p.returncode, o, er))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = subprocess.CompletedProcess(args, outs[0][0], outs[0][1], "".join(o[2] for o in outs))
    res.codes = [o[0] for o in outs]
    if check and any(res.codes):
        raise AssertionError(f"ranks exited {res.codes}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-5000:]}")
    return res


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int, stop_ids, dtype=torch.float32) -> list[int]:
    from transformers import AutoModelForCausalLM
    model = _hf_cache.get((str(model_dir), dtype))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        _hf_cache[(str(model_dir), dtype)] = model
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(stop_ids),
                             pad_token_id=sorted(stop_ids)[0])
    return out[0, len(prompt_ids):].tolist()


_hf_cache: dict = {}


def step2_batch(tokens, pred):
    """Inputs that check the head's second drafting step under teacher forcing.

    Rows ``[context entries e_0..e_{N-1}; draft entries d_0..d_{N-1}]`` where ``d_t`` pairs ``token[t+1]``
    with the head's *own* prediction ``pred[t-1]`` of ``f_t`` and sees ``e_0..e_{t-1}`` and itself (as a
    tree node does at inference). Returns ``(tokens2, positions, attn_mask, d_features)``.
    """
    b, n = tokens.shape
    dev = tokens.device
    i = torch.arange(n, device=dev)
    causal = i[:, None] >= i[None, :]
    strict = i[:, None] > i[None, :]
    top = torch.cat([causal, torch.zeros(n, n, dtype=torch.bool, device=dev)], 1)
    bottom = torch.cat([strict, torch.eye(n, dtype=torch.bool, device=dev)], 1)
    mask = torch.cat([top, bottom], 0)[None, None].expand(b, 1, 2 * n, 2 * n)
    pos = torch.cat([i, i])[None].expand(b, 2 * n)
    dfeat = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], 1)
    return torch.cat([tokens, tokens], 1), pos, mask, dfeat
