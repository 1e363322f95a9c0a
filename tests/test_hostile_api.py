"""Hostile arguments to the public API (issue 32): each is either honoured exactly as transformers'
`generate()` honours it, or refused at the boundary with one clear ValueError that names it.

Words: a case is a set of generate() keywords; the reference is `model.generate()` on the same tiny
random model, one prompt at a time, with an all-ones attention mask."""

import math
import shutil
import warnings

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig
from transformers.generation import SynthIDTextWatermarkingConfig, WatermarkingConfig
from transformers.generation.logits_process import EncoderRepetitionPenaltyLogitsProcessor

import specdec
from specdec import SpeculativeDecoder
from specdec import config as inputs
from specdec.drafters.proposal import Proposal
from specdec.engine import trees as trees_module
from tests.lawcheck import bin_violations
from tests.tiny import VOCAB, build, save_char_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
PROMPTS = ([3, 1, 4, 1, 5], [7])
EOS = 42  # the third greedy token of PROMPTS[0]: fields that read EOS change the output


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    target = build("llama", 0, root / "target", layers=2)
    draft = build("llama", 1, root / "draft", layers=1)
    save_char_tokenizer(root / "target")
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "target")
    return {"root": root, "target": target, "draft": draft, "dir": str(root / "target"), "tokenizer": tokenizer}


def reference(model, prompt: list[int], max_new_tokens: int, **settings) -> list[int]:
    """transformers' greedy output for one prompt."""
    ids = torch.tensor([prompt], device=model.device)
    settings = {"pad_token_id": 0, "do_sample": False, **settings}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **settings)
    return out[0, len(prompt) :].tolist()


# ------------------------------------------------------------------ 1. every generation-config field


# One case per field that specdec honours (the others are refused: inputs.UNSUPPORTED). Greedy cases
# change the greedy output of at least one prompt, unless the field is inert under greedy by nature
# (INERT_UNDER_GREEDY: warpers, renormalisation, NaN removal on finite logits, metadata).
GREEDY_CASES = {
    "max_new_tokens": {},
    "do_sample": {"do_sample": False},
    "temperature": {"temperature": 0.7, "do_sample": False},
    "top_k": {"top_k": 5, "do_sample": False},
    "top_p": {"top_p": 0.5, "do_sample": False},
    "min_p": {"min_p": 0.2, "do_sample": False},
    "top_h": {"top_h": 0.5, "do_sample": False},
    "typical_p": {"typical_p": 0.5, "do_sample": False},
    "epsilon_cutoff": {"epsilon_cutoff": 0.05, "do_sample": False},
    "eta_cutoff": {"eta_cutoff": 0.05, "do_sample": False},
    "min_length": {"min_length": 10, "eos_token_id": EOS},
    "min_new_tokens": {"min_new_tokens": 8, "eos_token_id": EOS},
    "repetition_penalty": {"repetition_penalty": 1.5},
    "encoder_repetition_penalty": {"encoder_repetition_penalty": 3.0},
    "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
    "encoder_no_repeat_ngram_size": {"encoder_no_repeat_ngram_size": 1},
    "bad_words_ids": {"bad_words_ids": [[42], [4, 42]], "eos_token_id": 7},
    "sequence_bias": {"sequence_bias": [[[61], 10.0], [[4, 42], -20.0]]},
    "suppress_tokens": {"suppress_tokens": [42, 59]},
    "begin_suppress_tokens": {"begin_suppress_tokens": [2, 15]},
    "forced_bos_token_id": {"forced_bos_token_id": 11},
    "forced_eos_token_id": {"forced_eos_token_id": 9},
    "exponential_decay_length_penalty": {"exponential_decay_length_penalty": (2, 3.0), "eos_token_id": 89},
    "renormalize_logits": {"renormalize_logits": True},
    "remove_invalid_values": {"remove_invalid_values": True},
    "watermarking_config": {"watermarking_config": WatermarkingConfig(bias=8.0)},
    "eos_token_id": {"eos_token_id": [EOS, 61]},
    "pad_token_id": {"pad_token_id": 3},
    "bos_token_id": {"bos_token_id": 4},
    "decoder_start_token_id": {"decoder_start_token_id": 5},
}
INERT_UNDER_GREEDY = {
    *("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p", "top_h", "typical_p"),
    *("epsilon_cutoff", "eta_cutoff", "renormalize_logits", "remove_invalid_values"),
    *("pad_token_id", "bos_token_id", "decoder_start_token_id"),
}


