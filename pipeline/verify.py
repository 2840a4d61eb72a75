"""Target-side token choice and tree verification on rank 0 (greedy and lossless sampling).

``walk_tree`` verifies the prefix ``[0, n_verified)`` of a tree whose target logits are known. Node
indices are ancestors-first, so a verified node's ancestors are verified too.

Sampling rule (a deterministic draft, q = 1; "Draw first"): at a verified node with processed target
distribution p, draw the node's token x from p (one ``Sampler.pick``: a fixed number of uniforms); descend into
the child that carries x if the node has one (siblings are distinct tokens), else x ends the walk. This is the EAGLE-2 /
SpecInfer multi-candidate rule for q = 1 (try the children in order, accept child c with p'(c), p' being p
with the rejected siblings zeroed and renormalised, else draw from the residual) in another coupling:
P(accept c_j) = prod_{i<j}(1 - p_{i-1}'(c_i)) * p_{j-1}'(c_j) telescopes to p(c_j) and the residual gives
every other token p(x), so both commit a token of law exactly p and accept child c with probability p(c).

Why draw first (issue 46, docs/results.md §54): the sequential rule spends one uniform per
tried child, so the generator's stream, hence a seeded answer, depended on how many children a node had
when it was verified, and with continuous expansion that depends on the pipeline's schedule (a node
verified one step later may have gained a child; a lane's share of the ring, ``serve.ring_share``, changes
the segments and so the steps). Measured: seed 12 of tests/test_prefill_share.py at ``ring_share=0.5``, the
last token's node had no child on two lanes (residual draw: 294) and one child (422, p = 0.984, accepted)
alone. Drawing first spends exactly one draw per committed token whatever the tree, so a seeded answer is a
function of the prompt, the seed and the target's logits only: the same on any schedule, lane count or tree
shape. The logits themselves round differently with the rows a stage segment holds, which follow the schedule;
the draw is an exponential race (``Sampler.pick``), which such rounding noise almost never flips (an inverse CDF
flipped about 1% of picks: ``Sampler.pick``'s docstring). ``ar`` draws with ``multinomial`` for HF parity:
another stream (a one-sample ``multinomial`` is a race over the whole vocabulary, as robust and 20x dearer at
V = 49152: docs/results.md §102). Each node resolves exactly one token
with fresh randomness, so the path's joint law is the target's autoregressive law, *provided the child
list of a node is a function of what was decided before the node's draw* (it may depend on earlier draws,
the draft and the pipeline's timing, but not on this node's draw).

Exactness under pipelining (pruned / continuous / pipedec), i.e. why that proviso holds:
  * a node is *resolved* (its draws consumed) only inside ``walk_tree`` and only once its logits are
    known (index < ``n_verified``); ``walk_tree`` reads the child list once, before the node's first
    draw, and resolves each node at most once per call;
  * every call ends with the resolved nodes leaving the tree: TRUNCATE starts a fresh tree from the
    new token, CONTINUE re-roots at ``new_root`` (``keep_indices_for`` + ``reroot``), and the new root
    and all its descendants have index >= ``n_verified`` (``parents[i] < i``), so nothing left in the
    tree has been resolved and no node is ever resolved twice;
  * dynamic expansion (``merge_trees`` of a tree drafted from the current root) and PipeDec's layer
    growth (below the deepest surviving layer) only attach nodes to that unresolved tree, i.e. below
    unresolved nodes; appended children get larger indices, so index order is stable and is the order
    fixed at the moment the node is walked;
  * siblings are distinct tokens (``tests.helpers.check_tree``; ``merge_trees`` dedups by (parent, token)).
``tests/test_sampling.py`` checks the resulting law exactly (by enumerating every random branch of the real
modes) and statistically (chi-square with the real generator).

Trees whose children were *sampled* (a small LM at T > 0, several drafters merged, ``DraftTree.proposals``)
are verified by :func:`walk_proposals` (SpecInfer's multi-step speculative sampling; its own exactness
argument is in its docstring); ``walk_tree`` hands them over and is unchanged for deterministic trees.

``Sampler.probs`` reproduces HF ``generate`` bit for bit (float32 logits, temperature, top-k, top-p,
softmax), and ``draw`` feeds the same float32 tensor to ``torch.multinomial``, so with a generator seeded
like HF's global RNG, ``ar`` at T > 0 emits exactly HF's ``generate(do_sample=True)`` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draft.race import seeded_pick, uniforms
from draft.tree import DraftTree

Tensor = torch.Tensor


@dataclass
class Sampler:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: Tensor) -> Tensor:
        """Processed distribution exactly as HF generate computes it (its warpers, order and float32
        arithmetic): temperature, then top-k, then top-p, softmax. Returned widened to float64 (exact),
        so ``walk_tree``'s renormalisations lose nothing and ``draw`` narrows back to HF's very tensor."""
        x = logits.float()
        if self.temperature != 1.0:
            x = x / self.temperature
        if self.top_k > 0:
            kth = torch.topk(x, min(self.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_x, idx = torch.sort(x, descending=False)
            cum = sorted_x.softmax(-1).cumsum(-1)
            remove = cum <= (1 - self.top_p)
            remove[-1] = False
            x = x.masked_fill(remove.scatter(0, idx, remove), float("-inf"))
        return torch.softmax(x, dim=-1).double()

    def uniform(self) -> float:
        """One fresh uniform in [0, 1) (:meth:`accept`'s coin): :func:`draft.race.uniforms`' rule, the same stream as
        the ``torch.rand((), ...)`` it replaced (checked value by value in tests/test_seeded_draws.py)."""
        return float(uniforms(self.generator, 1)[0])

    def accept(self, prob: float) -> bool:
        """One Bernoulli(prob) draw (``walk_proposals``, ``sps``; ``walk_tree`` spends randomness through ``pick``)."""
        return self.uniform() < prob

    def draw(self, p: Tensor) -> int:
        return int(torch.multinomial(p.float(), 1, generator=self.generator))

    def pick(self, p: Tensor) -> int:
        """One token of law ``p / p.sum()`` from a fixed number of uniforms of its generator
        (:func:`draft.race.pick_draws`: about ``2 sqrt(V)``, 444 at V = 49152): ``walk_tree``'s draw ("Draw
        first"), the same amount of randomness per resolved node whatever the node's children. The rule, a
        two-level exponential race (:func:`draft.race.seeded_pick`):
        the vocabulary in fixed blocks of ``ceil(sqrt(V))`` token ids, a block ``b`` with probability ``P_b / P``
        (``P_b`` its mass), then a token ``i`` of it with probability ``p_i / P_b``: exactly ``p_i / P``. A
        token without mass is never picked.

        Why a race and not the inverse CDF of one uniform (this method's rule until 2026-11-30): a seeded answer
        should be the same on every run, and the target's logits are not bit-identical across runs in the
        pipelined modes: a node's row is computed in a stage segment whose rows follow the schedule, and a matmul
        over another number of rows rounds differently (SmolLM2 in float32 on a CPU: probabilities differing by
        up to 1.7e-5 relative, in 134 of 141 picks of one ``continuous`` run). Under the inverse CDF such noise moves
        every boundary of the cumulative sum, and where the uniform falls in the long tail (token boundaries about
        1e-6 apart) the token flips: 0.9% of picks at 1e-5 relative noise; three prompts of 48 tokens at T = 1,
        rerun five times in ``pruned`` and ``continuous``, gave 3 of 15 answers that differed from the first
        run's. A race flips only when its two best entries are within the
        noise of each other: 0 of 3,000 picks at 1e-5 (docs/results.md §101; tests/test_seeded_draws.py). Its cost
        is the inverse CDF's (one pass over ``p`` and a few hundred uniforms: 0.05 ms at V = 49152 on this CPU) and
        one device->host read, the token."""
        return seeded_pick(p, self.generator)

    def choose(self, logits: Tensor) -> int:
        return int(torch.argmax(logits)) if self.greedy else self.draw(self.probs(logits))


def walk_tree(tree: DraftTree, n_verified: int, logits: Tensor, sampler: Sampler) -> tuple[list[int], int | None, int | None]:
    """Verify as far as the known logits allow.

    Returns ``(accepted_path, new_token, new_root)``:
      * ``accepted_path``: node indices from the root, all verified (empty when the root is not);
      * ``new_token``: the target's token after the path (``None`` when the root is not verified);
      * ``new_root``: an existing, not yet verified child carrying ``new_token`` (the tree continues),
        else ``None`` (truncate: the round ends and a fresh tree starts from ``new_token``).

    Every node on the path (root included) is resolved here, once; the caller must drop them from the tree
    (truncate or re-root at ``new_root``) before growing it further. See the module docstring.
    """
    if tree.proposals is not None:    # sampled drafts (several sources, sps): SpecInfer's rule
        return walk_proposals(tree, n_verified, logits, sampler)
    if n_verified <= 0:
        return [], None, None
    path, cur = [0], 0
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    # The sibling set and try order of every node are frozen here, before any draw of this call.
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            kids.setdefault(p, []).append(i)
    # greedy: every verified node's argmax in one op and one read (row-wise argmax = argmax of the row)
    best = logits[:n_verified].argmax(-1).tolist() if sampler.greedy else None
    while True:
        children = kids.get(cur, [])
        # greedy: the argmax; else one draw per resolved node (module docstring, "Draw first"); then its child
        x = best[cur] if sampler.greedy else sampler.pick(sampler.probs(logits[cur]))
        child = next((c for c in children if tokens[c] == x), None)
        if child is None:
            return path, x, None
        if child >= n_verified:
            return path, x, child
        path.append(child)
        cur = child


def walk_proposals(tree: DraftTree, n_verified: int, logits: Tensor, sampler: Sampler
                   ) -> tuple[list[int], int | None, int | None]:
    """``walk_tree`` for trees with proposals (``DraftTree.proposals``): SpecInfer's multi-step speculative
    sampling over children proposed by several drafters, each with its own proposal distribution.

    Same contract and return value as :func:`walk_tree`. At a verified node with processed target law p,
    the residual starts at r = p; the node's proposals ``(child, q)`` are tried in list order:
      * sampled (q a distribution the child's token x was drawn from): accept with min(1, r(x) / q(x)),
        where r is normalised; on rejection r <- max(0, r - q) (normalised on use);
      * deterministic (q = None, i.e. q = the point mass at x): accept with r(x); on rejection r <- r with x
        zeroed. This is the sampled rule with q = delta_x (min(1, r(x)/1) = r(x), max(0, r - delta_x) = r
        without x), and it has the law of ``walk_tree``'s rule (which draws the token first, for seeded answers
        that do not depend on the schedule; this list's draws still depend on the proposals a node holds).
    On acceptance the walk descends into ``child``; if every proposal is rejected, the token is drawn from
    the final residual r. At T = 0 the walk is greedy: the argmax's node if some proposal carries it.

    Why the committed token at a node has law exactly p. Lemma (one step): let r be a distribution and x a
    token drawn from q independently of everything that produced r. Accept x with min(1, r(x)/q(x)); on
    rejection continue with r' = norm(max(0, r - q)). Then P(accept and x = y) = q(y) min(1, r(y)/q(y)) =
    min(q(y), r(y)); P(reject) = 1 - sum_y min(q, r)(y) = sum_y max(0, r - q)(y) =: beta; so the law of
    "the accepted token, or else a token of law r'" is min(q, r) + beta r' = min(q, r) + max(0, r - q) = r.
    For q = delta_x with x fixed the same identity reads r(x) delta_x + (1 - r(x)) r|_{not x} = r.
    By induction over the list (the last residual is drawn from directly), the node commits a token of law
    r_0 = p, *provided* (a) each sampled proposal's token is a fresh draw from its q given everything tried
    before it at this node (the drafter draws i.i.d.; :func:`draft.tree.merge_sources` and
    :func:`draft.tree.merge_trees` keep every drawn proposal, never filter or reorder them by their values,
    and list deterministic proposals whose set is fixed independently of the draws), and (b) the list is
    fixed before the node's first draw (frozen below; the pipelined modes only append below unresolved
    nodes, see the module docstring). A child's own proposals were drawn from the draft conditioned on the
    child's token only, so (a) holds again one level down once the walk descends: the path's joint law is
    the target's autoregressive law. Several proposals may share one node (a token drawn twice): each is
    tried on its own; once x was rejected by a deterministic proposal, r(x) = 0 and later ones of x are
    accepted with probability 0 (they still shrink r by q, as the lemma requires).
    """
    if n_verified <= 0:
        return [], None, None
    path, cur = [0], 0
    tokens = tree.tokens.tolist()
    lists = [list(l) for l in tree.proposals]      # frozen before any draw of this call
    while True:
        plist = lists[cur]
        if sampler.greedy:
            x = int(torch.argmax(logits[cur]))
            child = next((c for c, _ in plist if tokens[c] == x), None)
        else:
            r = sampler.probs(logits[cur])
            child = None
            for c, q in plist:
                t = tokens[c]
                mass = float(r.sum())
                if q is None:
                    if mass > 0 and sampler.accept(float(r[t]) / mass):
                        child = c
                        break
                    r[t] = 0.0
                else:
                    rn = r / mass
                    qt = float(q[t])
                    if sampler.accept(min(1.0, float(rn[t]) / qt) if qt > 0 else 0.0):
                        child = c
                        break
                    res = torch.clamp(rn - q.to(rn.device, rn.dtype), min=0.0)
                    r = res if float(res.sum()) > 0 else rn   # r = q exactly: unreachable (accepts surely)
            if child is None:
                x = sampler.pick(r)          # the race takes the residual unnormalised (robust: Sampler.pick)
            else:
                x = tokens[child]
        if child is None:
            return path, x, None
        if child >= n_verified:
            return path, x, child
        path.append(child)
        cur = child
