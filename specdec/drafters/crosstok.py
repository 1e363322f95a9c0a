"""Cross-tokenizer drafting: a draft LM with its own tokenizer proposes the target's tokens.

Words (committed text and marks: specdec.drafters.retokenize):
- text drafts: the draft continues the committed text in its own tokens (its argmax); the new text
  is re-encoded with the target's tokenizer and proposed as point-mass drafts (`probs=None`),
  which verification handles exactly under greedy and sampling alike.
- siblings (draft_width > 1 or "auto"): at each draft step the draft's runners-up are
  re-encoded too; where one's target tokens first part from the chain's, that target token is a
  point-mass sibling of the chain draft at that depth (a draft tree, verified in the same forward).
- healing: the draft's last token before the edge is taken back and its first new
  token must begin with that token's text; a word the target split where the draft would not
  (Qwen's "):\\n" then "   " against SmolLM2's "):" then "\\n   ") is re-merged the draft's way.

Exactness never rests on the text bookkeeping: a proposal is a point mass. A mis-synchronised draft
only drafts worse.
"""

from __future__ import annotations

import bisect
import math

import torch
from transformers.generation.logits_process import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from specdec.drafters import AcceptanceByRank, Drafter
from specdec.drafters.proposal import Proposal, Siblings, tree_outcome
from specdec.drafters.retokenize import (
    CONTEXT,
    HOLD_BACK,
    CommittedText,
    check_text_compatible,
    decode,
    encode,
    text_after,
)
from specdec.models.adapters import HFCausalLM
from specdec.tuning.costs import DraftSettings, RateCounter, columns_that_pay
from specdec.verify.race import Race
from specdec.verify.reads import check_finite
from specdec.verify.sampling import WARPERS, Warping

__all__ = [  # with the committed-text names, importable from here as before
    "CONTEXT",
    "DRAFT_PROCESSORS",
    "HOLD_BACK",
    "CommittedText",
    "CrossTokenizerDrafter",
    "TextSiblings",
    "check_text_compatible",
    "decode",
    "draft_processors",
    "draft_scores",
    "encode",
    "text_after",
]

# Target processors that mean the same in the draft's own token space (prefix-free, or reading any ids).
DRAFT_PROCESSORS = (*WARPERS, RepetitionPenaltyLogitsProcessor)


def draft_processors(warping: Warping) -> LogitsProcessorList:
    """The target's processors that mean the same on the draft's own ids (empty when greedy)."""
    kept = [p for p in warping.processors(1) if isinstance(p, DRAFT_PROCESSORS)]
    if warping.greedy:
        kept = [p for p in kept if isinstance(p, RepetitionPenaltyLogitsProcessor)]
    return LogitsProcessorList(kept)


def draft_scores(logits, processors, prefixes: list[list[int]]) -> torch.Tensor:
    """Draft scores [batch, draft vocab]: the draft-space processors, each row with its own draft ids
    as the prefix."""
    if not len(processors):
        return logits
    if all(not isinstance(p, RepetitionPenaltyLogitsProcessor) for p in processors):
        return processors(torch.empty(logits.shape[0], 0, dtype=torch.long), logits)
    rows = []
    for b in range(logits.shape[0]):
        prefix = torch.tensor([prefixes[b]], dtype=torch.long)
        rows.append(processors(prefix, logits[b : b + 1].clone())[0])
    return torch.stack(rows)


