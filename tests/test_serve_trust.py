"""`specdec serve` as a trusted local service: no web page can drive it, every failure is OpenAI's error
body and counted once, /metrics adds up under batching, stop strings never leak, and shutdown ends
every stream cleanly. Each test here failed on the server before these guards (issue 40)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from typer.testing import CliRunner

from specdec.serving.openai_schema import StopTrimmer
from specdec.serving.runners import Completion, Job, Runner
from specdec.serving.server import ServeSettings
from specdec_cli.app import app as cli
from tests import test_serve
from tests.test_serve import (
    COMPLETION,
    MODEL,
    error_of,
    free_port,
    generate,
    live,
    metric,
    slow_target,
    wait_for,
    wait_until_serving,
)

tiny = test_serve.tiny  # the served pair: the same module-scoped fixture, built once for this module


def requests_total(base: str, path: str, code: int) -> float:
    try:
        return metric(base, f'specdec_requests_total{{code="{code}",path="{path}"}}')  # labels sorted
    except AssertionError:  # no such line yet
        return 0.0


# ------------------------------------------------------------------ browser safety


def raw_post(base: str, headers: dict, body: dict | str = COMPLETION) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(base + "/v1/completions", content=content, headers=headers, timeout=30)


def test_a_web_page_cannot_drive_the_server(tiny):
    with live(tiny["decoder"]) as base:
        port = base.rsplit(":", 1)[1]
        # the curl: a rebinding page's Host, a foreign Origin, a "simple" request's Content-Type
        attack = {"Host": f"attacker.example:{port}", "Origin": "http://attacker.example", "Content-Type": "text/plain"}
        assert error_of(raw_post(base, attack), 403)["code"] == "host_not_allowed"
        foreign = {"Origin": "http://attacker.example", "Content-Type": "application/json"}
        assert error_of(raw_post(base, foreign), 403)["code"] == "origin_not_allowed"
        assert error_of(raw_post(base, {"Content-Type": "text/plain"}), 415)["code"] == "unsupported_media_type"
        assert error_of(raw_post(base, {"Content-Type": "application/x-www-form-urlencoded"}), 415)
        preflight = httpx.options(
            base + "/v1/completions",
            headers={"Origin": "http://attacker.example", "Access-Control-Request-Method": "POST"},
        )
        assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
        # a same-origin page, a loopback name with its port, and the openai client still work
        same = {"Origin": base, "Content-Type": "application/json; charset=utf-8"}
        assert raw_post(base, same).status_code == 200
        assert raw_post(base, {"Host": f"localhost:{port}", "Content-Type": "application/json"}).status_code == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="abc", max_tokens=2).usage.completion_tokens == 2
        assert requests_total(base, "/v1/completions", 403) == 3  # the preflight too
        assert requests_total(base, "/v1/completions", 415) == 2


def test_listed_origins_and_hosts_are_served_with_cors(tiny):
    page = "http://app.example:3000"
    with live(tiny["decoder"], allowed_origins=(page,), allowed_hosts=("api.example",)) as base:
        port = base.rsplit(":", 1)[1]
        host = {"Host": f"api.example:{port}"}
        preflight = httpx.options(
            base + "/v1/completions",
            headers={
                **host,
                "Origin": page,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == page
        reply = raw_post(base, {**host, "Origin": page, "Content-Type": "application/json"})
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == page
        # --allowed-hosts replaces the default: loopback names are no longer served
        assert error_of(raw_post(base, {"Content-Type": "application/json"}), 403)["code"] == "host_not_allowed"


# ------------------------------------------------------------------ every failure in OpenAI's body, counted once


def test_deeply_nested_json_is_a_counted_400(tiny):
    with live(tiny["decoder"]) as base:
        reply = httpx.post(base + "/v1/completions", content="[" * 5000, headers={"content-type": "application/json"})
        assert error_of(reply, 400)["code"] == "invalid_json"
        nested = '{"model": "tiny", "prompt": ' + '{"a": ' * 5000 + "1" + "}" * 5001
        assert (
            "nested too deeply"
            in error_of(raw_post(base, {"Content-Type": "application/json"}, nested), 400)["message"]
        )
        assert requests_total(base, "/v1/completions", 400) == 2


def test_an_unexpected_failure_is_a_counted_500_in_openais_schema(tiny, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    with live(tiny["decoder"]) as base:
        monkeypatch.setattr("specdec.serving.server.encode", broken)
        error = error_of(raw_post(base, {"Content-Type": "application/json"}), 500)
        assert error["type"] == "server_error" and "KeyError" in error["message"]
        assert requests_total(base, "/v1/completions", 500) == 1
        monkeypatch.undo()
        assert raw_post(base, {"Content-Type": "application/json"}).status_code == 200  # it goes on


def test_a_non_streamed_request_whose_client_left_is_counted_499(tiny):
    with live(tiny["decoder"]) as base, slow_target(tiny, 0.02):
        with pytest.raises(httpx.ReadTimeout):
            body = {**COMPLETION, "max_tokens": 300, "temperature": 0}
            httpx.post(base + "/v1/completions", json=body, timeout=0.3)
        wait_for(lambda: requests_total(base, "/v1/completions", 499) == 1)
        assert metric(base, "specdec_requests_cancelled_total") == 1


# ------------------------------------------------------------------ metrics that add up under batching


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_busy_time_is_wall_time_not_the_sum_over_a_batchs_rows(tiny):
    """Each target forward advances a fake clock by 1 s. Eight concurrent requests share their rounds, so
    the server was busy for exactly the forwards' seconds; the sum of the rows' wall times is about 8x."""
    clock, decoder = FakeClock(), tiny["decoder"]
    forwards = []

    def tick(module, args):
        clock.now += 1.0
        forwards.append(1)

    handle = decoder.target.model.register_forward_pre_hook(tick)
    try:
        with live(decoder, clock=clock, max_batch=8) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
            client.completions.create(model=MODEL, prompt="warm", max_tokens=4)  # the session's calibration
            seconds, tokens = (
                metric(base, f"specdec_{n}") for n in ("generation_seconds_total", "generation_tokens_total")
            )
            before = len(forwards)
            barrier = threading.Barrier(8)

            def ask(i: int) -> None:
                barrier.wait()
                client.completions.create(model=MODEL, prompt=f"row {i} ", max_tokens=40, temperature=0)

            threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            busy = metric(base, "specdec_generation_seconds_total") - seconds
            assert busy == len(forwards) - before  # every forward ran while busy, and only once counted
            assert metric(base, "specdec_generation_tokens_total") - tokens == 8 * 40
            rate = metric(base, "specdec_tokens_per_second")
            total_seconds, total_tokens = (
                metric(base, f"specdec_{n}") for n in ("generation_seconds_total", "generation_tokens_total")
            )
            assert rate == pytest.approx(total_tokens / total_seconds) and rate > 8 * 40 / busy / 2
    finally:
        handle.remove()


def test_retry_after_comes_from_busy_seconds_per_finished_request(tiny):
    runner = Runner(tiny["decoder"], max_queue=1)
    runner.metrics.runs, runner.metrics.busy.total = 8, 4.0  # 8 requests ended over 4 busy seconds
    completion = Completion([5, 6], 4, None, None, None, [], frozenset())
    loop = None
    runner.submit(Job(completion, loop))
    with pytest.raises(Exception) as refused:
        runner.submit(Job(completion, loop))
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}  # 0.5 s x 2 ahead: 1 s
    runner.metrics.busy.total = 40.0
    with pytest.raises(Exception) as refused:
        runner.submit(Job(completion, loop))
    assert refused.value.headers == {"Retry-After": "10"}


def test_retry_after_follows_the_pace_of_the_last_jobs_not_the_average_since_start(tiny):
    """The report: 60 requests served one by one, then 40 admitted ones ended in 5.5 s as a batch, and
    Retry-After still said 53 s (the average since start). It now prices the last jobs' spacing."""
    runner = Runner(tiny["decoder"], max_queue=32)
    runner.metrics.runs, runner.metrics.busy.total = 76, 60 * 1.3 + 5.5  # 60 alone at 1.3 s, then 16 batched
    runner.metrics.ends.extend(60 * 1.3 + 5.5 * i / 15 for i in range(16))  # 16 ends over the last 5.5 s
    completion = Completion([5, 6], 4, None, None, None, [], frozenset())
    for _ in range(32):
        runner.submit(Job(completion, None))
    with pytest.raises(Exception) as refused:
        runner.submit(Job(completion, None))
    assert refused.value.headers == {"Retry-After": str(math.ceil(5.5 / 15 * 33))}  # 33 jobs ahead at 0.37 s: 13 s
    runner.metrics.ends.clear()  # batches of 8 ending together every 2 s: 4 s for 16 jobs, not 15 intervals
    runner.metrics.ends.extend([100.0] * 8 + [102.0] * 8)
    assert runner.metrics.seconds_per_run == 2.0 / 8


