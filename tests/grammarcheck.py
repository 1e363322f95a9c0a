"""The reference for structured output: the target alone under transformers' generate() with a grammar
processor written as such processors are (xgrammar's contrib.hf.LogitsProcessor): one llguidance matcher
per row, fed the token sampled last at each call, masking the next. It shares nothing with
specdec.verify.grammar.GrammarMask (no rollback, no prefix matching) except the compiled grammar and
llguidance's view of the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import llguidance.torch
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from specdec.verify.grammar import Constraint, grammar_tokenizer


class SequentialMask(LogitsProcessor):
    """For one generate() call (as xgrammar's processor, make a new one per call)."""

    def __init__(self, constraint: Constraint, tokenizer, vocab: int, eos: Sequence[int]):
        self.view, self.grammar = grammar_tokenizer(tokenizer, vocab, eos), constraint.grammar
        self.vocab, self.eos = vocab, eos
        self.matchers: list | None = None

    def __call__(self, input_ids, scores):
        if self.matchers is None:
            self.matchers = [llguidance.LLMatcher(self.view, self.grammar) for _ in range(input_ids.shape[0])]
        else:
            for matcher, row in zip(self.matchers, input_ids[:, -1].tolist()):
                if not matcher.is_stopped():
                    assert matcher.consume_token(row), matcher.get_error()
        return mask_scores(self.matchers, scores, self.vocab, self.eos)


def mask_scores(matchers, scores, vocab: int, eos: Sequence[int]):
    bitmask = llguidance.torch.allocate_token_bitmask(len(matchers), vocab)
    for row, matcher in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, row)
        if not bool(bitmask[row].any()):  # a dead end: EOS alone (specdec's rule, docs/FEATURES.md)
            for e in eos:
                bitmask[row, e // 32] |= 1 << (e % 32)
    scores = scores.clone()
    llguidance.torch.apply_token_bitmask_inplace(scores, bitmask)
    return scores


def constrained_greedy(model, prompt: list[int], max_new_tokens: int, constraint: Constraint, tokenizer) -> list[int]:
    """The target alone: generate(do_sample=False, logits_processor=[the grammar]), new tokens up to EOS."""
    eos = model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    mask = SequentialMask(constraint, tokenizer, model.config.vocab_size, eos)
    inputs = torch.tensor([prompt], device=model.device)
    out = model.generate(
        inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens, do_sample=False,
        pad_token_id=eos[0], logits_processor=LogitsProcessorList([mask]),
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def constrained_outcome_law(model, prompt, steps: int, constraint: Constraint, tokenizer, eos: int, warpers):
    """The exact law of the first `steps` tokens of generate(do_sample=True, logits_processor=[the grammar])
    with these warpers after it (transformers' order), by enumerating every continuation."""
    view = grammar_tokenizer(tokenizer, model.config.vocab_size, [eos])
    done: dict[tuple[int, ...], float] = {}
    frontier: dict[tuple[int, ...], float] = {(): 1.0}
    for depth in range(steps):
        live = sorted(frontier)
        with torch.inference_mode():
            ids = torch.tensor([list(prompt) + list(t) for t in live], device=model.device)
            logits = model(ids).logits[:, -1].float().cpu()
        matchers = []
        for tokens in live:
            matcher = llguidance.LLMatcher(view, constraint.grammar)
            assert matcher.consume_tokens(list(tokens)), matcher.get_error()
            matchers.append(matcher)
        scores = mask_scores(matchers, logits, model.config.vocab_size, [eos])
        if len(warpers):
            scores = warpers(torch.empty(len(live), 0, dtype=torch.long), scores)
        law = torch.softmax(scores, -1).double()
        grown: dict[tuple[int, ...], float] = {}
        for row, tokens in enumerate(live):
            for x, p in enumerate(law[row].tolist()):
                if p > 0:
                    (done if x == eos or depth == steps - 1 else grown)[tokens + (x,)] = frontier[tokens] * p
        frontier = grown
    return done
