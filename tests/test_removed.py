"""Levers removed because their measured gain was at noise level (docs/FEATURES.md): each removed
keyword or flag is refused in one line that says what to do instead, never silently ignored."""

import pytest
from typer.testing import CliRunner

import specdec
from specdec import SpeculativeDecoder
from specdec.config import REMOVED
from specdec_cli.app import app
from tests.tiny import build

KEYWORDS = {"draft_vocab": 65536, "draft_mode": "intersection"}  # each removed keyword, with a value it once took
FLAGS = {"--draft-vocab": "65536", "--draft-mode": "intersection"}


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("removed")
    return SpeculativeDecoder(build("llama", 0, root / "target", layers=1), build("llama", 1, root / "draft", layers=1))


def test_every_removed_keyword_is_listed_with_its_flag():
    assert set(KEYWORDS) == set(REMOVED)
    assert set(FLAGS) == {"--" + name.replace("_", "-") for name in REMOVED}


def assert_refused(error: pytest.ExceptionInfo, name: str) -> None:
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{name} was removed") and "docs/FEATURES.md" in message and "drop it" in message


@pytest.mark.parametrize("name", KEYWORDS)
def test_one_shot_generate_refuses_a_removed_keyword_before_loading(name):
    with pytest.raises(ValueError) as error:
        specdec.generate("hi", target="/no/such/target", draft="/no/such/draft", **{name: KEYWORDS[name]})
    assert_refused(error, name)


@pytest.mark.parametrize("name", KEYWORDS)
@pytest.mark.parametrize("value", ["taken", None])  # the old default is refused too: the keyword is gone
def test_from_pretrained_refuses_a_removed_keyword_before_loading(name, value):
    value = KEYWORDS[name] if value == "taken" else value
    with pytest.raises(ValueError) as error:
        SpeculativeDecoder.from_pretrained("/no/such/target", "/no/such/draft", **{name: value})
    assert_refused(error, name)


def test_from_pretrained_still_reports_an_unknown_keyword_as_python_does():
    with pytest.raises(TypeError, match="from_pretrained\\(\\) got an unexpected keyword argument 'draft_vocabulary'"):
        SpeculativeDecoder.from_pretrained("/no/such/target", draft_vocabulary=3)


@pytest.mark.parametrize("name", KEYWORDS)
def test_a_decoders_generate_refuses_a_removed_keyword(decoder, name):
    with pytest.raises(ValueError) as error:
        decoder.generate([1, 2, 3], max_new_tokens=2, **{name: KEYWORDS[name]})
    assert_refused(error, name)


@pytest.mark.parametrize("flag", FLAGS)
def test_the_cli_refuses_a_removed_flag_in_one_line_before_loading(flag):
    result = CliRunner().invoke(app, ["generate", "Hi", "--target", "/no/such/target", flag, FLAGS[flag]])
    assert result.exit_code == 2 and "Traceback" not in result.output
    line = " ".join(result.output.split())  # the terminal may wrap it
    assert f"error: {flag} was removed" in line and "docs/FEATURES.md" in line and "drop it" in line
