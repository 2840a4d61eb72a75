"""``sps``: speculative sampling with a separate small draft LM (Leviathan et al. 2023; Chen et al. 2023).

Each round rank 0 drafts a chain of ``sps.gamma`` tokens with the small LM (:class:`draft.ssm.SmallLMDrafter`):
greedy at T = 0, else each token drawn from the LM's distribution q_i (softmax of its logits at the draft
temperature). The chain goes through the ring like a ``naive`` tree (a chain is a tree whose parents are
``-1, 0, 1, ...``), but as **one** segment, as the papers verify the gamma + 1 positions in one target forward:
a stage's step costs about the same for 1 or gamma + 1 rows at batch 1 (weights streamed once), so cutting the
chain into one segment per link, as ``naive`` cuts its 60-node trees, would only add stage steps. The accepted
path is committed on every stage by the decision riding on the next round's segment. The target's
distributions p_1..p_{gamma+1} at the root and after each draft token come back in one trip.

Verification (:func:`verify_chain`), with the processed target law p (temperature, top-k, top-p as HF):
  * ``google`` (Leviathan et al., Algorithm 1): draw the gamma uniforms up front, r_i ~ U(0, 1), and
    compare each with min(1, p_i(x_i) / q_i(x_i)); n = the number of leading accepted tokens;
  * ``deepmind`` (Chen et al., Algorithm 2): walk the chain and draw coin i only while all before it
    were accepted; stop at the first rejection.
Then, if n < gamma, the next token is drawn from norm(max(0, p_{n+1} - q_{n+1})), else from p_{gamma+1}, by
``Sampler.pick`` (the tree modes' two-level race: the same law, robust to the logits' rounding noise as the
one-sample ``multinomial`` it replaced, itself a race over the whole vocabulary, and 20x cheaper per draw at
V = 49152: docs/results.md §101, §102).
Both variants accept the same prefix with the same probabilities (coins after the first rejection are never
read), so their laws are identical and equal to the target's (the one-step lemma in
``pipeline.verify.walk_proposals``: P(accept, x = y) + P(reject) * residual(y) = min(q, p)(y) + max(0, p - q)(y)
= p(y)); they differ only in how much randomness a round consumes, so the same seed gives different samples.
At T = 0 both accept while the target's argmax equals the draft token, then take the argmax: greedy-exact.
"""
from __future__ import annotations

import torch

from draft.tree import DraftTree
from model.devices import HOST
from pipeline.engine import DecodeResult, Engine, OutputBuffer
from pipeline.modes.naive import whole_tree_rounds
from pipeline.verify import Sampler


@torch.no_grad()
def draft_chain(ssm, root: int, root_hidden: torch.Tensor, gamma: int, greedy: bool, temperature: float
                ) -> tuple[DraftTree, list[torch.Tensor]]:
    """A chain of ``gamma`` draft tokens below ``root`` and, when sampled, the law q_i each was drawn from
    (``[]`` when greedy). The drafter's committed state is unchanged (its tree entries are dropped)."""
    tokens, qs, hidden = [root], [], root_hidden
    for i in range(gamma):
        lp = ssm.logprobs(hidden)
        if greedy:
            x = int(torch.argmax(lp))
        else:
            q = torch.softmax(lp / temperature, dim=-1)
            x = ssm.draw(q)
            qs.append(q)
        tokens.append(x)
        if i + 1 < gamma:
            hidden = ssm.tree_forward(torch.tensor([x], device=HOST), hidden[None], torch.tensor([i - 1], device=HOST))[0]
    ssm.drop_tree()
    n = len(tokens)
    tree = DraftTree(torch.tensor(tokens, device=HOST), torch.arange(-1, n - 1, device=HOST), torch.zeros(n, device=HOST))
    return tree, qs


def verify_chain(tokens: list[int], qs: list[torch.Tensor], logits: torch.Tensor, sampler: Sampler,
                 variant: str) -> tuple[int, int]:
    """``(n_accepted, next_token)`` for the chain ``tokens = [root, x_1..x_gamma]`` (module docstring);
    ``logits[i]``: target logits after ``tokens[:i + 1]``."""
    gamma = len(tokens) - 1
    if sampler.greedy:
        n = 0
        while n < gamma and int(torch.argmax(logits[n])) == tokens[n + 1]:
            n += 1
        return n, int(torch.argmax(logits[n]))
    ps = [sampler.probs(logits[i]) for i in range(gamma + 1)]

    def ratio(i: int) -> float:
        x = tokens[i + 1]
        p, q = ps[i], qs[i]
        return min(1.0, float(p[x] / p.sum()) / float(q[x])) if float(q[x]) > 0 else 0.0

    if variant == "google":      # r_1..r_gamma ~ U(0, 1) up front; n = leading r_i < min(1, p_i / q_i)
        coins = [sampler.uniform() for _ in range(gamma)]
        n = next((i for i in range(gamma) if not coins[i] < ratio(i)), gamma)
    elif variant == "deepmind":
        n = 0
        while n < gamma and sampler.accept(ratio(n)):
            n += 1
    else:
        raise ValueError(f"unknown sps variant {variant!r}")
    if n == gamma:
        return n, sampler.pick(ps[gamma])
    p = ps[n] / ps[n].sum()
    res = torch.clamp(p - qs[n].to(p.dtype), min=0.0)
    return n, sampler.pick(res if float(res.sum()) > 0 else p)   # p = q exactly: unreachable


def sps_decode(engine: Engine, logits: torch.Tensor, features: torch.Tensor, prompt_ids: list[int],
               out: OutputBuffer) -> DecodeResult:
    cfg, sampler = engine.cfg, out.sampler
    ssm = engine.sps_drafter   # pipeline.build.make_sps_drafter: built with the engine
    if ssm is None:
        raise RuntimeError("mode sps on an engine built without its small LM (pipeline.build.make_engine builds it "
                           "when sps is among the modes)")
    temp = sampler.temperature if cfg.draft.ssm_temperature < 0 else cfg.draft.ssm_temperature

    def draft(root: int, root_hidden: torch.Tensor):
        return draft_chain(ssm, root, root_hidden, cfg.sps.gamma, sampler.greedy, temp)

    def verify(chain: DraftTree, qs, tlogits: torch.Tensor) -> tuple[list[int], int]:
        n, x = verify_chain(chain.tokens.tolist(), qs, tlogits, sampler, cfg.sps.variant)
        return list(range(n + 1)), x

    return whole_tree_rounds(engine, logits, features, prompt_ids, out, ssm, draft, verify, lambda n: [n])
