"""`specdec serve`: the real server (uvicorn on 127.0.0.1, a free port) driven by the official `openai` client
and by raw HTTP for bad input. Greedy replies equal `decoder.generate` token for token; every fault gets its
status in OpenAI's error schema and leaves the server serving."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from specdec import SpeculativeDecoder
from specdec.serving.openai_schema import APIError, StopTrimmer
from specdec.serving.server import Server, ServeSettings, create_app, run, server_config
from tests.tiny import build, save_char_tokenizer

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
MODEL = "tiny"
POISON = "~"  # a prompt starting with it gets NaN logits from the target (the `poisoned` fixture)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    build("llama", 0, root / "target", layers=2)
    build("llama", 1, root / "draft", layers=1)
    save_char_tokenizer(root / "target")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(root / "target")
    decoder = SpeculativeDecoder.from_pretrained(
        str(root / "target"), draft=str(root / "draft"), dtype="float32", device="cpu"
    )
    return {"dir": str(root / "target"), "decoder": decoder}


@contextmanager
def running(decoder, graceful: float = 2.0, clock=time.monotonic, **settings):
    """The app on uvicorn in a background thread, on a free loopback port: yields its base URL and server."""
    app = create_app(decoder, ServeSettings(model=MODEL, **settings), clock=clock)
    server = Server(server_config(app, host="127.0.0.1", port=0, shutdown_timeout=graceful, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "the server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(10)
        assert not thread.is_alive()


@contextmanager
def live(decoder, **settings):
    with running(decoder, **settings) as (base, _):
        yield base


@pytest.fixture(scope="module")
def url(tiny):
    with live(tiny["decoder"], max_queue=8, max_prompt_tokens=200, max_body_bytes=8192) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def generate(tiny, prompt, n, **options):
    return tiny["decoder"].generate(prompt, max_new_tokens=n, temperature=0, **options)


def post(url, path, body, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=timeout)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def metric(url, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(condition, seconds: float = 60.0) -> None:
    """Until condition() holds, polling: the deadline only ends a test that would hang, so it is long."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@contextmanager
def slow_target(tiny, seconds: float = 0.02, forwards: list | None = None):
    """Each target forward sleeps: a run lasts long enough to queue behind, disconnect from or signal."""

    def hook(module, args):
        time.sleep(seconds)
        if forwards is not None:
            forwards.append(time.monotonic())

    handle = tiny["decoder"].target.model.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@pytest.fixture
def poisoned(tiny):
    """The target returns NaN logits for the rows whose forward feeds a prompt that starts with POISON
    (its id is the first prompt token): a prefill, alone or beside other rows of a batch."""
    mark = tiny["decoder"].tokenizer(POISON)["input_ids"][0]

    def hook(module, args, kwargs, output):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            output.logits[(ids == mark).any(1)] = float("nan")

    handle = tiny["decoder"].target.model.register_forward_hook(hook, with_kwargs=True)
    yield
    handle.remove()


# ------------------------------------------------------------------ exact replies through the openai client


def test_greedy_completion_equals_generate_token_for_token(tiny, client):
    alone = generate(tiny, "def fib(n):", 24)
    reply = client.completions.create(model=MODEL, prompt="def fib(n):", max_tokens=24, temperature=0)
    text = reply.choices[0].text
    assert text == alone.text and tiny["decoder"].tokenizer(text)["input_ids"] == alone.token_ids
    assert reply.usage.completion_tokens == len(alone.token_ids) == 24 and reply.choices[0].finish_reason == "length"
    assert reply.usage.prompt_tokens == len(alone.prompt_ids)
    extra = reply.model_extra["specdec"]  # its own rounds: the batch prices k by its own clocks, so they may differ
    rate = extra["acceptance_rate"]  # null where nothing was drafted
    assert 1 <= extra["rounds"] <= 24 and (rate is None if extra["drafted_tokens"] == 0 else 0 <= rate <= 1)
    assert extra["mean_acceptance_length"] == pytest.approx(24 / extra["rounds"])


def test_token_id_prompt_equals_generate(tiny, client):
    alone = generate(tiny, [5, 6, 7, 8], 12)
    reply = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0)
    assert reply.choices[0].text == alone.text and reply.usage.prompt_tokens == 4


