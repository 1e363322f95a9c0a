"""`specdec bench soak`: `specdec serve` under a long, mixed, hostile load (issue 40). N clients for M
minutes on a small model; every reply is checked against the same request answered alone.

    .venv/bin/specdec bench soak -- --clients 16 --minutes 10 --out scripts/results/soak.json

Words:
- template: one request of a fixed pool (`templates`): greedy completions, seeded sampled ones (race
  verification keyed on the seed: the same tokens in any batch), chat, stop strings (some begin in the
  prompt), each budget its own.
- reference: a template's reply when the server answers it alone, before the load. A reply under load
  that differs from it, streamed or not, is a mismatch (the goal is 0).
- action: what a client does next, drawn from a seeded generator: a template whole (streamed or not),
  a template cancelled (a stream closed after its first chunk, or a plain request given up after a
  moment), or a bad request whose status is known in advance (bad JSON, an unknown field, deep nesting,
  a text/plain body, a foreign Origin, a foreign Host).
- sample: the server process's RSS, open fds and threads, read from /proc every few seconds. Growth is
  measured from the end of the warm-up (the first minute under load) to the end.

At the end the server gets SIGTERM: it must exit 0 with no traceback in its log.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from specdec.bench.host import host_info
from specdec.bench.serve import free_port

MODEL = "soak"
TEXTS = (
    "def fibonacci(n):",
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7",
    "Once upon a time, in a small village,",
    "import numpy as np\n\n",
    "SELECT name FROM users WHERE",
    "Write a haiku about the sea.",
    "The three laws of motion are",
)


def templates() -> list[dict]:
    """The pool: each text greedy and sampled, as completions and chat, some with stop strings."""
    pool = []
    for i, text in enumerate(TEXTS):
        budget = 12 + 7 * i
        pool.append({"path": "/v1/completions", "body": {"prompt": text, "max_tokens": budget, "temperature": 0}})
        sampled = {"prompt": text, "max_tokens": budget, "temperature": 0.9, "top_p": 0.95, "seed": 100 + i}
        pool.append({"path": "/v1/completions", "body": sampled})
        messages = [{"role": "user", "content": text}]
        pool.append(
            {"path": "/v1/chat/completions", "body": {"messages": messages, "max_tokens": 24, "temperature": 0}}
        )
        stops = [text[-3:] + " ", "\n\n"] if i % 2 else [" the", "."]  # odd texts: a stop that begins in the prompt
        pool.append(
            {"path": "/v1/completions", "body": {"prompt": text, "max_tokens": 40, "temperature": 0, "stop": stops}}
        )
    for template in pool:
        template["body"]["model"] = MODEL
    return pool


JSON = {"content-type": "application/json"}
BAD = (  # (path, raw body, headers, the status it must get)
    ("/v1/completions", b"{not json", JSON, 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "temprature": 1}).encode(), JSON, 400),
    ("/v1/completions", b"[" * 5000, JSON, 400),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode(), {"content-type": "text/plain"}, 415),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "x"}).encode(),
        {**JSON, "origin": "http://evil.example"},
        403,
    ),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x"}).encode(), {**JSON, "host": "evil.example"}, 403),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), JSON, 400),
)


def text_of(path: str, reply: dict) -> tuple[str, str]:
    choice = reply["choices"][0]
    text = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    return text, choice["finish_reason"]


async def ask(http: httpx.AsyncClient, template: dict, stream: bool) -> tuple[str, str]:
    """One template's reply: (text, finish_reason), streamed or whole."""
    body = {**template["body"], "stream": stream}
    if not stream:
        response = await http.post(template["path"], json=body)
        response.raise_for_status()
        return text_of(template["path"], response.json())
    pieces, finish = [], None
    async with http.stream("POST", template["path"], json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            for choice in event["choices"]:
                delta = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                pieces.append(delta or "")
                finish = choice.get("finish_reason") or finish
    return "".join(pieces), finish


async def cancel(http: httpx.AsyncClient, template: dict, rng: random.Random) -> None:
    """Leave mid-request: a stream after its first chunk, a plain request after a moment."""
    body = {**template["body"], "stream": rng.random() < 0.5}
    if body["stream"]:
        async with http.stream("POST", template["path"], json=body) as response:
            async for _ in response.aiter_lines():
                return
    try:
        await http.post(template["path"], json=body, timeout=rng.uniform(0.05, 0.5))
    except httpx.TimeoutException:
        pass


class Tally:
    def __init__(self):
        self.served = collections.Counter()  # action -> count
        self.codes = collections.Counter()  # unexpected status -> count
        self.mismatches: list[dict] = []

    def as_dict(self) -> dict:
        return {
            "served": dict(self.served),
            "unexpected_statuses": dict(self.codes),
            "mismatches": len(self.mismatches),
            "mismatch_examples": self.mismatches[:5],
        }


async def client(base: str, pool: list[dict], references: list, deadline: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        while time.monotonic() < deadline:
            roll = rng.random()
            index = rng.randrange(len(pool))
            try:
                if roll < 0.1:
                    path, raw, headers, status = BAD[rng.randrange(len(BAD))]
                    response = await http.post(path, content=raw, headers=headers)
                    tally.served["bad request"] += 1
                    if response.status_code != status:
                        tally.codes[f"bad request: {response.status_code} (expected {status})"] += 1
                elif roll < 0.2:
                    await cancel(http, pool[index], rng)
                    tally.served["cancelled"] += 1
                else:
                    stream = rng.random() < 0.5
                    got = await ask(http, pool[index], stream)
                    tally.served["streamed" if stream else "whole"] += 1
                    if got != references[index]:
                        tally.mismatches.append(
                            {"template": index, "stream": stream, "got": got, "alone": references[index]}
                        )
            except httpx.HTTPStatusError as error:
                tally.codes[str(error.response.status_code)] += 1
            except (httpx.TransportError, RuntimeError) as error:
                tally.codes[type(error).__name__] += 1


def sample(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "t": time.monotonic(),
        "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


async def sampler(pid: int, samples: list, stop: asyncio.Event, every: float) -> None:
    while not stop.is_set():
        samples.append(sample(pid))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except TimeoutError:
            pass


async def soak(base: str, pid: int, args) -> dict:
    pool = templates()
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:  # each template alone, one at a time
        references = [await ask(http, template, stream=False) for template in pool]
    tally, samples, stop = Tally(), [], asyncio.Event()
    watcher = asyncio.create_task(sampler(pid, samples, stop, args.sample_every))
    began = time.monotonic()
    deadline = began + 60 * args.minutes
    await asyncio.gather(*(client(base, pool, references, deadline, args.seed + c, tally) for c in range(args.clients)))
    stop.set()
    await watcher
    samples.append(sample(pid))
    warm = [s for s in samples if s["t"] - began >= args.warmup] or samples
    metrics = httpx.get(base + "/metrics", timeout=30).text
    return {
        "references": len(references),
        "seconds": time.monotonic() - began,
        **tally.as_dict(),
        "rss_mb": {
            "start": samples[0]["rss_mb"],
            "after_warmup": warm[0]["rss_mb"],
            "end": samples[-1]["rss_mb"],
            "max": max(s["rss_mb"] for s in samples),
        },
        "rss_growth_after_warmup_mb": samples[-1]["rss_mb"] - warm[0]["rss_mb"],
        "fds": {"after_warmup": warm[0]["fds"], "end": samples[-1]["fds"], "max": max(s["fds"] for s in samples)},
        "threads": {
            "after_warmup": warm[0]["threads"],
            "end": samples[-1]["threads"],
            "max": max(s["threads"] for s in samples),
        },
        "samples": samples,
        "server_metrics": [line for line in metrics.splitlines() if line.startswith("specdec_requests")],
    }


def main(argv: list[str] | None = None) -> int:
    """The soak; its exit status is 1 where a reply mismatched, the server did not exit 0 at SIGTERM, or its
    log holds a traceback."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="smollm2-135m", help="a model (its int8 copy drafts), ngram or none")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds under load before growth is measured")
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    port = free_port()
    command = [sys.executable, "-c", "from specdec_cli.app import main; main()", "serve", "--target", args.target]
    command += ["--draft", args.draft, "--dtype", "float32", "--port", str(port), "--served-model-name", MODEL]
    command += ["--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue), "--shutdown-timeout", "5"]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: {Path(log.name).read_text()[-2000:]}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not come up") from None
                time.sleep(0.5)
        result = asyncio.run(soak(base, server.pid, args))
        server.send_signal(signal.SIGTERM)
        result["exit_code"] = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    text = Path(log.name).read_text()
    result["log_tracebacks"] = text.count("Traceback") + text.count("Exception in ASGI application")
    result |= {"command": " ".join(["specdec bench soak --", *(argv or [])]), "started": started}
    result |= {"settings": vars(args) | {"out": str(args.out)}, "host": host_info()}
    print(report(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return 1 if result["mismatches"] or result["exit_code"] or result["log_tracebacks"] else 0


def report(r: dict) -> str:
    served, kinds = sum(r["served"].values()), ", ".join(f"{k} {v}" for k, v in r["served"].items())
    return "\n".join(
        [
            f"| requests | {served} in {r['seconds'] / 60:.1f} min ({kinds}) |",
            f"| mismatches against the request alone | {r['mismatches']} |",
            f"| unexpected statuses | {r['unexpected_statuses'] or 'none'} |",
            f"| RSS after warm-up -> end (max) | {r['rss_mb']['after_warmup']:.0f} -> {r['rss_mb']['end']:.0f} MB "
            f"({r['rss_mb']['max']:.0f}); growth {r['rss_growth_after_warmup_mb']:+.1f} MB |",
            f"| fds after warm-up -> end (max) | {r['fds']['after_warmup']} -> {r['fds']['end']} ({r['fds']['max']}) |",
            f"| threads after warm-up -> end (max) | {r['threads']['after_warmup']} -> {r['threads']['end']} "
            f"({r['threads']['max']}) |",
            f"| SIGTERM: exit code, tracebacks in the log | {r['exit_code']}, {r['log_tracebacks']} |",
        ]
    )