def test_every_generation_config_field_is_honoured_or_refused():
    fields = {name for name in GenerationConfig().to_dict() if not name.startswith("_")} - {"transformers_version"}
    honoured, refused = set(inputs.HONOURED), set(inputs.UNSUPPORTED)
    assert honoured.isdisjoint(refused)
    assert fields == honoured | refused, f"not audited: {sorted(fields - honoured - refused)}"
    assert set(GREEDY_CASES) == honoured  # every honoured field is compared with generate() below


@pytest.mark.parametrize("field", sorted(GREEDY_CASES))
def test_greedy_with_each_honoured_field_equals_generate(tiny, field):
    target, settings = tiny["target"], GREEDY_CASES[field]
    expected = [reference(target, p, 12, **settings) for p in PROMPTS]
    if field not in INERT_UNDER_GREEDY:
        assert expected != [reference(target, p, 12) for p in PROMPTS], "the case must change the output"
    decoder = SpeculativeDecoder(target, tiny["draft"])
    out = decoder.generate(list(PROMPTS), max_new_tokens=12, num_draft_tokens=3, **{"temperature": 0, **settings})
    assert [r.token_ids for r in out] == expected


SAMPLED_CASES = {
    **{name: {key: value for key, value in case.items() if key != "do_sample"} for name, case in GREEDY_CASES.items()},
    "epsilon_cutoff": {"epsilon_cutoff": 0.02},
    "eta_cutoff": {"eta_cutoff": 0.02},
}


@pytest.mark.parametrize("field", sorted(SAMPLED_CASES))
def test_sampled_law_with_each_honoured_field_equals_generates_scores(tiny, field):
    """generate(do_sample=True) with a seed: its processed scores at each step of its own sampled path
    are the scores specdec's warping computes from the same raw logits and prefix."""
    target, settings, prompt = tiny["target"], {"pad_token_id": 0, **SAMPLED_CASES[field]}, list(PROMPTS[0])
    torch.manual_seed(0)
    ids = torch.tensor([prompt])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = target.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=True,
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
            **settings,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    arguments = {"temperature": None, "top_k": None, "top_p": None, "do_sample": True, **settings}
    request = inputs.check_request(max_new_tokens=8, num_draft_tokens=3, stop=None, stream=None, seed=None, **arguments)
    warping, _ = SpeculativeDecoder(target, None).warping(request)
    warping = warping.for_prompts([len(prompt)])
    for step, (raw, processed) in enumerate(zip(out.logits, out.scores)):
        ours = warping.scores(raw[None].float(), [prompt + tokens[:step]])[0, 0]
        torch.testing.assert_close(ours, processed[0].float(), msg=f"{field}, step {step}")


def test_sampled_tokens_follow_the_encoder_repetition_penalty(tiny):
    """The engine's sampled first token has generate()'s law under encoder_repetition_penalty
    (> 1 favours the prompt's tokens; the tiny model's logits are small, so the penalty is large)."""
    target, prompt, rows = tiny["target"], [3, 1, 4], 1500
    out = specdec.generate(
        [prompt] * rows,
        target=target,
        draft=tiny["draft"],
        max_new_tokens=2,
        temperature=1.0,
        top_k=0,
        encoder_repetition_penalty=100.0,
        seed=3,
        num_draft_tokens=2,
    )
    firsts = torch.tensor([r.token_ids[0] for r in out])
    with torch.inference_mode():
        logits = target(torch.tensor([prompt])).logits[0, -1].float()
    penalty = EncoderRepetitionPenaltyLogitsProcessor(100.0, torch.tensor([prompt]))
    law = torch.softmax(penalty(torch.tensor([prompt]), logits[None])[0], -1)
    assert law[3] > 0.5  # the penalty matters: token 3 alone had probability ~0.01
    assert bin_violations(torch.bincount(firsts, minlength=VOCAB), law, rows) == []


