"""Hostile inputs to the `specdec` CLI (issue 32): each gets one clear line on stderr and a non-zero
exit, before any model is loaded where it can be; pipes and second interrupts end quietly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import specdec
from specdec import SpeculativeDecoder
from specdec_cli.app import app
from tests.tiny import build, save_char_tokenizer

runner = CliRunner()
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
SPECDEC = str(Path(sys.executable).parent / "specdec")


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny target whose tokenizer has a chat template (for `specdec chat`)."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("hostile") / "target"
    build("llama", 0, directory, layers=2)
    save_char_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture
def loads(monkeypatch):
    """Every model load attempted; none happens (each answers with an error)."""
    seen = []

    def refuse(*args, **kwargs):
        seen.append(args)
        raise ValueError("a model was loaded")

    monkeypatch.setattr(SpeculativeDecoder, "from_pretrained", refuse)
    monkeypatch.setattr("specdec.bench.main.run_benchmark", refuse)
    return seen


def one_error_line(result, *words):
    assert result.exit_code == 2, result.output
    assert result.output.count("error:") == 1 and "Traceback" not in result.output, result.output
    line = next(line for line in result.output.splitlines() if "error:" in line)
    for word in words:
        assert word in line, line


# ------------------------------------------------------------------ 1. bench --out is checked first


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_bench_refuses_an_unwritable_out_before_running(tmp_path, loads, where):
    existing = tmp_path / "bench.json"
    existing.write_text("{}")
    out = existing if where == "a file" else existing / "results"
    result = runner.invoke(app, ["bench", "--target", "t", "--draft", "none", "--out", str(out)])
    one_error_line(result, "--out", str(out))
    assert loads == []


# ------------------------------------------------------------------ 2. bench --from-json of the wrong shape


@pytest.mark.parametrize("export", [None, "vllm"])
@pytest.mark.parametrize(
    "content",
    [
        "[1, 2]",
        '"bench"',
        '{"summary": {}}',
        '{"settings": {"draft": "d"}, "summary": {"specdec_k2": {"tokens_per_second": 3.0}}}',
        '{"settings": {"target": "t", "draft": "d"}, "summary": {"specdec_k2": {"speedup_vs_target": 1.0}}}',
        '{"settings": {"target": "t", "draft": "d"}, "summary": ["specdec_k2"]}',
    ],
)
def test_bench_from_json_of_the_wrong_shape_is_one_line(tmp_path, content, export):
    path = tmp_path / "bench.json"
    path.write_text(content)
    result = runner.invoke(app, ["bench", "--from-json", str(path), *(["--export", export] if export else [])])
    one_error_line(result, str(path))


def test_bench_from_json_of_the_right_shape_still_exports(tmp_path):
    path = tmp_path / "bench.json"
    summary = {"specdec_k2": {"tokens_per_second": 3.0, "speedup_vs_target": 1.5}}
    path.write_text(json.dumps({"settings": {"target": "t", "draft": "d"}, "summary": summary}))
    result = runner.invoke(app, ["bench", "--from-json", str(path), "--export", "vllm"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["num_speculative_tokens"] == 2


# ------------------------------------------------------------------ 3. chat checks its options first


@pytest.mark.parametrize("args, flag", [(["-k", "0"], "--num-draft-tokens"), (["--top-p", "5"], "--top-p")])
def test_chat_refuses_bad_options_before_loading(target, loads, args, flag):
    result = runner.invoke(app, ["chat", "--target", target, "-n", "3", *args], input="hi\nthere\n")
    one_error_line(result, flag)
    assert loads == []


# ------------------------------------------------------------------ 4. empty model names


@pytest.mark.parametrize(
    "command, flag",
    [
        (["generate", "Hi", "--target", ""], "--target"),
        (["generate", "Hi", "--target", "TARGET", "--draft", ""], "--draft"),
        (["chat", "--target", ""], "--target"),
        (["chat", "--target", "TARGET", "--draft", ""], "--draft"),
        (["bench", "--target", ""], "--target"),
        (["bench", "--target", "t", "--draft", ""], "--draft"),
    ],
)
def test_an_empty_model_name_is_refused(target, loads, command, flag):
    result = runner.invoke(app, [target if a == "TARGET" else a for a in command], input="hi\n")
    one_error_line(result, flag, "empty")
    assert loads == []


# ------------------------------------------------------------------ 5. a closed pipe


def test_a_closed_stdout_pipe_ends_quietly(target):
    read, write = os.pipe()
    command = [SPECDEC, "generate", "Hello", "--target", target, "-n", "40", "--dtype", "float32", "--no-chat"]
    process = subprocess.Popen(command, stdout=write, stderr=subprocess.PIPE, env=os.environ | {"OMP_NUM_THREADS": "1"})
    os.close(write)
    os.close(read)  # `| head -c 0`: the reader is gone before the first token
    _, stderr = process.communicate(timeout=120)
    stderr = stderr.decode()
    assert process.returncode == 1, stderr  # typer's (and Python's documented) exit for EPIPE
    for noise in ("Broken pipe", "error", "Traceback", "Exception ignored"):
        assert noise not in stderr, stderr


def test_the_process_ends_at_once_with_its_output_whole_and_its_exit_code(target):
    """main() ends the process with os._exit once the command is done: buffered output must be out first."""
    command = [SPECDEC, "generate", "Hello", "--target", target, "-n", "6", "--dtype", "float32", "--no-chat", "--json"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["token_ids"]) == 6  # a pipe is block-buffered: all of it was flushed
    refused = subprocess.run([*command, "--temperature", "-1"], capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and refused.stdout == "" and "temperature" in refused.stderr.lower()


# ------------------------------------------------------------------ 6. a second Ctrl-C


SECOND_CTRL_C_AT_EXIT = """
import atexit, os, signal, sys
import specdec.api
from specdec_cli import app