def test_streamed_completion_equals_generate_and_ends_with_usage(tiny, client):
    alone = generate(tiny, "hello world, ", 40)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="hello world, ",
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == alone.text
    assert chunks[-2].choices[0].finish_reason == "length" and "specdec" in chunks[-2].model_extra
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40
    counters = chunks[-1].model_extra["specdec"]  # the row's own rounds (the batch may time some without drafts)
    assert 40 / counters["rounds"] == pytest.approx(counters["mean_acceptance_length"])
    assert 1 <= counters["rounds"] <= 40


def test_stream_is_server_sent_events_ending_with_done(url):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_chat_equals_generate_with_the_chat_template(tiny, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    alone = generate(tiny, messages, 20, chat=True)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    assert reply.choices[0].message.content == alone.text and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(alone.prompt_ids) and reply.object == "chat.completion"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == alone.text
    assert chunks[-1].choices[0].finish_reason == "length" and "specdec" in chunks[-1].model_extra


def test_stop_string_ends_the_reply_and_is_left_out(tiny, client):
    text = generate(tiny, "abc", 30).text
    stop = text[10:12]
    cut = text.find(stop)
    reply = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, temperature=0, stop=[stop])
    assert reply.choices[0].text == text[:cut] and reply.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=30, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == text[:cut]


def test_stop_trimmer_cuts_at_a_stop_split_across_deltas():
    trimmer = StopTrimmer(["END"])
    assert [trimmer.feed(piece) for piece in ("abcE", "N", "Dxyz", "more")] == ["ab", "c", "", ""]
    assert trimmer.stopped and trimmer.end() == ""
    open_ended = StopTrimmer(["END"])
    assert open_ended.feed("xyEN") == "xy" and open_ended.end() == "EN" and not open_ended.stopped


def test_seeded_sampling_repeats(client):
    ask = dict(model=MODEL, prompt="xyz", max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    assert client.completions.create(**ask).choices[0].text == client.completions.create(**ask).choices[0].text


def test_models_health_and_metrics(url, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0)
    text = httpx.get(url + "/metrics").text
    for name in ("requests_total", "generation_tokens_total", "acceptance_rate", "mean_acceptance_length"):
        assert f"# TYPE specdec_{name} " in text
    assert metric(url, 'specdec_requests_total{code="200",path="/v1/completions"}') >= 1
    assert metric(url, "specdec_generation_tokens_total") >= 5 and metric(url, "specdec_tokens_per_second") > 0
    assert 0 <= metric(url, "specdec_acceptance_rate") <= 1 and metric(url, "specdec_mean_acceptance_length") >= 1
    assert metric(url, "specdec_queue_depth") == 0 and metric(url, "specdec_running_batch_size") == 0


# ------------------------------------------------------------------ bad input: 400, 413, 401


COMPLETION = {"model": MODEL, "prompt": "abc", "max_tokens": 4}


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 2),
        ("best_of", 3),
        ("logprobs", 21),  # alternatives past OpenAI's 20
        ("suffix", "x"),
        ("logit_bias", {"5": 10}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", 1),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "xml"}),  # no such format (json_object and json_schema: tests/test_grammar.py)
        ("temprature", 0.5),  # unknown: a misspelling is refused, not ignored
    ],
)
def test_unsupported_or_unknown_field_is_400_naming_it(url, field, value):
    error = error_of(post(url, "/v1/completions", {**COMPLETION, field: value}), 400)
    assert field in error["message"] and error["param"] == field


