"""One config per call and per-row options: a batch whose rows have their own max_new_tokens,
temperature, top-p, seed and stop strings gives each row what it gets alone."""

import pytest

from specdec.config import SpecConfig, check_request
from tests.tiny import hf_greedy, noisy_pair

PROMPTS = ["a b c a b", "hello world", "xyz xyz"]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return noisy_pair(tmp_path_factory.mktemp("rows"))


@pytest.mark.parametrize("width", [1, "auto"])
def test_rows_with_their_own_settings_get_what_each_gets_alone(decoder, width):
    # Greedy, and seeded race sampling at two temperatures / top-p: keyed noise makes each sampled row's
    # tokens a function of its own seed, so alone and in the batch must agree token for token.
    rows = [
        dict(max_new_tokens=12, temperature=0),
        dict(max_new_tokens=30, temperature=0.7, top_p=0.9, seed=11),
        dict(max_new_tokens=20, temperature=1.3, seed=12, stop=["zz"]),
    ]
    common = dict(verification="race", num_draft_tokens=3, draft_width=width, chat=False)
    together = decoder.generate(PROMPTS, rows=rows, **common)
    for prompt, options, result in zip(PROMPTS, rows, together):
        alone = decoder.generate(prompt, **{**common, **options})
        assert result.token_ids == alone.token_ids, options
        assert result.config["max_new_tokens"] == options["max_new_tokens"] and result.config["seed"] == options.get(
            "seed"
        )
    greedy_ids = decoder.tokenizer(PROMPTS[0])["input_ids"]
    assert together[0].token_ids == hf_greedy(decoder.target.model, greedy_ids, 12)  # greedy inside a sampling batch
    assert together[0].config["sampling"]["do_sample"] is False and together[1].config["sampling"]["top_p"] == 0.9
    assert len(together[0].token_ids) == 12 and len(together[1].token_ids) <= 30


def test_a_row_in_a_batch_with_other_rows_is_keyed_as_alone(decoder):
    options = dict(verification="race", temperature=1.0, num_draft_tokens=2, draft_width=1, chat=False)
    alone = decoder.generate(PROMPTS[1], seed=5, max_new_tokens=16, **options).token_ids
    for others in ([PROMPTS[0]], [PROMPTS[1], PROMPTS[2]]):  # the same prompt twice: still its own key
        batch = decoder.generate(
            [*others, PROMPTS[1]], rows=[*({"seed": 9} for _ in others), {"seed": 5}], max_new_tokens=16, **options
        )
        assert batch[-1].token_ids == alone


def test_row_options_are_checked_by_name(decoder):
    with pytest.raises(ValueError, match="num_draft_tokens cannot differ between rows"):
        decoder.generate(PROMPTS[:2], rows=[{}, {"num_draft_tokens": 2}], max_new_tokens=4)
    with pytest.raises(ValueError, match="one dict of options per prompt"):
        decoder.generate(PROMPTS[:2], rows=[{}], max_new_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        decoder.generate(PROMPTS[:2], rows=[{}, {"top_p": 5}], max_new_tokens=4)
    with pytest.raises(ValueError, match="own seed need verification='race'"):
        decoder.generate(PROMPTS[:2], rows=[{"seed": 1}, {"seed": 2}], max_new_tokens=4, temperature=1.0)


def test_a_spec_config_runs_as_its_keywords_and_is_recorded(decoder):
    config = check_request(
        max_new_tokens=10,
        num_draft_tokens=3,
        stop=None,
        stream=None,
        seed=None,
        temperature=0,
        top_k=None,
        top_p=None,
        do_sample=None,
    )
    assert isinstance(config, SpecConfig)
    by_config = decoder.generate(PROMPTS[0], config=config)
    by_keywords = decoder.generate(PROMPTS[0], max_new_tokens=10, num_draft_tokens=3, temperature=0)
    assert by_config.token_ids == by_keywords.token_ids
    assert by_config.config == by_keywords.config
    assert by_config.config["num_draft_tokens"] == 3 and by_config.config["draft_width"] in (1, "auto")
    assert by_config.config["verification"] == "token" and isinstance(by_config.config["prompt_lookup"], bool)
    with pytest.raises(ValueError, match=r"no options beside it \(got max_new_tokens\)"):
        decoder.generate(PROMPTS[0], config=config, max_new_tokens=3)
    with pytest.raises(ValueError, match="config= takes a SpecConfig .*got dict"):  # not "(got )"
        decoder.generate(PROMPTS[0], config={"max_new_tokens": 3})


def test_a_misspelt_row_option_is_unknown_not_call_wide(decoder):
    with pytest.raises(ValueError, match="unknown generate\\(\\) argument 'temprature'; did you mean temperature"):
        decoder.generate(PROMPTS[:2], rows=[{}, {"temprature": 0.5}], max_new_tokens=4)
    with pytest.raises(ValueError, match="chat cannot differ between rows"):  # a known call-wide option still is
        decoder.generate(PROMPTS[:2], rows=[{}, {"chat": True}], max_new_tokens=4)


def test_spec_config_of_fills_generates_defaults(decoder):
    from specdec import SpecConfig

    config = SpecConfig.of(max_new_tokens=6, temperature=0)
    assert config.k is None and config.verification == "token" and config.max_new_tokens == 6
    assert (
        decoder.generate(PROMPTS[1], config=config).token_ids
        == decoder.generate(PROMPTS[1], max_new_tokens=6, temperature=0).token_ids
    )
    with pytest.raises(ValueError, match="top_p"):
        SpecConfig.of(top_p=3)


def test_a_rows_temperature_overrides_a_greedy_call(decoder):
    # The call says greedy; the row samples at 0.8 with its own seed (race): as that row alone.
    common = dict(verification="race", num_draft_tokens=2, draft_width=1, chat=False, max_new_tokens=16)
    alone = decoder.generate(PROMPTS[1], temperature=0.8, seed=21, **common).token_ids
    rows = decoder.generate(PROMPTS[:2], temperature=0, rows=[{}, {"temperature": 0.8, "seed": 21}], **common)
    assert rows[1].token_ids == alone and rows[1].config["sampling"]["do_sample"] is True
    assert rows[0].token_ids == decoder.generate(PROMPTS[0], temperature=0, **common).token_ids