# ------------------------------------------------------------------ stop strings that begin in the prompt


def test_a_stop_string_that_begins_in_the_prompt_leaves_nothing_of_it_in_the_reply(tiny):
    prompt = "hello world, "
    text = generate(tiny, prompt, 30).text
    spanning = prompt[-3:] + text[:2]  # begins in the prompt, ends in the reply
    inside = prompt[-1:] + text[:4]
    with live(tiny["decoder"]) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        for stop in (spanning, inside):
            ask = dict(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
            reply = client.completions.create(**ask)
            assert reply.choices[0].text == "" and reply.choices[0].finish_reason == "stop", stop
            chunks = list(client.completions.create(**ask, stream=True))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == ""
            assert chunks[-1].choices[0].finish_reason == "stop"
        # a stop string wholly inside the prompt does not stop the reply
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=["hello"])
        assert whole.choices[0].text == text.split("hello")[0]


def test_a_stop_string_longer_than_a_short_prompt_that_begins_there_leaves_nothing_in_the_reply(tiny):
    prompt = "abc:"  # the reported leak: a prompt shorter than the stop string it begins
    text = generate(tiny, prompt, 12).text
    stop = prompt + text[:2]
    with live(tiny["decoder"]) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        ask = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
        reply = client.completions.create(**ask)
        assert reply.choices[0].text == "" and reply.choices[0].finish_reason == "stop"
        chunks = list(client.completions.create(**ask, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ""


def test_stop_trimmer_cuts_where_a_match_begins_before_the_reply():
    fib = StopTrimmer(["fib(n):\n    if"], before="def fib(n):")  # the reported leak: "\n    if" came back
    assert fib.feed("\n    if") + fib.end() == "" and fib.stopped
    trimmer = StopTrimmer(["7, 8"], before="1, 2, 3, 4, 5, 6, 7")
    assert [trimmer.feed(piece) for piece in (",", " 8", ", 9")] == ["", "", ""] and trimmer.stopped
    paris = StopTrimmer(["Paris"], before="The capital of France is Par")
    assert paris.feed("is.") + paris.end() == "" and paris.stopped
    later = StopTrimmer(["Paris"], before="Par")
    assert later.feed("k and Pa") + later.feed("ris") + later.end() == "k and " and later.stopped
    inside = StopTrimmer(["Par"], before="in Paris")  # wholly before the reply: no stop
    assert inside.feed(" it") + inside.end() == " it" and not inside.stopped


# ------------------------------------------------------------------ the minor items


def test_an_api_key_with_blanks_is_compared_as_the_client_sends_it(tiny):
    with live(tiny["decoder"], api_key=" sesame\n") as base:
        right = openai.OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0)
        assert right.completions.create(model=MODEL, prompt="abc", max_tokens=2).usage.completion_tokens == 2


def test_a_blank_key_and_a_taken_port_are_refused_before_the_models_load(tmp_path):
    missing = str(tmp_path / "no-such-model")  # loading it would fail with another message
    result = CliRunner().invoke(cli, ["serve", "--target", missing, "--api-key", "  "])
    assert result.exit_code == 2 and "API key is empty" in result.output, result.output
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = CliRunner().invoke(cli, ["serve", "--target", missing, "--port", port])
    assert result.exit_code == 2 and f"cannot serve on 127.0.0.1:{port}" in result.output, result.output


def test_a_client_trickling_headers_or_body_is_dropped(tiny):
    with live(tiny["decoder"], read_timeout=0.5) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
            idle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
            assert idle.recv(1024) == b""  # closed by the server (the socket's own 10 s would raise)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
            head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            slow.sendall((head + "Content-Length: 100\r\n\r\n{").encode())
            answer = b""
            while b"request_timeout" not in answer and (part := slow.recv(4096)):
                answer += part
            answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408") and "request_timeout" in answer
        assert httpx.get(base + "/health").status_code == 200


# ------------------------------------------------------------------ clean shutdown


def test_sigint_ends_every_open_stream_with_an_error_event_and_done_and_logs_no_traceback(tiny, tmp_path):
    port = free_port()
    command = [sys.executable, "-c", "from specdec_cli.app import main; main()", "serve", "--target", tiny["dir"]]
    command += ["--draft", "none", "--dtype", "float32", "--device", "cpu", "--port", str(port), "--max-batch", "4"]
    command += ["--served-model-name", MODEL, "--shutdown-timeout", "0"]
    log = open(tmp_path / "log", "w+b")
    process = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log, stderr=log)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(process, base, lambda: open(tmp_path / "log").read())
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
        outcomes, first_chunks = {}, threading.Semaphore(0)

        def stream(i: int) -> None:
            try:
                chunks = client.completions.create(model=MODEL, prompt=f"s{i} ", max_tokens=480, stream=True)
                for n, _ in enumerate(chunks):
                    if n == 0:
                        first_chunks.release()
                outcomes[i] = "finished"
            except openai.APIStatusError as error:  # a 503 before any chunk (a queued request)
                outcomes[i] = ("status", error.status_code)
                first_chunks.release()
            except openai.APIError as error:  # the error event inside the stream
                outcomes[i] = ("event", type(error).__name__, str(error))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for _ in range(4):  # the four in the batch are streaming
            assert first_chunks.acquire(timeout=30)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        for thread in threads:
            thread.join(10)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = open(tmp_path / "log").read()
    assert "Traceback" not in text and "Exception in ASGI application" not in text, text
    cut = [o for o in outcomes.values() if o != "finished"]
    assert len(outcomes) == 6 and cut, outcomes
    for outcome in cut:  # never APIConnectionError: each stream got the error event, or a clean 503
        assert outcome == ("status", 503) or (outcome[0] == "event" and "shut down" in outcome[2]), outcome
        assert "APIConnectionError" not in str(outcome)


def test_settings_refuse_a_bare_origin():
    with pytest.raises(ValueError, match="scheme://host"):
        ServeSettings(model=MODEL, allowed_origins=("app.example",))


@pytest.mark.parametrize(("max_batch", "expected"), [("8", "float32"), ("1", "auto")])
def test_serve_resolves_auto_dtype_for_batched_rows_where_bf16_is_not_native(monkeypatch, max_batch, expected):
    # A server's forwards carry up to --max-batch rows: wide, so bfloat16 only where it is native; alone
    # (--max-batch 1) it keeps "auto", which gives a target without a draft bfloat16 (one-token forwards).
    monkeypatch.setattr("specdec.models.forms.native_bf16", lambda: False)
    seen = []

    def load(target, draft, dtype, *rest, **options):
        seen.append(dtype)
        raise ValueError("stop before loading")

    monkeypatch.setattr("specdec_cli.serve.load_decoder", load)
    result = CliRunner().invoke(
        cli, ["serve", "--target", "t", "--draft", "none", "--device", "cpu", "--max-batch", max_batch]
    )
    assert result.exit_code == 2 and "stop before loading" in result.output, result.output
    assert seen == [expected]