def test_unsupported_chat_fields_are_400_and_neutral_values_pass(url):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert "tool_choice" in error_of(post(url, "/v1/chat/completions", {**chat, "tool_choice": "auto"}), 400)["message"]
    assert "top_logprobs" in error_of(post(url, "/v1/chat/completions", {**chat, "top_logprobs": 21}), 400)["message"]
    tool_role = {**chat, "messages": [{"role": "tool", "content": "x"}]}
    assert error_of(post(url, "/v1/chat/completions", tool_role), 400)["param"] == "messages.0.role"
    neutral = {**chat, "n": 1, "logprobs": False, "presence_penalty": 0, "response_format": {"type": "text"}}
    assert post(url, "/v1/chat/completions", neutral).status_code == 200


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        ([1, 2], None),
        ({**COMPLETION, "max_tokens": "4"}, "max_tokens"),
        ({**COMPLETION, "temperature": "hot"}, "temperature"),
        ({**COMPLETION, "prompt": 5}, "prompt"),
        ({**COMPLETION, "prompt": ""}, "prompt"),
        ({**COMPLETION, "prompt": []}, "prompt"),
        ({**COMPLETION, "prompt": ["a", "b"]}, "prompt"),
        ({**COMPLETION, "max_tokens": 0}, "max_tokens"),
        ({**COMPLETION, "max_tokens": 600}, "max_tokens"),  # past the 512-token context
        ({**COMPLETION, "model": "gpt-4"}, "model"),
        ({**COMPLETION, "prompt": "x" * 201}, "prompt"),  # over --max-prompt-tokens
        ({**COMPLETION, "stream_options": {"include_usage": True}}, "stream_options"),
        ({**COMPLETION, "temperature": -1}, "temperature"),  # a bad value names its field
        ({**COMPLETION, "top_p": 1.5}, "top_p"),
        ({**COMPLETION, "stop": [""]}, "stop"),
        ({"prompt": "abc"}, "model"),
    ],
)
def test_bad_input_is_400_in_openais_error_schema(url, body, param):
    error = error_of(post(url, "/v1/completions", body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_empty_messages_and_unknown_model_through_the_client_are_400(client):
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=3)
    with pytest.raises(openai.BadRequestError, match="not served here"):
        client.completions.create(model="other", prompt="abc", max_tokens=3)


def test_body_over_the_limit_is_413(url):
    error = error_of(post(url, "/v1/completions", {**COMPLETION, "prompt": "y" * 9000}), 413)
    assert "8192" in error["message"]
    assert error_of(httpx.get(url + "/nowhere"), 404)["type"] == "invalid_request_error"


def test_missing_or_wrong_api_key_is_401(tiny):
    with live(tiny["decoder"], api_key="sesame") as base:
        assert error_of(post(base, "/v1/completions", COMPLETION), 401)["code"] == "invalid_api_key"
        wrong = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=MODEL, prompt="abc", max_tokens=2)
        right = openai.OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0)
        assert right.completions.create(model=MODEL, prompt="abc", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(base + "/health").status_code == 200  # probes need no key


# ------------------------------------------------------------------ queue, disconnects, failures


def test_full_queue_is_429_with_retry_after_and_health_answers_meanwhile(tiny):
    # One request at a time (max_batch=1): the second waits, the third is refused.
    long = {"model": MODEL, "prompt": "slow", "max_tokens": 300, "temperature": 0, "stream": True}
    settings = dict(max_queue=1, max_batch=1)
    with live(tiny["decoder"], **settings) as base, slow_target(tiny), httpx.Client(timeout=30) as http:
        with http.stream("POST", base + "/v1/completions", json=long) as running:
            assert running.status_code == 200  # headers come once the run has committed its first tokens
            waiting = threading.Thread(target=lambda: post(base, "/v1/completions", COMPLETION), daemon=True)
            waiting.start()
            wait_for(lambda: metric(base, "specdec_queue_depth") == 1)
            health = httpx.get(base + "/health", timeout=60).json()  # answered mid-run: it still counts the run
            assert health["running"] == 1 and health["queue_depth"] == 1
            refused = post(base, "/v1/completions", COMPLETION)
            assert error_of(refused, 429)["code"] == "queue_full" and int(refused.headers["retry-after"]) >= 1
        waiting.join(30)  # the stream closed: its run stopped, the waiting request ran
        assert metric(base, "specdec_running_batch_size") == 0


def test_disconnected_client_stops_its_run_within_a_round(tiny):
    forwards: list[float] = []
    long = {"model": MODEL, "prompt": "bye", "max_tokens": 400, "temperature": 0, "stream": True}
    # 100 ms a forward: the disconnect's notice (an event-loop hop) fits in one, on a slow host too
    with live(tiny["decoder"]) as base, slow_target(tiny, 0.1, forwards):
        with httpx.stream("POST", base + "/v1/completions", json=long, timeout=30) as response:
            assert response.status_code == 200
        closed = time.monotonic()
        wait_for(lambda: metric(base, "specdec_running_batch_size") == 0)
        assert metric(base, "specdec_requests_cancelled_total") == 1
        assert metric(base, "specdec_generation_tokens_total") < 100
        after = [t for t in forwards if t > closed]
        # the server hears of the disconnect, then the run stops at its next commit: a round, plus the
        # notice's latency
        assert len(after) <= 5, f"{len(after)} target forwards after the client left"
        with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
            post(base, "/v1/completions", {**long, "stream": False}, timeout=0.3)
        wait_for(lambda: metric(base, "specdec_requests_cancelled_total") == 2)
        assert metric(base, "specdec_running_batch_size") == 0
        # the server goes on
        assert post(base, "/v1/completions", COMPLETION).json()["usage"]["completion_tokens"] == 4


def test_failing_request_is_500_naming_the_cause_and_others_go_on(tiny, url, client, poisoned):
    replies = {}
    asks = {"failing": {**COMPLETION, "prompt": POISON + "abc"}, "normal": {**COMPLETION, "temperature": 0}}
    threads = [
        threading.Thread(target=lambda k=k, b=b: replies.update({k: post(url, "/v1/completions", b)}))
        for k, b in asks.items()
    ]
    for t in threads:  # sent together: one fails, the other is answered
        t.start()
    for t in threads:
        t.join(30)
    error = error_of(replies["failing"], 500)
    assert "NonFiniteLogitsError" in error["message"] and "NaN" in error["message"]
    assert replies["normal"].json()["choices"][0]["text"] == generate(tiny, "abc", 4).text
    with pytest.raises(openai.InternalServerError, match="NaN"):  # streamed: the prefill failed, a plain 500
        list(client.completions.create(model=MODEL, prompt=POISON + "x", max_tokens=4, stream=True))
    assert httpx.get(url + "/health").json()["status"] == "ok" and metric(url, "specdec_requests_failed_total") == 2
    assert client.completions.create(model=MODEL, prompt="after", max_tokens=3).usage.completion_tokens == 3


def own_threads() -> int:
    return sum(not t.name.startswith("asyncio_") for t in threading.enumerate())


def test_bounded_load_with_random_disconnects_leaves_nothing_behind(tiny, url):
    """24 clients, 8 at a time, a third of them leaving mid-stream: each finished reply equals its
    prompt alone; afterwards nothing waits or runs and no thread is left over (beyond the event loop's
    bounded executor, which tokenises prompts)."""
    prompts = [f"p{i} " for i in range(24)]
    expected = {p: generate(tiny, p, 12).text for p in prompts[::3]}
    threads_before = own_threads()
    replies = {}

    def one(i: int, prompt: str) -> None:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": i % 3 != 0}
        if i % 3 == 1:  # leaves once the headers arrive
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30):
                return
        if i % 3 == 0:
            replies[prompt] = post(url, "/v1/completions", body).json()["choices"][0]["text"]

    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for batch in range(0, len(threads), 8):
        for t in threads[batch : batch + 8]:
            t.start()
        for t in threads[batch : batch + 8]:
            t.join(30)
    assert replies == expected
    wait_for(lambda: metric(url, "specdec_running_batch_size") == 0 and metric(url, "specdec_queue_depth") == 0)
    wait_for(lambda: own_threads() <= threads_before)


