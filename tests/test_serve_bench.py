"""The serving benchmark (specdec.bench.serve): its clients against the real server, its figures, and
(slow) the whole run on tiny models: specdec serve with and without a draft, and transformers serve."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from specdec import SpeculativeDecoder
from specdec.bench import serve as bench
from tests.test_serve import CHAT_TEMPLATE, MODEL, live
from tests.tiny import build, save_char_tokenizer


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-bench")
    build("llama", 0, root / "target", layers=2)
    build("llama", 1, root / "draft", layers=1)
    save_char_tokenizer(root / "target")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    tokenizer.chat_template = CHAT_TEMPLATE  # the bench asks through /v1/chat/completions
    tokenizer.save_pretrained(root / "target")
    return root / "target", root / "draft"


def test_a_cell_streams_each_prompt_once_through_n_clients_and_reads_usage_and_acceptance(pair):
    target, draft = pair
    decoder = SpeculativeDecoder.from_pretrained(str(target), draft=str(draft), dtype="float32", device="cpu")
    prompts = list(bench.PROMPTS[:5])
    alone = {
        p: decoder.generate([{"role": "user", "content": p}], chat=True, max_new_tokens=6, temperature=0).text
        for p in prompts
    }
    with live(decoder, max_batch=2) as base:
        records, wall = asyncio.run(bench.run_cell(base, MODEL, 2, prompts, 6, "chat", 60, 30))
        completions, _ = asyncio.run(bench.run_cell(base, MODEL, 1, prompts[:1], 6, "completions", 60, 30))
    assert sorted(r["index"] for r in records) == list(range(5)) and {r["client"] for r in records} == {0, 1}
    assert all(r["ok"] and r["completion_tokens"] == 6 and 0 < r["ttft_s"] <= r["latency_s"] for r in records)
    assert all(r["chars"] == len(alone[r["prompt"]]) for r in records)  # the whole reply was streamed
    assert all(r["specdec"]["rounds"] >= 1 for r in records) and 0 < wall
    assert completions[0]["ok"] and completions[0]["completion_tokens"] == 6
    summary = bench.cell_summary(records, wall)
    assert summary["completion_tokens"] == 30 and summary["tokens_per_second"] == pytest.approx(30 / wall)
    assert 0 <= summary["acceptance_rate"] <= 1 and summary["mean_acceptance_length"] >= 1


def test_a_failed_request_is_counted_and_the_cell_goes_on():
    records, _ = asyncio.run(bench.run_cell("http://127.0.0.1:9", "m", 2, ["a", "b", "c"], 4, "chat", 30, 2))
    assert len(records) == 3 and not any(r["ok"] for r in records) and all("Error" in r["error"] for r in records)
    assert bench.cell_summary(records, 1.0) | {"wall_s": 0} == {
        "requests": 3,
        "completed": 0,
        "errors": 3,
        "completion_tokens": 0,
        "wall_s": 0,
        "tokens_per_second": 0.0,
    }


def _cell(server, clients, repeat, rate, latencies, extra=None):
    records = [
        {"ok": True, "latency_s": x, "ttft_s": x / 4, "completion_tokens": 10, "specdec": extra} for x in latencies
    ]
    summary = {"tokens_per_second": rate, "requests": len(records), "errors": 0}
    return {"server": server, "clients": clients, "repeat": repeat, "summary": summary, "records": records}


def test_summary_takes_the_median_rate_pools_latencies_and_states_the_ratios():
    accepted = {"drafted_tokens": 10, "accepted_tokens": 5, "rounds": 5}
    cells = [
        _cell("specdec", 1, 0, 30.0, [1.0, 2.0], accepted),
        _cell("specdec", 1, 1, 10.0, [3.0, 4.0], accepted),
        _cell("specdec", 1, 2, 20.0, [5.0], accepted),
        _cell("transformers", 1, 0, 8.0, [2.0]),
        _cell("specdec-nodraft", 1, 0, 16.0, [2.0]),
    ]
    summary = bench.summarise(cells)
    row = summary["specdec"]["1"]
    assert row["tokens_per_second"] == 20.0 and (row["tokens_per_second_min"], row["tokens_per_second_max"]) == (10, 30)
    assert row["p50_latency_s"] == 3.0 and row["p95_latency_s"] == pytest.approx(4.8) and row["repeats"] == 3
    assert row["acceptance_rate"] == 0.5 and row["mean_acceptance_length"] == 2.0
    assert "acceptance_rate" not in summary["transformers"]["1"]
    ratios = bench.ratios(summary)
    assert ratios == {"specdec / transformers": {"1": 2.5}, "specdec / specdec-nodraft": {"1": 1.25}}
    assert bench.percentile([], 0.5) is None and bench.percentile([7.0], 0.95) == 7.0


def test_arguments_are_checked():
    args = bench.parse_args(["--clients", "1,2", "--servers", "specdec,transformers", "--max-tokens", "8"])
    assert args.clients == [1, 2] and args.servers == ["specdec", "transformers"] and args.max_tokens == 8
    assert (args.target, args.draft, args.repeats) == (bench.DEFAULT_TARGET, bench.DEFAULT_DRAFT, 3)
    for bad in (["--servers", "vllm"], ["--clients", "0"], ["--prompts", "99"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


@pytest.mark.slow
def test_the_whole_bench_on_tiny_models(pair, tmp_path, capsys):
    """Three servers in subprocesses, one at a time, 1 and 2 clients: a table, JSON, no errors; transformers
    serve runs offline on the local directory with continuous batching (its paged cache bounded: by default
    it takes 60% of the host's RAM on CPU)."""
    target, draft = pair
    out = tmp_path / "serve.json"
    argv = ["--target", str(target), "--draft", str(draft), "--dtype", "float32", "--clients", "1,2"]
    argv += ["--max-tokens", "6", "--prompts", "3", "--repeats", "1", "--warmup-tokens", "2", "--threads", "1"]
    argv += ["--transformers-args", "--cb-num-blocks 16", "--out", str(out), "--log-dir", str(tmp_path / "logs")]
    data = bench.main(argv)
    table = capsys.readouterr().out
    assert json.loads(out.read_text())["summary"] == data["summary"]
    assert set(data["summary"]) == set(bench.SERVERS)
    for server, by_clients in data["summary"].items():
        assert set(by_clients) == {"1", "2"}
        for row in by_clients.values():
            assert row["errors"] == 0 and row["requests"] == 3 and row["tokens_per_second"] > 0
            assert row["mean_completion_tokens"] == 6
            assert ("acceptance_rate" in row) == server.startswith("specdec")
    assert all(s["continuous_batching_used"] is True and "error" not in s for s in data["servers"])
    assert set(data["ratios"]) == {"specdec / transformers", "specdec / specdec-nodraft"}
    assert "| specdec-nodraft | 2 |" in table and "specdec / transformers tokens/s: 1 client:" in table
    assert data["host"]["isa"].keys() == set(bench.ISA_FLAGS) and len(data["host"]["loadavg"]) == 3
    assert data["settings"]["dtype"] == "float32" and all(len(s["starts"]) == 1 for s in data["servers"])
    assert data["cells"][0]["server_rss_mb"] is None or data["cells"][0]["server_rss_mb"] > 0
    assert sys.executable in data["servers"][0]["command"]


def test_transformers_serve_failing_with_continuous_batching_is_retried_without_and_says_so(monkeypatch, tmp_path):
    started = []

    class Fake:
        def __init__(self, spec, log_dir, tag, threads, startup_timeout):
            self.spec, self.tag, self.startup_s, self.log_path = spec, tag, 1.0, log_dir / f"{tag}.log"

        def start(self):
            started.append(self.tag)
            if "--continuous-batching" in self.spec.args:
                raise bench.ServerFailed("paged attention is not supported here")

        def stop(self):
            pass

    monkeypatch.setattr(bench, "Running", Fake)
    monkeypatch.setattr(bench, "warm_up", lambda server, args: None)
    args = bench.parse_args(["--servers", "transformers", "--transformers-args", "--cb-num-blocks 8"])
    args.resolved_dtype = "bfloat16"
    spec = bench.transformers_spec("/models/t", "bfloat16", "cpu", True, ["--cb-num-blocks", "8"])
    record = {"name": "transformers", "starts": []}
    server = bench._start(spec, args, tmp_path, 0, record, lambda line: None)
    assert started == ["transformers-r1", "transformers-r1-nocb"] and server.tag == "transformers-r1-nocb"
    assert spec.continuous_batching is False and "--no-continuous-batching" in spec.args
    assert spec.args[-2:] == ["--cb-num-blocks", "8"] and "--dtype" in spec.args and "bfloat16" in spec.args
    assert "paged attention" in record["note"] and "--no-continuous-batching" in record["command"]
    assert record["starts"] == [{"repeat": 0, "startup_s": 1.0, "log": str(tmp_path / "transformers-r1-nocb.log")}]