class CrossTokenizerDrafter(Drafter):
    """A draft LM with its own tokenizer, proposing target tokens: its text, re-encoded."""

    uses_model = True
    supports_trees = True
    learns = True
    can_select_rows = False  # its committed text is kept per row
    SIBLING_RANKS = 2  # runners-up per draft step re-encoded as sibling candidates
    max_positions = None  # the draft's context is counted in its own tokens; rows past it stop drafting

    def __init__(
        self,
        adapter: HFCausalLM,
        draft_tokenizer,
        target_tokenizer,
        target_vocab_size: int,
        *,
        heal: bool = True,
        stop_below: float | None = 0.4,
        steps_per_token: float = 1.5,
    ):
        check_text_compatible(draft_tokenizer, target_tokenizer, target_vocab_size)
        self.adapter, self.heal = adapter, heal
        self.draft_tokenizer, self.target_tokenizer = draft_tokenizer, target_tokenizer
        self.vocab_size = target_vocab_size  # the target's: proposals and probs live in its vocabulary
        # Stop a row after a draft token the draft gave probability < stop_below (as ModelDrafter does).
        self.stop_below = stop_below
        self.steps_per_token = steps_per_token  # draft steps allowed per wanted target token
        vocab = draft_tokenizer.get_vocab()
        special = set(getattr(draft_tokenizer, "all_special_ids", [])) | set(draft_tokenizer.get_added_vocab().values())
        self._special = special
        self._strings = {i: s for s, i in vocab.items() if i < adapter.vocab_size}
        healable = sorted((s, i) for i, s in self._strings.items() if i not in special)
        self._heal_keys, self._heal_ids = [s for s, _ in healable], [i for _, i in healable]
        self._heal_cache: dict[int, torch.Tensor] = {}
        self.text = CommittedText(draft_tokenizer, target_tokenizer)
        self.step = 0
        self.tree = TextSiblings()  # draft trees: the run's width and costs, what siblings were worth
        self.stops = stop_below is not None  # `configure` may turn it off (the calibration's chains)

    # ------------------------------------------------------------ the DraftModel protocol

    @property
    def name(self) -> str:
        return self.adapter.name

    def configure(self, settings: DraftSettings) -> None:
        self.tree.settings = settings
        self.stops = settings.stops and self.stop_below is not None

    @property
    def width(self) -> int | str:
        """The run's draft width."""
        return self.tree.settings.width

    def reset(self, batch: int) -> None:
        self.adapter.reset(batch)
        self.text.reset(batch)
        self.tree.reset()

    def observe(self, proposal: Proposal, result) -> None:
        self.tree.observe(proposal, result)

    def rollback(self, committed_lengths: torch.Tensor) -> None:
        """Nothing to do here: the next propose re-synchronises each row from its committed tokens
        and keeps the longest cached prefix that still agrees (drafts live in the draft's own ids)."""

    def propose(self, sequences, max_lengths, warping: Warping, generator, race: Race | None = None) -> Proposal:
        batch = len(sequences)
        wanted = [int(m) for m in max_lengths]
        active = [want > 0 and self.text.sync(b, sequences[b]) for b, want in enumerate(wanted)]
        contexts = [self.text.rows[b].ids for b in range(batch)]
        limit = [self._steps(want) for want in wanted]
        room = (self.adapter.max_positions or math.inf) - 1
        active = [on and 1 < len(ctx) and len(ctx) + n <= room for on, ctx, n in zip(active, contexts, limit)]
        if not any(active):
            return Proposal(torch.zeros(batch, 0, dtype=torch.long), torch.zeros(batch, dtype=torch.long), None)
        processors = draft_processors(warping)
        heal = [self._healable(b) if on and self.heal else None for b, on in enumerate(active)]
        # After the prefill, heal[b] is left only where the first draft re-merged the last token.
        logits, first = self._prefill(contexts, active, heal, processors)  # [batch, draft vocab]
        generated: list[list[int]] = [[] for _ in range(batch)]  # draft ids
        going = torch.tensor(active)
        steps = 0
        trees = self.width != 1
        runners_up: list[list[list[int]]] = [[] for _ in range(batch)]  # per row, per step: draft ids
        for i in range(max(limit[b] for b in range(batch) if active[b])):
            scores = draft_scores(logits, processors, [c + g for c, g in zip(contexts, generated)])
            token, confidence = self._choose(scores)
            for b, (healed, sure) in first.items() if i == 0 else ():
                token[b], confidence[b] = healed, sure
            if trees:
                top = scores.topk(self.SIBLING_RANKS + 1, dim=-1)
                for b in going.nonzero().flatten().tolist():
                    healed = i == 0 and b in first  # its runners-up came from other logits: none
                    ids = [] if healed else top.indices[b][top.values[b] > float("-inf")].tolist()
                    ids = [t for t in ids if t != int(token[b]) and t not in self._special]
                    runners_up[b].append(ids[: self.SIBLING_RANKS])
            steps += 1
            for b in going.nonzero().flatten().tolist():
                generated[b].append(int(token[b]))
                done = len(generated[b]) >= limit[b]
                if int(token[b]) in self._special:
                    done = True  # the draft ended its text (EOS or another special token)
                if not done:
                    done = len(self._target_ids(contexts[b], generated[b], heal[b])) >= wanted[b]
                if self.stops and float(confidence[b]) < self.stop_below:
                    done = True
                going[b] = not done
            if not bool(going.any()):
                break
            # The last draft of a row is never fed: the next round starts from the committed text.
            raw = self.adapter.forward(token[:, None].to(self.adapter.device), going[:, None])
            for b in going.nonzero().flatten().tolist():
                self.text.rows[b].cached.append(int(token[b]))
            logits = self._draft_logits(raw[:, -1], going)
        return self._text_proposal(contexts, generated, heal, wanted, steps, runners_up if trees else None)

    def _healable(self, b: int) -> int | None:
        """The draft's last token, when the first draft may re-merge it with what follows."""
        ids = self.text.rows[b].ids
        if len(ids) < 2 or ids[-1] in self._special or ids[-1] not in self._strings:
            return None
        return ids[-1]

    # ------------------------------------------------------------ the draft model

    def _steps(self, want: int) -> int:
        if want <= 0:
            return 0
        return math.ceil(self.steps_per_token * (want + 1))

    def _prefill(self, contexts, active, heal, processors) -> tuple[torch.Tensor, dict[int, tuple[int, float]]]:
        """Roll each row's cache back to what still agrees with its context and feed the rest.
        -> the logits after each context [batch, draft vocab], and {row: (first draft, confidence)}
        for rows that heal: their draft, read from the logits before their last token, extends that
        token's text; it replaces the token (rolled back), so healing costs no draft step."""
        keep = []
        for b, row in enumerate(self.text.rows):
            if not active[b]:
                keep.append(len(row.cached))
                continue
            same = 0
            for x, y in zip(row.cached, contexts[b]):
                if x != y:
                    break
                same += 1
            # Feed at least one token (two to heal: the logits before the last one are read too).
            keep.append(min(same, len(contexts[b]) - (1 if heal[b] is None else 2)))
            row.cached = list(contexts[b])
        self.adapter.rollback(torch.tensor(keep, dtype=torch.long))
        on = torch.tensor(active)
        healing = torch.tensor([h is not None for h in heal])
        out = self.adapter.feed(contexts, on, keep_logits=2 if bool(healing.any()) else 1)
        logits, first = self._draft_logits(out[:, -1], on), {}
        if not bool(healing.any()):
            return logits, first
        before = draft_scores(self._draft_logits(out[:, -2], healing), processors, [c[:-1] for c in contexts])
        before = self._healing_mask(before, heal)
        choice = before.argmax(-1)
        sure = torch.softmax(before, -1).gather(-1, choice[:, None]).squeeze(-1)
        for b, token in enumerate(heal):
            if token is None or int(choice[b]) == token:
                heal[b] = None
                continue
            first[b] = (int(choice[b]), float(sure[b]))
            contexts[b] = contexts[b][:-1]
            self.text.rows[b].cached.pop()
        if first:
            taken = torch.tensor([b in first for b in range(len(heal))], dtype=torch.long)
            self.adapter.rollback(self.adapter.lengths - taken)
        return logits, first

    def _draft_logits(self, raw: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        self.step += 1
        active = active.to(raw.device)
        check_finite(raw[active], f"draft model {self.adapter.name}", self.step)
        return torch.where(active[:, None], raw.float(), 0.0).cpu()  # idle rows: finite, never used

    def _healing_mask(self, scores: torch.Tensor, heal: list[int | None]) -> torch.Tensor:
        """Rows that heal may only choose a token that begins with the text taken back."""
        scores = scores.clone()
        for b, token in enumerate(heal):
            if token is None:
                continue
            if token not in self._heal_cache:
                key = self._strings[token]
                lo = bisect.bisect_left(self._heal_keys, key)
                hi = bisect.bisect_left(self._heal_keys, key + "\U0010ffff")
                self._heal_cache[token] = torch.tensor(self._heal_ids[lo:hi], dtype=torch.long)
            allowed = self._heal_cache[token]
            row = torch.full_like(scores[b], float("-inf"))
            row[allowed] = scores[b, allowed]
            scores[b] = row
        return scores

    def _choose(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft per row -> (draft ids [batch], the draft's confidence in each [batch]): the argmax,
        under greedy and sampling alike (any point mass is exact)."""
        token = scores.argmax(-1)
        return token, torch.softmax(scores, -1).gather(-1, token[:, None]).squeeze(-1)

    # ------------------------------------------------------------ draft text -> target ids

    def _target_ids(self, context: list[int], generated: list[int], heal: int | None) -> list[int]:
        """The target's tokens for the text the draft added after the committed text."""
        tail = context[-CONTEXT:]
        for end in range(len(generated), max(0, len(generated) - HOLD_BACK), -1):  # trim a split character
            new = text_after(self.draft_tokenizer, tail, generated[:end])
            if new is not None:
                break
        else:
            return []
        if heal is not None:
            taken = text_after(self.draft_tokenizer, tail, [heal])
            if taken is None or not new.startswith(taken):
                return []
            new = new[len(taken) :]
        return encode(self.target_tokenizer, new)

    def _text_proposal(self, contexts, generated, heal, wanted, steps, runners_up=None) -> Proposal:
        """Each row's text re-encoded in target tokens, the last one included: if the next draft token
        would have extended it, it is rejected at the price of one verified position (nearly free).
        With `runners_up` (per row, per step: the draft's next-best ids), siblings beside the chain."""
        drafts = []
        for b, gen in enumerate(generated):
            ids = self._target_ids(contexts[b], gen, heal[b]) if gen else []
            drafts.append(ids[: wanted[b]])
        width = max(len(d) for d in drafts)
        tokens = torch.zeros(len(drafts), width, dtype=torch.long)
        for b, ids in enumerate(drafts):
            tokens[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        siblings = None
        if runners_up is not None and width and self.tree.may_pay(int(lengths.max())):
            found = [
                self.tree.candidates(
                    lambda ids, b=b: self._target_ids(contexts[b], ids, heal[b]), generated[b], drafts[b], runners_up[b]
                )
                for b in range(len(drafts))
            ]
            siblings = self.tree.pick(found, lengths)
        return Proposal(tokens, lengths, None, steps=steps, siblings=siblings)


class TextSiblings:
    """Siblings for text drafts: the draft's runners-up at each step, re-encoded; where one's target
    tokens first part from the chain's inside the chain, that target token stands beside the chain
    draft at that depth. A fixed width keeps up to width - 1 per depth; "auto" keeps those whose learned
    value beats what one more verify column costs (as ModelDrafter's trees)."""

    def __init__(self):
        self.settings = DraftSettings()  # the run's width and costs (CrossTokenizerDrafter.configure)
        self.rank_acceptance = AcceptanceByRank()  # ranks 1-4 (SIBLING_RANKS may be raised)
        self.chain_rate = RateCounter(0.6, 2.0)  # P(a chain draft is accepted), this run

    def reset(self) -> None:
        self.rank_acceptance.reset()
        self.chain_rate.reset()

    def observe(self, proposal: Proposal, result) -> None:
        """Learn the chain's per-draft acceptance and each sibling rank's, from verified rounds."""
        accepted = result.num_accepted
        if proposal.siblings is not None:
            accepted, won = tree_outcome(proposal, result)
            self.rank_acceptance.observe(proposal.siblings, accepted, proposal.lengths, won)
        judged = torch.minimum(accepted + 1, proposal.lengths)
        self.chain_rate.observe(float(torch.minimum(accepted, proposal.lengths).sum()), float(judged.sum()))

    def survive(self) -> float:
        """The learned chance that a chain draft is accepted (this run; prior 0.6 worth 2 drafts)."""
        return self.chain_rate.rate()

    def may_pay(self, k: int) -> bool:
        """With width "auto": could even the best sibling (depth 0, rank 1) beat one more verify column
        for a k-draft chain? If not, no runner-up is re-encoded this round (that costs host time)."""
        if self.settings.width != "auto":
            return True
        best = (1 - self.survive()) * float(self.rank_acceptance.predict(torch.tensor(1)))
        return self._worth([best], k) > 0

    def _worth(self, values: list[float], k: int) -> int:
        """How many of `values` (best first) pay beside a k-draft chain (specdec.tuning.costs.columns_that_pay)."""
        settings = self.settings
        return columns_that_pay(values, k + 1, *self._chain_round(k), settings.verify_cost, settings.max_width)

    def _chain_round(self, k: int) -> tuple[float, float]:
        """A k-draft chain round: (expected tokens, cost in target forwards); a draft's cost is its
        marginal round cost without its verify column."""
        survive, verify_cost = self.survive(), self.settings.verify_cost
        draft_cost = max(0.0, self.settings.stop_costs[0] - (verify_cost(2) - verify_cost(1)))
        return 1 + sum(survive ** (j + 1) for j in range(k)), k * draft_cost + verify_cost(k + 1)

    @staticmethod
    def candidates(target_ids, generated, chain, runners_up) -> list[tuple[int, int, int]]:
        """(depth, target id, rank) per runner-up whose text first parts from the chain's target tokens
        inside the chain: that target token, beside the chain draft at that depth. First found, first kept.
        `target_ids(draft ids)`: the target's tokens for the text those draft ids add."""
        found, seen = [], set()
        for i, alternatives in enumerate(runners_up):
            for rank, alternative in enumerate(alternatives, 1):
                ids = target_ids(generated[:i] + [alternative])
                depth = next((d for d, (x, y) in enumerate(zip(ids, chain)) if x != y), None)
                if depth is not None and (depth, ids[depth]) not in seen:
                    seen.add((depth, ids[depth]))
                    found.append((depth, ids[depth], rank))
        return found

    def pick(self, found: list[list[tuple[int, int, int]]], lengths) -> Siblings | None:
        """Each row's siblings from its candidates: per depth up to width - 1, or with "auto" the most
        valuable first while each raises the round's expected tokens per cost (a sibling at depth d is
        worth P(the chain reaches d and fails there) x its rank's learned acceptance)."""
        if self.settings.width == "auto":
            chosen = [self._valuable(candidates, int(lengths[row])) for row, candidates in enumerate(found)]
        else:
            chosen = [self._fixed(candidates) for candidates in found]
        count = max(len(keep) for keep in chosen)
        if count == 0:
            return None
        table = torch.zeros(4, len(chosen), count, dtype=torch.long)  # depth, token, rank, valid
        for row, keep in enumerate(chosen):
            for j, (depth, token, rank) in enumerate(keep):
                table[:, row, j] = torch.tensor([depth, token, rank, 1])
        return Siblings(table[1], table[0], table[2], table[3].bool())

    def _valuable(self, candidates: list[tuple[int, int, int]], k: int) -> list[tuple[int, int, int]]:
        """Width "auto": the candidates beside a k-draft chain that pay, most valuable first."""
        survive = self.survive()
        ranks = self.rank_acceptance.predict(torch.tensor([rank for _, _, rank in candidates], dtype=torch.long))
        values = [survive**depth * (1 - survive) * float(r) for (depth, _, _), r in zip(candidates, ranks)]
        scored = sorted(zip(values, candidates), key=lambda pair: pair[0], reverse=True)
        return [c for _, c in scored[: self._worth([v for v, _ in scored], k)]]

    def _fixed(self, candidates: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        """A fixed width: the first width - 1 candidates at each depth."""
        per_depth: dict[int, int] = {}
        keep = []
        for depth, token, rank in candidates:
            if per_depth.get(depth, 0) < self.settings.width - 1:
                per_depth[depth] = per_depth.get(depth, 0) + 1
                keep.append((depth, token, rank))
        return keep