def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

specdec.api.decode = interrupted
atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))  # a second Ctrl-C while Python shuts down
sys.argv = ["specdec", "generate", "Hi", "--target", sys.argv[1], "-n", "4", "--dtype", "float32", "--no-chat"]
app.main()
"""


def test_a_second_ctrl_c_during_shutdown_exits_130_quietly(target):
    process = subprocess.run(
        [sys.executable, "-c", SECOND_CTRL_C_AT_EXIT, target],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )
    assert process.returncode == 130, process.stderr
    assert "interrupted" in process.stderr
    assert "Exception ignored" not in process.stderr and "Traceback" not in process.stderr, process.stderr


# ------------------------------------------------------------------ 7. --json after Ctrl-C


def test_interrupted_json_has_the_keys_of_a_finished_one(target, monkeypatch):
    args = ["generate", "hi", "--target", target, "-n", "60", "--no-chat", "--json", "-t", "0", "--dtype", "float32"]
    full = json.loads(runner.invoke(app, args).stdout)
    real, calls = specdec.api.decode, []

    def interrupted_clock():
        calls.append(None)
        if len(calls) == 30:  # some rounds in
            raise KeyboardInterrupt
        return float(len(calls))

    def interrupted(target, drafter, rows, plan, watch):
        watch.clock = interrupted_clock
        return real(target, drafter, rows, plan, watch)

    monkeypatch.setattr(specdec.api, "decode", interrupted)
    result = runner.invoke(app, args)
    assert result.exit_code == 130, result.output
    data = json.loads(result.stdout)
    assert set(data) == set(full) | {"interrupted"} and data["interrupted"] is True
    assert 0 < len(data["token_ids"]) < 60
    assert data["token_ids"] == full["token_ids"][: data["metrics"]["generated_tokens"]]
    assert full["text"].startswith(data["text"])


# ------------------------------------------------------------------ 8. chat turns


def chat(target, *extra, input=""):
    return runner.invoke(app, ["chat", "--target", target, "-n", "3", "--dtype", "float32", *extra], input=input)


def test_chat_overflowing_history_suggests_reset(target):
    result = chat(target, input="one\n" + "x" * 600 + "\nthree\n")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "error:" in line)
    assert "exceeds the context" in line and "/reset" in line


def test_chat_strips_carriage_returns(target, monkeypatch):
    seen, lines = [], iter(["hello\r", "/stats\r"])
    real = SpeculativeDecoder.generate

    def spy(self, prompt, **kwargs):
        seen.append([m["content"] for m in prompt])
        return real(self, prompt, **kwargs)

    def windows_input(prompt=""):  # a terminal keeps the \r of a Windows line end (CliRunner's stdin would not)
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    monkeypatch.setattr("builtins.input", windows_input)
    result = chat(target)
    assert result.exit_code == 0, result.output
    assert seen == [["hello"]] and "acceptance rate" in result.output  # /stats\r is still the command


def test_chat_ends_its_line_on_ctrl_d_at_a_terminal(target, monkeypatch):
    monkeypatch.setattr("specdec_cli.app._at_terminal", lambda: True, raising=False)
    result = chat(target, input="")
    assert result.exit_code == 0, result.output
    assert result.stdout == "> \n"


# ------------------------------------------------------------------ a NaN or negative temperature


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_a_temperature_that_is_not_a_finite_number_at_least_0_says_so(target, loads, value):
    result = runner.invoke(app, ["generate", "hi", "--target", target, "--temperature", value])
    one_error_line(result, "temperature must be a finite number >= 0")
    assert not loads  # refused before loading


# ------------------------------------------------------------------ bench suites


def test_bench_suites_run_their_scripts_and_unknown_ones_are_one_line():
    shown = runner.invoke(app, ["bench", "host", "--", "--help"])
    assert shown.exit_code == 0
    unknown = runner.invoke(app, ["bench", "nope"])
    one_error_line(unknown, "unknown bench suite 'nope'", "runs")
    stray = runner.invoke(app, ["bench", "main", "--nope"])
    one_error_line(stray, "unknown option '--nope'")