def test_stateful_synthid_watermarking_is_refused_by_name(tiny):
    synthid = SynthIDTextWatermarkingConfig(keys=[1, 2, 3], ngram_len=2)
    with pytest.raises(ValueError, match="watermarking_config=SynthID.* is not supported"):
        SpeculativeDecoder(tiny["target"], None).generate([1, 2], max_new_tokens=2, watermarking_config=synthid)


def test_exponential_decay_without_eos_is_one_clear_error(tiny):
    with pytest.raises(ValueError, match="exponential_decay_length_penalty needs an EOS"):
        specdec.generate([1, 2], target=tiny["target"], max_new_tokens=4, exponential_decay_length_penalty=(1, 2.0))


# ------------------------------------------------------------------ 2. draft_width


def test_draft_width_far_beyond_any_vocabulary_fails_before_loading(monkeypatch):
    monkeypatch.setattr(specdec.loading, "load_model", lambda *a, **k: pytest.fail("loaded before checking arguments"))
    with pytest.raises(ValueError, match="draft_width must be"):
        specdec.generate("hi", target="qwen2.5-coder-1.5b", draft_width=1_000_000)


def test_draft_width_above_the_vocabulary_is_refused(tiny):
    decoder = SpeculativeDecoder(tiny["target"], tiny["draft"])
    with pytest.raises(ValueError, match=f"draft_width={VOCAB + 1} exceeds the target's vocabulary"):
        decoder.generate([1, 2], max_new_tokens=4, num_draft_tokens=3, temperature=0, draft_width=VOCAB + 1)


def test_draft_width_whose_tree_outgrows_memory_is_refused(tiny, monkeypatch):
    monkeypatch.setattr(trees_module, "MAX_TREE_LOGITS_BYTES", 4 * VOCAB * 3 * 5)  # 5 columns per draft
    decoder = SpeculativeDecoder(tiny["target"], tiny["draft"])
    with pytest.raises(ValueError, match="draft_width=8 .*num_draft_tokens=3.* bytes of logits"):
        decoder.generate([1, 2], max_new_tokens=4, num_draft_tokens=3, temperature=0, draft_width=8)
    out = decoder.generate([1, 2], max_new_tokens=4, num_draft_tokens=3, temperature=0, draft_width=4)
    assert out.token_ids == reference(tiny["target"], [1, 2], 4)


# ------------------------------------------------------------------ 3. a custom drafter's proposals


class FixedDrafter:
    """A user's drafter, nothing but propose, proposing whatever it was built with."""

    def __init__(self, make):
        self.make = make

    def propose(self, sequences, max_lengths, warping, generator, race=None):
        return self.make(len(sequences), max_lengths)


def _proposal(token):
    return lambda batch, lengths: Proposal(torch.full((batch, 1), token), lengths.clamp(max=1), None)


