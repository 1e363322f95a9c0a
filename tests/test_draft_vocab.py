"""A draft head over part of the vocabulary (specdec.draft_vocab): its logits are the full head's at
its ids, it grows with the run's tokens, it leaves the given model alone, and decoding with it stays
exact (greedy equal to transformers; the sampled law is in tests/test_laws.py)."""

import copy

import pytest
import torch

import specdec
import specdec.draft_vocab as draft_vocab
from specdec import SpeculativeDecoder
from specdec.draft_vocab import VocabHead, base_ids, resolve_draft_vocab, vocab_head, with_vocab_head
from specdec.quantize import quantize_int8
from tests.tiny import build, hf_greedy, perturbed

BASE = 16  # of the tiny models' 96 ids


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target = build("llama", 40, tmp_path_factory.mktemp("vocab") / "target", layers=2, hidden=32, sharpness=4.0)
    return target, perturbed(target, 0.3, seed=41)


@pytest.mark.parametrize("int8", [False, True])
def test_logits_are_the_full_heads_at_the_subset_ids(pair, int8):
    _, draft = pair
    model = quantize_int8(copy.deepcopy(draft)) if int8 else draft
    full = model.get_output_embeddings()
    head = VocabHead(full, base_ids(96, BASE, special_ids=[90]))
    hidden = torch.randn(3, 5, 32)
    with torch.inference_mode():
        assert head.ids.tolist() == list(range(BASE)) + [90]
        same = torch.equal if int8 else lambda a, b: torch.allclose(a, b, atol=1e-6)  # BLAS blocks by shape
        assert same(head(hidden), full(hidden)[..., head.ids])
        assert head.cover([3, 50, 50, 7, 60]) == 2 and head.cover([50]) == 0  # only new ids are added
        assert head.ids.tolist() == list(range(BASE)) + [90, 50, 60]
        assert same(head(hidden), full(hidden)[..., head.ids])


def test_extra_rows_merge_into_the_base_and_reset_restores_it(pair, monkeypatch):
    _, draft = pair
    monkeypatch.setattr(draft_vocab, "MAX_EXTRA", 4)
    head = VocabHead(draft.get_output_embeddings(), range(BASE))
    head.cover([20, 21, 22])
    assert head.extra is not None and head.size == BASE + 3
    head.cover([23, 24])  # 5 extra rows > 4: one base
    assert head.extra is None and head.size == BASE + 5 and head.base_size == BASE
    hidden = torch.randn(2, 32)
    with torch.inference_mode():
        assert torch.allclose(head(hidden), draft.get_output_embeddings()(hidden)[..., head.ids], atol=1e-6)
    head.reset()
    assert head.ids.tolist() == list(range(BASE)) and head.extra is None


def test_with_vocab_head_leaves_the_given_model_alone(pair):
    _, draft = pair
    original = draft.get_output_embeddings()
    trimmed = with_vocab_head(draft, range(BASE))
    assert draft.get_output_embeddings() is original and vocab_head(draft) is None
    assert vocab_head(trimmed) is not None and trimmed.model is draft.model  # same weights, other head


def test_resolve_draft_vocab_settings():
    assert resolve_draft_vocab(65536, 151936, [151643, 3]) == list(range(65536)) + [151643]
    assert resolve_draft_vocab(None, 151936) is None  # the default: the full head
    assert resolve_draft_vocab(96, 96) is None  # nothing to cut
    for bad in ("auto", 0, -3, 2.5, True):
        with pytest.raises(ValueError, match="draft_vocab"):
            resolve_draft_vocab(bad, 151936)


@pytest.mark.parametrize("k", [2, 5, "auto"])
def test_greedy_with_a_partial_head_equals_transformers(pair, k):
    """The draft can only propose its subset, so it misses where the target goes elsewhere; the output
    must not change, and the run's tokens must join the subset as they are committed."""
    target, draft = pair
    decoder = SpeculativeDecoder(target, with_vocab_head(draft, range(BASE)))
    head = decoder.drafter.head
    for seed in range(3):
        prompt = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        out = decoder.generate(prompt, max_new_tokens=24, num_draft_tokens=k)
        assert out.token_ids == hf_greedy(target, prompt, 24)
        in_prompt = set(prompt) - set(range(BASE))
        assert in_prompt and set(head.ids.tolist()) >= in_prompt, "the prompt's tokens join the subset"
        assert head.size > BASE + len(in_prompt), "so do committed ones (the last round's come at the next)"
    assert out.metrics.accepted_tokens > 0


def test_batched_rows_with_a_partial_head_equal_their_solo_runs(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, with_vocab_head(draft, range(BASE)))
    prompts = [[3, 70, 5], [88, 1, 2, 64, 9, 30], [40]]
    batched = decoder.generate(prompts, max_new_tokens=16, num_draft_tokens=3)
    assert [r.token_ids for r in batched] == [hf_greedy(target, p, 16) for p in prompts]


def test_same_seed_same_tokens_across_runs_of_one_decoder(pair):
    """The subset grows during a run and is reset before the next: the draft's law, and so the
    sampled tokens, depend only on the run itself."""
    target, draft = pair
    decoder = SpeculativeDecoder(target, with_vocab_head(draft, range(BASE)))
    runs = [
        decoder.generate([5, 77, 12], max_new_tokens=20, num_draft_tokens=3, temperature=1.0, seed=7).token_ids
        for _ in range(3)
    ]
    decoder.generate([60, 61, 62, 63, 64], max_new_tokens=20, temperature=1.0, seed=1)  # grows other ids between
    runs.append(decoder.generate([5, 77, 12], max_new_tokens=20, num_draft_tokens=3, temperature=1.0, seed=7).token_ids)
    assert all(r == runs[0] for r in runs)


def test_from_pretrained_cuts_a_loaded_draft_without_touching_it(pair):
    target, draft = pair
    original = draft.get_output_embeddings()
    decoder = SpeculativeDecoder.from_pretrained(target, draft, draft_vocab=BASE)
    assert decoder.drafter.head is not None and decoder.drafter.head.base_size == BASE
    assert draft.get_output_embeddings() is original
    assert SpeculativeDecoder.from_pretrained(target, draft).drafter.head is None  # off by default
    prompt = [7, 50, 81, 2]
    assert decoder.generate(prompt, max_new_tokens=12).token_ids == hf_greedy(target, prompt, 12)


def test_generate_checks_draft_vocab_before_loading():
    with pytest.raises(ValueError, match="draft_vocab"):
        specdec.generate("hi", target="no-such-model", draft="no-such-draft", draft_vocab="auto")
