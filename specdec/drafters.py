"""Drafters: what proposes the k tokens the target then checks.

Words:
- proposal: per row up to `max_lengths[b]` draft tokens (`lengths[b]` of them
  valid), and `probs`, the exact law each was drawn from, or None for a
  point-mass drafter (argmax, n-gram), whose proposals are deterministic.
- ModelDrafter: a small Hugging Face LM sampled with the target's warping.
- NgramDrafter: prompt lookup; finds an earlier occurrence (the earliest, by
  default) of the last n tokens in the prompt and the output so far, and
  proposes what followed it. Model-free, so its cost ratio is ~0.

A new drafter is a new class that satisfies `Drafter`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.adapters import TargetModel, check_finite
from specdec.race import Race, race_sample
from specdec.sampling import Warping, sample


@dataclass
class Proposal:
    tokens: torch.Tensor  # [batch, k] (entries past lengths[b] are padding)
    lengths: torch.Tensor  # [batch] valid drafts per row
    probs: torch.Tensor | None  # [batch, k, vocab] law each token was drawn from; None: point mass
    steps: int = 0  # draft model forwards spent
    confidences: torch.Tensor | None = None  # [batch, k] the draft's own probability of each draft (CPU)


class AcceptanceByConfidence:
    """P(a draft is accepted | the draft's own probability of it), learned from counts in bins.

    Peaked real drafts are rejected when unsure; a flat draft that agrees with its target (a
    layer-skip draft, a random pair) is accepted at any confidence. Counts tell the two apart,
    per pair and per generation (reset each run, so a seed still fixes the tokens)."""

    EDGES = torch.tensor([0.01, 0.03, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9])  # 10 bins of the draft's probability

    def __init__(self, prior: float = 0.7, weight: float = 2.0):
        self.prior, self.weight = prior, weight
        self.reset()

    def reset(self) -> None:
        self.accepted = torch.zeros(len(self.EDGES) + 1, dtype=torch.float64)
        self.trials = torch.zeros(len(self.EDGES) + 1, dtype=torch.float64)

    def predict(self, confidence: torch.Tensor) -> torch.Tensor:  # [batch] -> [batch] float64
        bins = torch.bucketize(confidence.double(), self.EDGES.double())
        return (self.accepted[bins] + self.weight * self.prior) / (self.trials[bins] + self.weight)

    def observe(self, confidences: torch.Tensor, lengths: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Drafts up to and including each row's first rejection were judged; later ones were not."""
        k = confidences.shape[1]
        position = torch.arange(k)[None, :]
        judged = position < torch.minimum(num_accepted + 1, lengths)[:, None]
        accepted = position < num_accepted[:, None]
        bins = torch.bucketize(confidences.double(), self.EDGES.double())
        self.trials.index_add_(0, bins[judged], torch.ones(int(judged.sum()), dtype=torch.float64))
        self.accepted.index_add_(0, bins[accepted], torch.ones(int(accepted.sum()), dtype=torch.float64))


class DraftModel(Protocol):
    """Anything that proposes drafts: ModelDrafter, NgramDrafter, NoDrafter, or a new class."""

    uses_model: bool
    max_positions: int | None  # the context the drafter can hold (None: unbounded)

    def reset(self, batch: int) -> None: ...

    def propose(
        self,
        sequences: Sequence[Sequence[int]],
        max_lengths: torch.Tensor,
        warping: Warping,
        generator: torch.Generator | None,
        race: Race | None = None,  # passed only under race verification
    ) -> Proposal: ...

    def rollback(self, committed_lengths: torch.Tensor) -> None: ...


class ModelDrafter:
    """A draft LM that samples (or takes the argmax) under the target's warping."""

    uses_model = True

    def __init__(
        self, adapter: TargetModel, vocab_size: int | None = None, stop_below: float | str | None = "auto"
    ):
        self.adapter = adapter
        self.name = adapter.name
        self.max_positions = adapter.max_positions
        self.vocab_size = vocab_size or adapter.vocab_size  # the target's: drafts live in its vocabulary
        # When to stop a row's drafting early (exact either way: it only shortens proposals):
        # a number: after a token the draft itself gave probability < stop_below;
        # "auto": once the learned chance that every draft so far survives falls below what one more
        # draft costs (`stop_costs`, in target forwards, set from the calibration); None: never.
        if not (stop_below is None or stop_below == "auto" or isinstance(stop_below, (int, float))):
            raise ValueError(f"stop_below must be a probability, 'auto' or None, got {stop_below!r}")
        self.stop_below = stop_below
        self.acceptance = AcceptanceByConfidence()
        self.stop_costs: list[float] = [0.2] * 16  # marginal cost of the (i+1)-th draft; decode() sets it
        self.step = 0

    def reset(self, batch: int) -> None:
        self.adapter.reset(batch)
        self.acceptance.reset()

    def observe(self, proposal: Proposal, result) -> None:
        """Learn acceptance by confidence from a verified round."""
        if proposal.confidences is not None and proposal.confidences.numel():
            self.acceptance.observe(proposal.confidences, proposal.lengths, result.num_accepted)

    def _stop(self, confidence: torch.Tensor, survive: torch.Tensor, i: int) -> torch.Tensor:
        """Rows whose drafting should end after draft i (0-based). `survive` is updated in place."""
        if self.stop_below is None:
            return torch.zeros_like(confidence, dtype=torch.bool)
        if self.stop_below == "auto":
            survive.mul_(self.acceptance.predict(confidence))
            return survive < self.stop_costs[min(i + 1, len(self.stop_costs) - 1)]
        return confidence < self.stop_below

    def _next_logits(self, raw: torch.Tensor, active: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Draft logits over the target's vocabulary: extra ids cut, missing ids at -inf (probability 0).
        The draft law is then exactly what is sampled, so verification stays exact."""
        self.step += 1
        check_finite(raw[active.to(raw.device)], f"draft model {self.adapter.name}", self.step)
        logits = raw if generator is None else raw.to(generator.device)
        extra = self.vocab_size - logits.shape[-1]
        if extra < 0:
            return logits[..., : self.vocab_size]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits

    def propose(self, sequences, max_lengths, warping: Warping, generator, race: Race | None = None) -> Proposal:
        """Up to max_lengths[b] drafts per row. Under race verification each draft is the draft's own
        race winner with the target's keyed noise at its absolute position (a point mass)."""
        batch, k = len(sequences), int(max_lengths.max()) if len(max_lengths) else 0
        if k == 0:
            return Proposal(torch.zeros(batch, 0, dtype=torch.long), max_lengths, None)
        active = max_lengths > 0
        lengths = max_lengths.clone()  # shrinks where the draft loses confidence
        logits = self._next_logits(self.adapter.feed(sequences, active)[:, -1], active, generator)  # [batch, vocab]
        tokens, probs, confidences = [], [], []
        survive = torch.ones(batch, dtype=torch.float64)  # the learned chance that all drafts so far survive
        for i in range(k):
            # The draft is warped exactly as the target is, at its own prefix (committed + drafted so far).
            prefixes = None
            if not warping.prefix_free:
                prefixes = [list(seq) + [int(t[row]) for t in tokens] for row, seq in enumerate(sequences)]
            scores = warping.scores(logits[:, None], prefixes)[:, 0]  # [batch, vocab]
            law = warping.probs(scores)  # exactly what the token is drawn from
            if warping.greedy:
                token = scores.argmax(-1)
                confidence = torch.softmax(scores, -1).gather(-1, token[:, None]).squeeze(-1)
            elif race is not None:
                positions = torch.tensor([[len(seq) + i] for seq in sequences], device=law.device)
                token = race_sample(law, race.noise(positions)[:, 0])
                confidence = law.gather(-1, token[:, None]).squeeze(-1)
            else:
                token = sample(law, generator)
                confidence = law.gather(-1, token[:, None]).squeeze(-1)
                probs.append(law)
            tokens.append(token)
            confidences.append(confidence.cpu())
            lengths[self._stop(confidences[-1], survive, i) & (lengths > i + 1)] = i + 1
            going = active & (lengths > i + 1)
            if not bool(going.any()):
                break
            # The last draft of a row is never fed: the target scores it.
            raw = self.adapter.forward(token[:, None].to(self.adapter.device), going[:, None].to(self.adapter.device))
            logits = self._next_logits(raw[:, -1], going, generator)
        return Proposal(
            torch.stack(tokens, 1).cpu(),
            lengths,
            torch.stack(probs, 1) if probs else None,
            steps=len(tokens),
            confidences=torch.stack(confidences, 1).float(),
        )

    def rollback(self, committed_lengths: torch.Tensor) -> None:
        # Keep what the draft cache holds of the committed tokens; the last one is always pending.
        self.adapter.rollback(torch.minimum(self.adapter.lengths, committed_lengths.to(self.adapter.device) - 1))


class NgramDrafter:
    """Prompt lookup (Saxena 2023; transformers' prompt_lookup_num_tokens): point-mass drafts.

    The longest suffix n-gram (max_ngram down to min_ngram) is looked up in the prompt and
    the output so far; the earliest match wins, as in transformers (the prompt is where
    editing tasks copy from); `match="latest"` prefers the most recent one instead.
    """

    uses_model = False
    max_positions = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, match: str = "earliest"):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if match not in ("earliest", "latest"):
            raise ValueError(f"match must be 'earliest' or 'latest', got {match!r}")
        self.max_ngram, self.min_ngram, self.match = max_ngram, min_ngram, match

    def reset(self, batch: int) -> None:
        pass

    def lookup(self, sequence: Sequence[int], k: int) -> list[int]:
        """Continuation of a match of the longest suffix n-gram found earlier in the sequence."""
        seq = list(sequence)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            suffix = seq[-n:]
            starts = range(len(seq) - n) if self.match == "earliest" else range(len(seq) - n - 1, -1, -1)
            for start in starts:
                if seq[start : start + n] == suffix:
                    return seq[start + n : start + n + k]
        return []

    def propose(self, sequences, max_lengths, warping, generator, race=None) -> Proposal:
        found = [self.lookup(seq, int(k)) if k > 0 else [] for seq, k in zip(sequences, max_lengths)]
        width = max([len(f) for f in found] + [0])
        tokens = torch.zeros(len(found), width, dtype=torch.long)
        for row, continuation in enumerate(found):
            tokens[row, : len(continuation)] = torch.tensor(continuation, dtype=torch.long)
        return Proposal(tokens, torch.tensor([len(f) for f in found], dtype=torch.long), None)

    def rollback(self, committed_lengths: torch.Tensor) -> None:
        pass


class NoDrafter:
    """The target alone through the same loop: the baseline for timing."""

    uses_model = False
    max_positions = None

    def reset(self, batch: int) -> None:
        pass

    def propose(self, sequences, max_lengths, warping, generator, race=None) -> Proposal:
        return Proposal(torch.zeros(len(sequences), 0, dtype=torch.long), torch.zeros_like(max_lengths), None)

    def rollback(self, committed_lengths: torch.Tensor) -> None:
        pass