@pytest.mark.parametrize(
    "make, message",
    [
        (_proposal(VOCAB), f"token id {VOCAB} outside the target's vocabulary"),
        (_proposal(-1), "token id -1 outside the target's vocabulary"),
        (lambda batch, lengths: None, "returned None"),
        (lambda batch, lengths: (torch.zeros(batch, 1), None), "returned tuple"),
        (lambda batch, lengths: Proposal([[1]] * batch, torch.ones(batch), None), "tokens must be"),
        (lambda batch, lengths: Proposal(torch.ones(batch, 1).float(), torch.ones(batch), None), "tokens must be"),
        (lambda batch, lengths: Proposal(torch.ones(batch, 9, dtype=torch.long), lengths + 5, None), "lengths \\[6\\]"),
        (lambda batch, lengths: Proposal(torch.ones(batch, 1, dtype=torch.long), lengths, torch.ones(1)), "probs"),
    ],
)
def test_a_custom_drafters_bad_proposal_is_one_error_naming_it(tiny, make, message):
    decoder = SpeculativeDecoder(tiny["target"], FixedDrafter(make))
    with pytest.raises(ValueError, match=f"drafter FixedDrafter.*{message}"):
        decoder.generate([1, 2], max_new_tokens=4, num_draft_tokens=1, temperature=0)


def test_a_custom_drafters_good_proposal_still_runs(tiny):
    decoder = SpeculativeDecoder(tiny["target"], FixedDrafter(_proposal(VOCAB - 1)))
    out = decoder.generate([1, 2], max_new_tokens=6, num_draft_tokens=1, temperature=0)
    assert out.token_ids == reference(tiny["target"], [1, 2], 6)


# ------------------------------------------------------------------ 4. chats and chat templates


@pytest.mark.parametrize(
    "chat, message",
    [
        ([{"role": "user"}], "message 0 has no 'content'"),
        ([{"content": "hi"}], "message 0 has no 'role'"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "message 1's content"),
        ([{"role": "user", "content": b"hi"}], "message 0's content"),
    ],
)
def test_a_chat_message_without_role_or_text_is_refused(tiny, chat, message):
    decoder = SpeculativeDecoder(tiny["target"], None, tiny["tokenizer"])
    with pytest.raises(ValueError, match=message):
        decoder.generate(chat, max_new_tokens=2)


def test_a_broken_chat_template_file_is_one_line_naming_the_template(tiny, tmp_path):
    shutil.copytree(tiny["dir"], tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }{% endfor %}")
    with pytest.raises(
        ValueError, match=r"chat template .*model' is not valid Jinja \(line 1: unexpected '}'\)"
    ) as error:
        specdec.generate("hi", target=str(tmp_path / "model"), chat=True, max_new_tokens=2)
    assert "\n" not in str(error.value)


def test_a_chat_template_that_raises_is_one_clear_error(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny["dir"])
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    with pytest.raises(ValueError, match="chat template .* refused these messages: Conversation roles must alternate"):
        SpeculativeDecoder(tiny["target"], None, tokenizer).generate("hi", chat=True, max_new_tokens=2)


# ------------------------------------------------------------------ 5. - 10. single arguments


def test_an_empty_eos_list_is_refused(tiny):
    with pytest.raises(ValueError, match=r"eos_token_id must be a token id or a non-empty list"):
        specdec.generate([1, 2], target=tiny["target"], max_new_tokens=4, eos_token_id=[])


@pytest.mark.parametrize("prompt", [b"hello", b"\x01\x02", [b"\x01\x02"], bytearray(b"\x01")])
def test_bytes_prompts_are_refused_with_a_decode_hint(tiny, prompt):
    with pytest.raises(ValueError, match=r"bytes.*\.decode\(\)"):
        specdec.generate(prompt, target=tiny["target"], max_new_tokens=2)


def test_a_non_bool_chat_is_refused(tiny):
    with pytest.raises(ValueError, match="chat must be True or False"):
        SpeculativeDecoder(tiny["target"], None).generate([1, 2], max_new_tokens=2, chat="yes")
    with pytest.raises(ValueError, match="chat must be True or False"):
        specdec.generate([1, 2], target=tiny["target"], max_new_tokens=2, chat=1)


def test_a_non_callable_progress_is_refused(tiny):
    with pytest.raises(ValueError, match="progress must be a callable"):
        SpeculativeDecoder.from_pretrained(tiny["dir"], progress=5)
    with pytest.raises(ValueError, match="progress must be a callable"):
        specdec.generate([1, 2], target=tiny["dir"], max_new_tokens=2, progress=5)


