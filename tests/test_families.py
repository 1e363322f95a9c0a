"""Every causal LM family transformers ships (tiny random models): greedy output equals `generate()` in
float32, as target and as draft, past the sliding window, with `auto` k, draft trees and ragged batches.
Families whose state cannot be rolled back are refused by name before any work.

The sliding-window families, GPT-2 and an ALiBi family run in `make test`; the rest under `make test-all`.
"""

import pytest
import torch

from specdec import SpeculativeDecoder
from specdec.models.adapters import UnsupportedModelError
from tests.families import FAMILIES, SLIDING, UNROLLABLE, WINDOW, build
from tests.tiny import hf_greedy, perturbed

FAST = {*SLIDING, "llama", "gpt2", "bloom"}
PROMPTS = [[3, 5, 7], [9, 2, 4, 6, 8, 1, 3, 5, 7, 11, 13]]  # the second starts past the window
NEW_TOKENS = 40  # five windows


def test_slot_placed_families_refuse_batches():
    decoder = SpeculativeDecoder(build("mpt"), build("mpt", seed=1))
    with pytest.raises(ValueError, match="mpt models place tokens by cache slot.*one prompt at a time"):
        decoder.generate(PROMPTS, max_new_tokens=4, temperature=0)


def row_rejected(rows) -> bool:
    """Some row rejected a draft: its cache was rolled back while the other row's was not."""
    return any(row.metrics.accepted_tokens < row.metrics.drafted_tokens for row in rows)


def _marked(names):
    return [name if name in FAST else pytest.param(name, marks=pytest.mark.slow) for name in names]


@pytest.mark.parametrize("family", _marked(FAMILIES))
def test_greedy_equals_generate_as_target_and_draft(family):
    target = build(family)
    assert len(PROMPTS[1]) + NEW_TOKENS > 4 * WINDOW
    expected = [hf_greedy(target, prompt, NEW_TOKENS) for prompt in PROMPTS]
    # The family as draft too: another random model of it, so rows reject at different places (holes).
    decoder = SpeculativeDecoder(target, build(family, seed=1))
    if not decoder.target.batches:  # MPT: one row at a time (see test_slot_placed_families_refuse_batches)
        expected = expected[1:]
    width = 3 if decoder.target.supports_trees else 1  # ALiBi families: chains (see test_alibi_...)
    for options in ({}, dict(num_draft_tokens=3, draft_width=width), dict(num_draft_tokens=4, draft_width=1)):
        rows = decoder.generate(PROMPTS[-len(expected) :], max_new_tokens=NEW_TOKENS, temperature=0, **options)
        assert [row.token_ids for row in rows] == expected, options
        assert rows[0].batch_metrics.drafted_tokens > 0
        assert row_rejected(rows), options
    # A draft identical to the target is always accepted: its own cache rolls back right past the window.
    same = SpeculativeDecoder(target, perturbed(target, 0.0, seed=1))
    out = same.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS, temperature=0, num_draft_tokens=4, draft_width=1)
    assert out.token_ids == expected[-1] and out.metrics.acceptance_rate == 1.0


@pytest.mark.parametrize("family", ["mistral-sliding", "gemma3"])
def test_sliding_window_target_alone_and_prompt_lookup(family):
    target = build(family)
    expected = hf_greedy(target, PROMPTS[1], NEW_TOKENS)
    for draft in (None, "ngram"):
        assert (
            SpeculativeDecoder(target, draft).generate(PROMPTS[1], max_new_tokens=NEW_TOKENS, temperature=0).token_ids
            == expected
        )


def test_alibi_families_refuse_trees_by_name():
    decoder = SpeculativeDecoder(build("bloom"), perturbed(build("bloom"), 0.3, seed=1))
    with pytest.raises(ValueError, match="bloom.*chains only"):
        decoder.generate(PROMPTS[0], max_new_tokens=4, temperature=0, draft_width=3)


@pytest.mark.parametrize("family", UNROLLABLE)
def test_a_family_without_rollback_is_refused_by_name_before_any_work(family, tmp_path):
    model = build(family)
    for roles in ((model, None), (build("llama"), model)):
        with pytest.raises(UnsupportedModelError, match=f"{family} models .*cannot be"):
            SpeculativeDecoder(*roles)
    model.save_pretrained(tmp_path / family)
    with pytest.raises(UnsupportedModelError, match=f"{family} models"):  # by name: before packing or quantising
        SpeculativeDecoder.from_pretrained(str(tmp_path / family), dtype="float32", device="cpu")


def test_the_sliding_cache_keeps_every_state_and_masks_by_position():
    # Past the window, the cache holds every state (a rollback may need the evicted ones) and a batch
    # whose rows have holes still sees exactly `window` positions back.
    decoder = SpeculativeDecoder(build("mistral-sliding"), None)
    decoder.generate(PROMPTS[1], max_new_tokens=NEW_TOKENS, temperature=0)
    layer = decoder.target.cache.layers[0]
    assert layer.keys.shape[2] >= len(PROMPTS[1]) + NEW_TOKENS - 1
    assert torch.equal(decoder.target.lengths, torch.tensor([len(PROMPTS[1]) + NEW_TOKENS - 1]))
