"""The `specdec` CLI on tiny local models (Typer's CliRunner): output, JSON, and one-line errors."""

import json

import pytest
from typer.testing import CliRunner

from specdec_cli.app import app
from tests.tiny import build, save_char_tokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    dirs = {}
    for name, seed, layers, vocab in (("target", 0, 2, 96), ("draft", 1, 1, 96), ("other", 2, 1, 50)):
        build("llama", seed, root / name, layers=layers, vocab=vocab)
        save_char_tokenizer(root / name, vocab=vocab)
        dirs[name] = str(root / name)
    return dirs


def run(*args):
    return runner.invoke(app, list(args))


def test_json_output_is_one_object_with_text_ids_and_metrics(model_dirs):
    result = run(
        "generate",
        "Hello there",
        "--target",
        model_dirs["target"],
        "--draft",
        model_dirs["draft"],
        "-n",
        "12",
        "-k",
        "3",
        "--dtype",
        "float32",
        "--json",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) >= {"text", "token_ids", "metrics"} and len(data["token_ids"]) == 12
    assert data["metrics"]["generated_tokens"] == 12 and data["metrics"]["drafted_tokens"] > 0


def test_streamed_text_then_summary_table(model_dirs):
    result = run(
        "generate", "abcabcabc", "--target", model_dirs["target"], "--draft", "ngram", "-n", "10", "--dtype", "float32"
    )
    assert result.exit_code == 0, result.output
    assert "acceptance rate" in result.stdout and "mean acceptance length" in result.stdout


def test_cli_matches_library_greedy_output(model_dirs):
    import specdec

    lib = specdec.generate("Hi", target=model_dirs["target"], max_new_tokens=8, dtype="float32", device="cpu")
    cli = json.loads(
        run("generate", "Hi", "--target", model_dirs["target"], "-n", "8", "--dtype", "float32", "--json").stdout
    )
    assert cli["token_ids"] == lib.token_ids


@pytest.mark.parametrize(
    "args, message",
    [
        (["--num-draft-tokens", "0"], "--num-draft-tokens"),
        (["--num-draft-tokens", "lots"], "integer"),
        (["--top-p", "1.5"], "--top-p"),
        (["--dtype", "float8"], "dtype"),
        (["--device", "tpu"], "device"),
        (["--draft", "/no/such/dir"], "no such local model directory"),
        (["--draft", "OTHER"], "disagree"),
    ],
)
def test_user_errors_are_one_line_without_traceback(model_dirs, args, message):
    args = [model_dirs[a.lower()] if a in ("OTHER", "DRAFT") else a for a in args]
    result = run("generate", "Hi", "--target", model_dirs["target"], "-n", "4", *args)
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output


def test_missing_target_path_and_unknown_name(model_dirs, monkeypatch):
    monkeypatch.setattr("specdec.models.resolution._hub_reachable", lambda timeout=3.0: False)
    result = run("generate", "Hi", "--target", "./missing-model")
    assert result.exit_code == 2 and "no such local model directory" in result.output
    result = run("generate", "Hi", "--target", "surely-not-a-model-name")
    assert result.exit_code == 2 and "cannot be reached" in result.output
    assert "qwen2.5-coder-1.5b" in result.output  # lists the aliases


def test_debug_shows_traceback(model_dirs):
    result = run("--debug", "generate", "Hi", "--target", model_dirs["target"], "-k", "0")
    assert result.exit_code == 2 and "Traceback" in result.output


def test_empty_prompt_is_an_error(model_dirs):
    result = runner.invoke(app, ["generate", "--target", model_dirs["target"]], input="")
    assert result.exit_code == 2 and "empty" in result.output


def test_models_list_names_the_aliases():
    result = run("models", "list")
    assert result.exit_code == 0
    for alias in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "smollm2-135m"):
        assert alias in result.stdout


def test_models_fetch_unknown_alias():
    result = run("models", "fetch", "llama-9000")
    assert result.exit_code == 2 and "unknown alias" in result.output and "smollm2-135m" in result.output


def test_bench_writes_json_markdown_and_plots(model_dirs, tmp_path):
    result = run(
        "bench",
        "--target",
        model_dirs["target"],
        "--draft",
        model_dirs["draft"],
        "-n",
        "6",
        "--ks",
        "2",
        "--classes",
        "code",
        "--prompts-per-class",
        "1",
        "--dtype",
        "float32",
        "--ngram",
        "--out",
        str(tmp_path),
    )
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "bench.json").read_text())
    assert {
        "hf_target",
        "hf_assisted",
        "hf_assisted_pinned",
        "hf_prompt_lookup",
        "specdec_target",
        "specdec_k2",
        "specdec_auto",
        "specdec_ngram",
    } <= set(data["summary"])
    assert data["summary"]["specdec_k2"]["bound"] > 0 and data["costs"]["ratio"] > 0
    assert "| specdec_k2 |" in (tmp_path / "bench.md").read_text()
    assert len(list(tmp_path.glob("bench-*.png"))) == 3


def test_bench_rejects_unknown_prompt_class():
    result = run("bench", "--classes", "poetry")
    assert result.exit_code == 2 and "unknown prompt class" in result.output


def test_metrics_table_shows_the_draft_tree_when_there_was_one():
    from rich.console import Console

    from specdec.metrics import SpeculativeMetrics
    from specdec_cli.app import metrics_table

    def rendered(metrics: SpeculativeMetrics) -> str:
        console = Console(record=True, width=120)
        console.print(metrics_table(metrics.to_dict()))
        return console.export_text()

    chain = SpeculativeMetrics(rounds=3, drafted_tokens=6, accepted_tokens=4, generated_tokens=7, wall_time_s=1.0)
    assert "draft tree" not in rendered(chain)
    tree = SpeculativeMetrics(rounds=3, drafted_tokens=6, accepted_tokens=5, generated_tokens=8, wall_time_s=1.0)
    tree.tree_nodes, tree.sibling_tokens = 9, 2
    assert "9 siblings scored, 2 rounds ended on one" in rendered(tree)
    assert "warm-up" not in rendered(tree)
    tree.compile_time_s = 0.75  # shapes captured for the first time in this run
    assert "warm-up (captured shapes)" in rendered(tree) and "0.75s" in rendered(tree)


def test_compile_on_the_cpu_is_one_line_and_refuses_nonsense(model_dirs):
    common = ["generate", "Hello", "--target", model_dirs["target"], "--draft", model_dirs["draft"], "-n", "10"]
    common += ["--dtype", "float32", "--json", "-t", "0", "--device", "cpu"]
    for flags in (["--compile"], ["--compile-mode", "graphs"], ["--compile-mode", "inductor"]):
        refused = run(*common, *flags)  # issue 32: dynamo's output, or "capturing a CUDA graph" on the CPU
        assert refused.exit_code != 0 and "needs CUDA" in refused.output, refused.output
        assert "Traceback" not in refused.output and refused.output.startswith("error:"), refused.output
    bad = run(*common, "--compile-mode", "fast")
    assert bad.exit_code != 0 and "inductor-graphs" in bad.output
    both = run(*common, "--no-compile", "--compile-mode", "graphs")
    assert both.exit_code != 0 and "--no-compile" in both.output