@pytest.mark.parametrize("size, message", [(VOCAB + 40, "more tokens"), (VOCAB // 3, "another vocabulary")])
def test_a_tokenizer_of_another_vocabulary_is_refused(tiny, tmp_path, size, message):
    save_char_tokenizer(tmp_path, vocab=size)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"tokenizer .*{message}"):
        SpeculativeDecoder(tiny["target"], None, tokenizer).generate("hi", max_new_tokens=2)
    with pytest.raises(ValueError, match=f"tokenizer .*{message}"):
        specdec.generate([1, 2], target=tiny["target"], tokenizer=tokenizer, max_new_tokens=2)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0, -1.0, "x", True])
@pytest.mark.parametrize("field", ["repetition_penalty", "encoder_repetition_penalty"])
def test_a_penalty_that_is_not_a_finite_positive_number_is_refused(tiny, field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number > 0"):
        SpeculativeDecoder(tiny["target"], None).generate([1, 2], max_new_tokens=2, **{field: value})


@pytest.mark.parametrize(
    "settings",
    [
        {"min_p": math.nan},
        {"top_h": math.nan},
        {"typical_p": math.inf},
        {"typical_p": math.nan},
        {"typical_p": 2.0},
        {"epsilon_cutoff": math.nan},
        {"epsilon_cutoff": -1.0},
        {"eta_cutoff": math.inf},
        {"eta_cutoff": 1.5},
        {"exponential_decay_length_penalty": (2, math.inf)},
        {"exponential_decay_length_penalty": (2, math.nan)},
        {"exponential_decay_length_penalty": 3.0},
        {"sequence_bias": [[[5], math.nan]]},
        {"no_repeat_ngram_size": math.nan},
        {"encoder_no_repeat_ngram_size": -1},
        {"min_new_tokens": math.inf},
        {"min_length": "x"},
        {"renormalize_logits": "yes"},
        {"suppress_tokens": [1.5]},
        {"forced_eos_token_id": -3},
    ],
)
def test_other_non_finite_or_out_of_range_values_are_refused_by_name(tiny, settings):
    (field,) = settings
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SpeculativeDecoder(tiny["target"], None).generate([1, 2], max_new_tokens=2, **settings)


def test_a_nan_temperature_says_it_must_be_a_finite_number(tiny):
    target = tiny["target"]
    message = r"temperature must be a finite number >= 0"
    with pytest.raises(ValueError, match=message):
        specdec.generate([1, 2], target=target, max_new_tokens=2, temperature=math.nan)
    saved = target.generation_config
    target.generation_config = GenerationConfig(temperature=math.nan, do_sample=True)
    try:
        with pytest.raises(ValueError, match=message):
            specdec.generate([1, 2], target=target, max_new_tokens=2)
    finally:
        target.generation_config = saved


@pytest.mark.parametrize("field, value", [("num_beams", 4), ("dola_layers", "high"), ("guidance_scale", 2.0)])
def test_a_decoding_mode_set_in_the_models_own_config_is_refused_by_name(tiny, field, value):
    # generate() would beam-search (or DoLa, or CFG) with it; specdec would silently decode greedily.
    import copy

    from specdec.verify.sampling import MODEL_MODES

    target = copy.deepcopy(tiny["target"])
    setattr(target.generation_config, field, value)
    decoder = SpeculativeDecoder(target, None)
    with pytest.raises(ValueError, match=f"generation_config sets {field}="):
        decoder.generate([1, 2, 3], max_new_tokens=4, temperature=0)
    if MODEL_MODES[field] is not None:  # the neutral value, passed explicitly, overrides it
        out = decoder.generate([1, 2, 3], max_new_tokens=4, temperature=0, **{field: MODEL_MODES[field]})
        assert len(out.token_ids) == 4
