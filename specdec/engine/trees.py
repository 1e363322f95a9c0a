"""Draft trees in the round: scored in one target forward, verified exactly, one path kept.

Words (docs/DESIGN.md):
- chain: a row's k drafts, each the child of the one before (the first: of the last committed token).
- sibling: a point-mass alternative beside chain draft d (same parent), proposed by a drafter that
  supports trees (`Proposal.siblings`); chain then siblings are the tree's nodes.
- width: candidates per chain draft (1: a chain; w: up to w - 1 siblings at each depth).
- path: the nodes a row accepted, root to leaf (`VerifyResult.path`); the target keeps their
  cache slots (`keep_path`), the draft keeps the chain up to where the path left it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.drafters import DraftModel
from specdec.drafters.proposal import Proposal
from specdec.models.adapters import TargetModel, tree_ancestors
from specdec.verify import VerifyResult, check_draft_width, tree_verify
from specdec.verify.race import Race, race_sample
from specdec.verify.sampling import Warping

MAX_TREE_LOGITS_BYTES = 4 * 2**30  # one row's verify logits (width x drafts x vocab x float32) past this: refused


def check_tree_size(width: int | str, drafts: int, vocab: int) -> None:
    """A draft tree the target can score: at most one candidate per token of its vocabulary at each
    position, and one row's verify logits (width x drafts x vocab float32) within MAX_TREE_LOGITS_BYTES."""
    if width == "auto" or width == 1:
        return
    if width > vocab:
        raise ValueError(
            f"draft_width={width} exceeds the target's vocabulary ({vocab} tokens): a draft position has at most "
            f"{vocab} candidates"
        )
    need = width * drafts * vocab * 4
    if need > MAX_TREE_LOGITS_BYTES:
        raise ValueError(
            f"draft_width={width} with num_draft_tokens={drafts} needs {need:,} bytes of logits per row (width x "
            f"drafts x vocabulary {vocab} x 4), over the {MAX_TREE_LOGITS_BYTES:,} allowed; lower either"
        )


def tree_width(draft_width, target: TargetModel, drafter: DraftModel, verification: str, greedy: bool) -> int | str:
    """The draft width a run can use: trees need a drafter that grows them, a target adapter that
    scores them, and a verification rule for several candidates (token, race; block judges chains)."""
    check_draft_width(draft_width)
    if draft_width == 1:
        return 1
    reasons = []
    if not drafter.supports_trees:
        reasons.append(f"the drafter ({type(drafter).__name__}) proposes chains only")
    if not target.supports_trees:
        reasons.append(f"the target adapter ({type(target).__name__}, {target.name}) scores chains only")
    if verification == "block" and not greedy:
        reasons.append("block verification judges a chain; use verification='token' or 'race'")
    if not reasons:
        return draft_width
    if draft_width == "auto":
        return 1
    raise ValueError(f"draft_width={draft_width} needs a draft tree, but " + "; ".join(reasons))


def score_tree(target: TargetModel, sequences, active: torch.Tensor, proposal: Proposal) -> torch.Tensor:
    """One target forward over each row's pending tokens and its tree -> logits [batch, nodes + 1, vocab],
    column 1 + j scoring after node j (positions are depths: siblings share their chain draft's)."""
    nodes, parents, valid = proposal.tree
    return target.feed(sequences, active, nodes, valid, keep_logits=nodes.shape[1] + 1, extra_parents=parents)


def verify_tree(
    logits: torch.Tensor,  # [batch, nodes + 1, vocab]
    proposal: Proposal,
    warping: Warping,
    sequences: Sequence[Sequence[int]],
    generator: torch.Generator | None,
    race: Race | None,
) -> VerifyResult:
    """Exact verification of a draft tree (specdec.verify.tree_verify): each node is warped with
    its own path as prefix; greedy and race fix the target's token at every node, token-level
    sampling judges the chain draft there by p/q and its siblings against the residual."""
    nodes, parents, valid = proposal.tree
    paths = None
    if not warping.prefix_free or (race is not None and not warping.greedy):
        ancestors = tree_ancestors(parents)  # [batch, nodes, nodes]: each node's path, itself included
    if not warping.prefix_free:
        paths = [
            [[]]
            + [[t for t, on in zip(nodes[b].tolist(), ancestors[b, j].tolist()) if on] for j in range(len(nodes[b]))]
            for b in range(len(nodes))
        ]
    scores = warping.scores(logits, None if warping.prefix_free else sequences, paths=paths)
    if warping.greedy:
        result = tree_verify(None, nodes, parents, node_valid=valid, winners=scores.argmax(-1))
    elif race is not None:
        depth = torch.cat([torch.zeros(len(nodes), 1, dtype=torch.long), ancestors.sum(-1)], 1)
        starts = torch.tensor([len(s) for s in sequences])
        noise = race.noise((starts[:, None] + depth).to(logits.device))
        winners = race_sample(warping.probs(scores), noise)  # the target's race winner at every node
        result = tree_verify(None, nodes, parents, node_valid=valid, winners=winners)
    else:
        draft_probs = None if proposal.probs is None else proposal.probs.to(scores.device)
        result = tree_verify(
            warping.probs(scores), nodes, parents, node_valid=valid, draft_probs=draft_probs, generator=generator
        )
    return result


def path_nodes(proposal: Proposal, result: VerifyResult) -> torch.Tensor:
    """[batch, nodes] bool: each row's accepted path through the tree, the slots the target keeps."""
    nodes = proposal.siblings.tokens.shape[1] + proposal.tokens.shape[1]
    keep = torch.zeros(len(result.path), nodes, dtype=torch.bool)
    on_path = result.path >= 0
    keep[on_path.nonzero()[:, 0], result.path[on_path]] = True
    return keep


def chain_agreement(sequences: Sequence[list[int]], starts: torch.Tensor, proposal: Proposal) -> torch.Tensor | None:
    """Per row: the committed length up to the first chain draft that was not committed, + 1 (None for a
    chain: the committed length itself). The draft cache holds the chain; a path that ends on a sibling
    leaves the chain draft at that depth in it, which the draft's rollback must drop."""
    k = proposal.tokens.shape[1]
    if proposal.siblings is None or k == 0:
        return None
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    agree = []
    for row, start in enumerate(starts.tolist()):
        committed = sequences[row][start : start + k]
        chain = proposal.tokens[row, : len(committed)].tolist()
        same = next((i for i, (a, b) in enumerate(zip(committed, chain)) if a != b), len(committed))
        agree.append(start + same + 1)
    return torch.minimum(lengths, torch.tensor(agree))


def sibling_counts(proposal: Proposal, result, row: int, accepted: int) -> tuple[int, bool]:
    """For the metrics: a row's valid siblings this round, and whether its last accepted node was one."""
    if proposal.siblings is None:
        return 0, False
    k = proposal.tokens.shape[1]
    siblings = int(proposal.tree[2][row, k:].sum())  # valid nodes past the chain
    return siblings, accepted > 0 and int(result.path[row, accepted - 1]) >= k