# ------------------------------------------------------------------ the command and SIGTERM


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_serving(process: subprocess.Popen, base: str, log, seconds: float = 60) -> None:
    """Until the `specdec serve` process answers /health; it must not exit first (log(): what it said)."""
    deadline = time.monotonic() + seconds
    while True:
        assert process.poll() is None, log()
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)


def test_sigterm_stops_accepting_finishes_in_flight_work_and_exits_zero(tiny):
    port = free_port()
    command = [sys.executable, "-c", "from specdec_cli.app import main; main()", "serve", "--target", tiny["dir"]]
    command += ["--draft", "none", "--dtype", "float32", "--device", "cpu", "--port", str(port)]
    command += ["--served-model-name", MODEL, "--shutdown-timeout", "20"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(process, base, lambda: process.stdout.read().decode())
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 400, "temperature": 0}
        assert post(base, "/v1/completions", body).json()["usage"]["completion_tokens"] == 400
        in_flight = {}
        thread = threading.Thread(target=lambda: in_flight.update(r=post(base, "/v1/completions", body)), daemon=True)
        thread.start()
        wait_for(lambda: metric(base, "specdec_running_batch_size") + metric(base, "specdec_queue_depth") == 1, 60)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0, process.stdout.read().decode()
        thread.join(10)
        assert in_flight["r"].status_code == 200 and in_flight["r"].json()["usage"]["completion_tokens"] == 400
        with pytest.raises(httpx.TransportError):
            httpx.get(base + "/health", timeout=1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_taken_port_is_one_clear_error(tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        app = create_app(tiny["decoder"], ServeSettings(model=MODEL))
        with pytest.raises(OSError, match="could not serve on 127.0.0.1"):
            run(app, host="127.0.0.1", port=taken.getsockname()[1], shutdown_timeout=1, log_level="critical")


def _running_and_queued(base: str, stream_body: dict, outcome: dict) -> threading.Thread:
    """One streamed request running (read into outcome["lines"]) and COMPLETION queued behind it (its
    response in outcome["queued"]): returns the queued request's thread once /metrics shows both."""

    def read_stream() -> None:
        try:
            with httpx.stream("POST", base + "/v1/completions", json=stream_body, timeout=60) as response:
                outcome["lines"] = [line for line in response.iter_lines() if line]
        except httpx.TransportError as error:  # the connection closed mid-stream
            outcome["error"] = error

    threading.Thread(target=read_stream, daemon=True).start()
    wait_for(lambda: metric(base, "specdec_running_batch_size") == 1, 60)
    waiting = threading.Thread(target=lambda: outcome.update(queued=post(base, "/v1/completions", COMPLETION, 60)))
    waiting.start()
    wait_for(lambda: metric(base, "specdec_queue_depth") == 1, 60)
    return waiting


def test_shutdown_lets_running_and_queued_requests_finish_within_its_timeout(tiny):
    stream = {"model": MODEL, "prompt": "slow", "max_tokens": 40, "temperature": 0, "stream": True}
    outcome = {}
    with running(tiny["decoder"], graceful=60, max_batch=1) as (base, server), slow_target(tiny):
        waiting = _running_and_queued(base, stream, outcome)
        server.handle_exit(signal.SIGTERM, None)
        wait_for(lambda: not server.config.app.state.runner.accepting, 60)
        with pytest.raises(APIError, match="shutting down"):  # admission has ended for anything new
            server.config.app.state.runner.submit(None)
        waiting.join(60)
    assert outcome["queued"].status_code == 200, outcome["queued"].text
    assert outcome["queued"].json()["choices"][0]["text"] == generate(tiny, "abc", 4).text
    assert outcome["lines"][-1] == "data: [DONE]" and "error" not in outcome["lines"][-2]
    streamed = "".join(json.loads(line[len("data: ") :])["choices"][0]["text"] for line in outcome["lines"][:-1])
    assert streamed == generate(tiny, "slow", 40).text


def test_shutdown_answers_503_to_what_outlives_its_timeout_queued_or_running(tiny):
    stream = {"model": MODEL, "prompt": "slow", "max_tokens": 300, "temperature": 0, "stream": True}
    outcome = {}
    with running(tiny["decoder"], graceful=0.5, max_batch=1) as (base, server), slow_target(tiny, seconds=0.05):
        waiting = _running_and_queued(base, stream, outcome)
        began = time.monotonic()
        server.handle_exit(signal.SIGTERM, None)
        waiting.join(10)
        assert error_of(outcome["queued"], 503)["code"] == "shutting_down"
    assert time.monotonic() - began < 10  # the server thread has ended (running() joined it)
    # cut short at the deadline, and ended cleanly: the error event, then [DONE] (tests/test_serve_trust.py)
    assert json.loads(outcome["lines"][-2][len("data: ") :])["error"]["code"] == "shutting_down"
    assert outcome["lines"][-1] == "data: [DONE]"
    assert generate(tiny, "free", 4).token_ids  # the run let go of the decoder


def test_the_decoder_lock_makes_a_second_app_wait_its_turn(tiny):
    """Two apps on one decoder (two workers): the decoder's lock serialises them, each reply as alone."""
    alone = generate(tiny, "shared", 16).text
    with live(tiny["decoder"]) as first, live(tiny["decoder"]) as second:
        replies = []
        body = {"model": MODEL, "prompt": "shared", "max_tokens": 16, "temperature": 0}
        threads = [
            threading.Thread(target=lambda u=u: replies.append(post(u, "/v1/completions", body).json()))
            for u in (first, second, first, second)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert [r["choices"][0]["text"] for r in replies] == [alone] * 4


# ------------------------------------------------------------------ continuous batching


def test_concurrent_clients_joining_and_leaving_get_what_generate_gives_each_alone(tiny):
    """Clients start at different times, with their own budgets, temperatures and seeds, while others
    decode: greedy replies equal generate() greedy token for token; seeded sampled replies equal
    generate(verification="race", seed=...) alone, whatever else shared their rounds."""
    asks = [
        ("abc", dict(max_tokens=12, temperature=0)),
        ("hello", dict(max_tokens=20, temperature=0.8, seed=7)),
        ("xyz xyz", dict(max_tokens=9, temperature=1.1, top_p=0.9, seed=8)),
        ("one two", dict(max_tokens=16, temperature=0)),
        ("qq", dict(max_tokens=14, temperature=0.6, seed=9)),
        ("the end", dict(max_tokens=6, temperature=0.9, seed=10)),
    ]
    decoder = tiny["decoder"]
    expected = []
    for prompt, options in asks:
        sampling = {k: v for k, v in options.items() if k in ("temperature", "top_p", "seed")}
        out = decoder.generate(prompt, max_new_tokens=options["max_tokens"], verification="race", **sampling)
        expected.append(out.text)
    replies: dict[int, str] = {}
    with live(decoder, max_batch=4) as base, slow_target(tiny, 0.005):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(i: int) -> None:
            prompt, options = asks[i]
            time.sleep(0.03 * i)  # staggered: each joins a batch already decoding
            if i % 2:  # streamed
                chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True, **options)
                replies[i] = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
            else:
                replies[i] = client.completions.create(model=MODEL, prompt=prompt, **options).choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(asks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert metric(base, "specdec_running_batch_size") == 0
    assert [replies[i] for i in range(len(asks))] == expected


def test_a_batch_full_of_work_queues_the_rest_and_refuses_past_the_queue(tiny):
    long = {"model": MODEL, "prompt": "slow", "max_tokens": 200, "temperature": 0, "stream": True}
    with live(tiny["decoder"], max_queue=1, max_batch=2) as base, slow_target(tiny), httpx.Client(timeout=30) as http:
        with (
            http.stream("POST", base + "/v1/completions", json=long) as first,
            http.stream("POST", base + "/v1/completions", json=long) as second,
        ):
            assert first.status_code == 200 and second.status_code == 200
            wait_for(lambda: metric(base, "specdec_running_batch_size") == 2)
            waiting = threading.Thread(target=lambda: post(base, "/v1/completions", COMPLETION), daemon=True)
            waiting.start()
            wait_for(lambda: metric(base, "specdec_queue_depth") == 1)
            refused = post(base, "/v1/completions", COMPLETION)
            assert error_of(refused, 429)["code"] == "queue_full"
        waiting.join(30)  # both streams closed: their rows left, the waiting request ran
        wait_for(lambda: metric(base, "specdec_running_batch_size") == 0)


def test_a_job_between_the_queue_and_the_batch_is_answered_at_shutdowns_deadline(tiny, monkeypatch):
    from specdec.serving import runners

    joining, release = threading.Event(), threading.Event()

    def slow_score(decoder, job):  # the job is out of the queue, not yet in the batch
        joining.set()
        release.wait(30)

    monkeypatch.setattr(runners, "score_prompt", slow_score)
    outcome = {}
    with running(tiny["decoder"], max_batch=4) as (base, server):
        asking = threading.Thread(target=lambda: outcome.update(r=post(base, "/v1/completions", COMPLETION, 60)))
        asking.start()
        assert joining.wait(60)
        server.config.app.state.runner.end_streams()  # the deadline, while it joins
        release.set()
        asking.join(60)
    assert error_of(outcome["r"], 503)["code"] == "shutting_down"
