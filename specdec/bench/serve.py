"""The serving benchmark (issue 31, "Speed"): servers on loopback, one at a time, under 1, 4 and 8
concurrent streaming clients (the official `openai` client), each request a code prompt for 128 tokens,
greedy. Measures total tokens/s, p50/p95 request latency, time to first token, and (specdec) acceptance
from each reply's `specdec` field.

    .venv/bin/specdec bench serve -- --out scripts/results/bench/serve-avx512.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        .venv/bin/specdec bench serve -- --out scripts/results/bench/serve-avx2.json

Servers (each in its own subprocess on 127.0.0.1 and a free port, started and stopped in turn):
- specdec: `specdec serve --target T --draft D` (its defaults otherwise: int8 draft on CPU, auto k,
  continuous batching up to --max-batch);
- specdec-nodraft: `specdec serve --draft none`, the same server with the target alone;
- transformers: `transformers serve <the target's local directory> --continuous-batching`, the same
  dtype and device. Continuous batching is asked for; whether the server used it is read from its log
  (`CB: True`) and recorded. If it fails with it, the bench retries once without and says so. On CPU
  its continuous batching sizes the paged KV cache to 60% of the host's RAM and fills it at the first
  request (12.5 GB of a 23 GB host, measured); `--transformers-args "--cb-num-blocks N"` bounds it.
  It needs fastapi, uvicorn, pydantic and openai (transformers[serving]): specdec's own dependencies
  and its dev extra; psutil (dev extra too) for the cache's sizing on CPU.

A cell is one server under N clients: the prompts (each `--passes` times) wait in one queue and N
client tasks take them in turn, each sending its next request as soon as its last one ends (a closed
loop). Tokens/s is the completion tokens of the cell's requests over the cell's wall time. Each cell is
bounded in requests (prompts x passes) and in time (--cell-timeout: no request starts after it; each
request gives up after --request-timeout).

Repeats are interleaved: repeat r starts every server in turn (the order rotated by one each repeat),
so drift in the host's speed falls on every server alike. Each start is warmed up (a request alone, then
one per client at once) before it is measured: specdec's first request measures the host's costs for
the pair (cached on disk). The host's ISA (avx512_bf16, amx) and load average are recorded with the
figures. Prints a markdown table; writes everything as JSON (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdec.bench.host import describe, host_info

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
SERVERS = ("specdec", "specdec-nodraft", "transformers")
SERVED_NAME = "bench"  # the model name specdec's servers answer to

# Held out: none of these is in specdec.bench.main's PROMPTS or EXTRA_PROMPTS (what the defaults were tuned on).
PROMPTS = (
    "Write a Python function that returns the running maximum of a list of numbers.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that flattens an arbitrarily nested list of integers.",
    "Write a Python function that parses a query string like 'a=1&b=2' into a dict.",
    "Write a Python generator that yields the prime numbers below n.",
    "Write a Python function that rotates a square matrix 90 degrees clockwise.",
    "Write a Python function that groups a list of words by their first letter.",
    "Write a Python dataclass for a 2D point with a method that returns the distance to another point.",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ------------------------------------------------------------------ the servers


@dataclass
class ServerSpec:
    name: str
    model: str  # what clients send as "model"
    args: list[str]  # the command after the interpreter, without --port
    env: dict[str, str] = field(default_factory=dict)
    continuous_batching: bool | None = None  # transformers: asked for (None: not applicable)

    def command(self, port: int) -> list[str]:
        return [sys.executable, *self.args, "--port", str(port)]


def specdec_spec(name: str, target: str, draft: str, dtype: str, device: str, max_batch: int, extra: list[str]):
    args = ["-c", "from specdec_cli.app import main; main()", "serve", "--target", target, "--draft", draft]
    args += ["--dtype", dtype, "--device", device, "--host", "127.0.0.1", "--served-model-name", SERVED_NAME]
    args += ["--max-batch", str(max_batch), *extra]
    return ServerSpec(name, SERVED_NAME, args)


def transformers_spec(
    target_dir: str, dtype: str, device: str, continuous_batching: bool, extra: list[str] = ()
) -> ServerSpec:
    args = ["-c", "from transformers.cli.transformers import main; main()", "serve", target_dir]
    args += ["--device", device, "--dtype", dtype, "--host", "127.0.0.1", "--log-level", "warning"]
    args.append("--continuous-batching" if continuous_batching else "--no-continuous-batching")
    args += extra
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # a local directory: nothing to fetch
    return ServerSpec("transformers", target_dir, args, env, continuous_batching)


class ServerFailed(RuntimeError):
    pass


class Running:
    """One server in a subprocess on a free loopback port, its output in a log file. `start` launches it
    and waits for /health; `stop` (or the end of a with block) sends SIGTERM, then SIGKILL after 30 s."""

    def __init__(self, spec: ServerSpec, log_dir: Path, tag: str, threads: int | None, startup_timeout: float):
        self.spec, self.startup_timeout = spec, startup_timeout
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{tag}.log"
        env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
        if threads:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        self.env = env

    def start(self) -> Running:
        self.log = open(self.log_path, "wb")
        started = time.monotonic()
        self.process = subprocess.Popen(
            self.spec.command(self.port),
            env=self.env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_healthy(self, started: float) -> None:
        import httpx

        while True:
            if self.process.poll() is not None:
                raise ServerFailed(f"{self.spec.name} exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() - started > self.startup_timeout:
                raise ServerFailed(f"{self.spec.name} did not answer /health in {self.startup_timeout:.0f} s")
            time.sleep(0.25)

    def stop(self) -> None:
        began = time.monotonic()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        self.log.close()
        self.stop_s = time.monotonic() - began

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 15) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def used_continuous_batching(self) -> bool | None:
        """Whether the server batched concurrent requests, from its log: transformers serve logs `CB: True`
        or `CB: False` with each request; specdec serve warns when it serves one request at a time."""
        text = self.log_text()
        if self.spec.name.startswith("specdec"):
            return "serving one request at a time" not in text
        if "CB: True" in text:
            return True
        if "CB: False" in text:
            return False
        return None

    def rss_mb(self) -> float | None:
        """The server's resident memory (psutil, where installed)."""
        try:
            import psutil

            return psutil.Process(self.process.pid).memory_info().rss / 2**20
        except Exception:  # noqa: BLE001 - no psutil, or the process has gone
            return None

    def metrics(self) -> dict[str, float]:
        """specdec's /metrics, unlabelled series only ({} for a server without it)."""
        import httpx

        try:
            response = httpx.get(self.base + "/metrics", timeout=10)
        except httpx.TransportError:
            return {}
        if response.status_code != 200:
            return {}
        out = {}
        for line in response.text.splitlines():
            if line.startswith("specdec_") and "{" not in line:
                name, _, value = line.partition(" ")
                out[name] = float(value)
        return out


# ------------------------------------------------------------------ the clients


async def one_request(client, model: str, prompt: str, max_tokens: int, endpoint: str) -> dict:
    """One streamed greedy request: its latency, time to first token, completion tokens (from usage)
    and the `specdec` field if the server sends one."""
    began = time.perf_counter()
    first = None
    usage = extra = None
    text_parts: list[str] = []
    record = {"prompt": prompt, "start": began}
    try:
        common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True)
        common["stream_options"] = {"include_usage": True}
        if endpoint == "chat":
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                piece = choice.delta.content if endpoint == "chat" else choice.text
                if piece:
                    first = first or time.perf_counter()
                    text_parts.append(piece)
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage
            if chunk.model_extra and chunk.model_extra.get("specdec"):
                extra = chunk.model_extra["specdec"]
    except Exception as error:  # noqa: BLE001 - a failed request is counted, the cell goes on
        record.update(ok=False, error=f"{type(error).__name__}: {error}")
        record["latency_s"] = time.perf_counter() - began
        return record
    end = time.perf_counter()
    record.update(ok=True, end=end, latency_s=end - began, ttft_s=(first or end) - began)
    record["completion_tokens"] = usage.completion_tokens if usage is not None else None
    record["prompt_tokens"] = usage.prompt_tokens if usage is not None else None
    record["chars"] = sum(len(p) for p in text_parts)
    record["specdec"] = extra
    return record


async def run_cell(
    base: str,
    model: str,
    clients: int,
    prompts: list[str],
    max_tokens: int,
    endpoint: str,
    cell_timeout: float,
    request_timeout: float,
) -> tuple[list[dict], float]:
    """N client tasks share a queue of prompts until it is empty or the cell's time is up. Returns the
    requests' records and the cell's wall time (first send to last end)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=request_timeout)
    queue: asyncio.Queue = asyncio.Queue()
    for index, prompt in enumerate(prompts):
        queue.put_nowait((index, prompt))
    records: list[dict] = []
    began = time.perf_counter()
    deadline = began + cell_timeout

    async def worker(number: int) -> None:
        while time.perf_counter() < deadline:
            try:
                index, prompt = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            record = await one_request(client, model, prompt, max_tokens, endpoint)
            records.append(record | {"index": index, "client": number})

    try:
        await asyncio.gather(*(worker(n) for n in range(clients)))
    finally:
        await client.close()
    ends = [r["end"] for r in records if r.get("ok")]
    wall = (max(ends) if ends else time.perf_counter()) - began
    for r in records:  # relative to the cell's start: JSON-friendly
        r["start"] -= began
        if "end" in r:
            r["end"] -= began
    return records, wall


# ------------------------------------------------------------------ figures


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def cell_summary(records: list[dict], wall: float) -> dict:
    done = [r for r in records if r.get("ok")]
    tokens = sum(r["completion_tokens"] or 0 for r in done)
    out = {
        "requests": len(records),
        "completed": len(done),
        "errors": len(records) - len(done),
        "completion_tokens": tokens,
        "wall_s": wall,
        "tokens_per_second": tokens / wall if wall > 0 else 0.0,
    }
    extras = [r["specdec"] for r in done if r.get("specdec")]
    if extras:
        drafted = sum(e["drafted_tokens"] for e in extras)
        accepted = sum(e["accepted_tokens"] for e in extras)
        rounds = sum(e["rounds"] for e in extras)
        out.update(
            drafted_tokens=drafted,
            accepted_tokens=accepted,
            rounds=rounds,
            acceptance_rate=accepted / drafted if drafted else None,  # nothing drafted: no rate
            mean_acceptance_length=1 + accepted / rounds if rounds else 0.0,
        )
    return out


def summarise(cells: list[dict]) -> dict:
    """Per server and client count, over repeats: the median (and range) of tokens/s; latency percentiles
    and acceptance pooled over every request."""
    summary: dict = {}
    for cell in cells:
        summary.setdefault(cell["server"], {}).setdefault(str(cell["clients"]), []).append(cell)
    out: dict = {}
    for server, by_clients in summary.items():
        for clients, group in by_clients.items():
            rates = [c["summary"]["tokens_per_second"] for c in group]
            done = [r for c in group for r in c["records"] if r.get("ok")]
            latencies = [r["latency_s"] for r in done]
            ttfts = [r["ttft_s"] for r in done]
            row = {
                "repeats": len(group),
                "tokens_per_second": statistics.median(rates),
                "tokens_per_second_min": min(rates),
                "tokens_per_second_max": max(rates),
                "p50_latency_s": percentile(latencies, 0.5),
                "p95_latency_s": percentile(latencies, 0.95),
                "p50_ttft_s": percentile(ttfts, 0.5),
                "requests": sum(c["summary"]["requests"] for c in group),
                "errors": sum(c["summary"]["errors"] for c in group),
                "mean_completion_tokens": statistics.fmean([r["completion_tokens"] or 0 for r in done]) if done else 0,
            }
            pooled = cell_summary(done, 1.0)
            for key in ("acceptance_rate", "mean_acceptance_length"):
                if key in pooled:
                    row[key] = pooled[key]
            out.setdefault(server, {})[clients] = row
    return out


def ratios(summary: dict) -> dict:
    """specdec's tokens/s over transformers serve's and over its own no-draft server's, per client count
    (the issue's goals: 1 client >= 2.0x transformers; 8 clients >= 1.5x transformers, >= 1.0x no-draft)."""
    out: dict = {}
    mine = summary.get("specdec", {})
    for other in ("transformers", "specdec-nodraft"):
        theirs = summary.get(other, {})
        for clients, row in mine.items():
            if clients in theirs and theirs[clients]["tokens_per_second"]:
                ratio = row["tokens_per_second"] / theirs[clients]["tokens_per_second"]
                out.setdefault(f"specdec / {other}", {})[clients] = ratio
    return out


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(data: dict) -> str:
    host, settings = data["host"], data["settings"]
    lines = [
        f"{describe(host)} Load average after {_fmt(data.get('loadavg_after', [None])[0])}.",
        f"Target {settings['target']}, draft {settings['draft']}, {settings['dtype']} on {settings['device']}; "
        f"{settings['max_tokens']} tokens greedy, {len(settings['prompts'])} prompts x {settings['passes']} per cell, "
        f"{settings['repeats']} interleaved repeats; streamed through the openai client ({settings['endpoint']}).",
        "",
        "| server | clients | tokens/s (median) | range | p50 latency (s) | p95 latency (s) | p50 TTFT (s) "
        "| acceptance | mean acc. length | tokens/request | errors |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for server, by_clients in data["summary"].items():
        for clients, row in sorted(by_clients.items(), key=lambda item: int(item[0])):
            lines.append(
                f"| {server} | {clients} | {_fmt(row['tokens_per_second'], 1)} "
                f"| {_fmt(row['tokens_per_second_min'], 1)}-{_fmt(row['tokens_per_second_max'], 1)} "
                f"| {_fmt(row['p50_latency_s'])} | {_fmt(row['p95_latency_s'])} | {_fmt(row['p50_ttft_s'])} "
                f"| {_fmt(row.get('acceptance_rate'))} | {_fmt(row.get('mean_acceptance_length'))} "
                f"| {_fmt(row['mean_completion_tokens'], 0)} | {row['errors']} |"
            )
    for name, by_clients in data["ratios"].items():
        cells = ", ".join(
            f"{c} client{'s' * (c != '1')}: {r:.2f}x" for c, r in sorted(by_clients.items(), key=lambda i: int(i[0]))
        )
        lines.append(f"\n{name} tokens/s: {cells}")
    for server in data["servers"]:
        if server.get("error"):
            lines.append(f"\n{server['name']}: {server['error']}")
        if server.get("continuous_batching_used") is not None:
            used = "with" if server["continuous_batching_used"] else "without"
            note = f" ({server['note']})" if server.get("note") else ""
            lines.append(f"\n{server['name']} ran {used} continuous batching{note}.")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="a name specdec.load_model resolves, or a directory")
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--dtype", default="auto", help="auto: what specdec picks on this host (bf16 where native)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"comma-separated, of {', '.join(SERVERS)}")
    parser.add_argument("--clients", default="1,4,8", help="concurrent client counts, comma-separated")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=1, help="each prompt this many times per cell")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"use the first N of {len(PROMPTS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=None, help="specdec --max-batch [default: the most clients]")
    parser.add_argument(
        "--specdec-args",
        default="",
        help="more flags for both specdec servers, one string (a single flag: --specdec-args=--no-compile)",
    )
    parser.add_argument(
        "--transformers-cb",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask transformers serve for --continuous-batching (retried without it if it fails)",
    )
    parser.add_argument(
        "--transformers-args",
        default="",
        help="more flags for transformers serve (one string), e.g. '--cb-num-blocks 64': on CPU its continuous "
        "batching sizes the paged KV cache to 60%% of the host's RAM by default",
    )
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the servers [default: torch's]")
    parser.add_argument("--cell-timeout", type=float, default=900.0, help="no request starts after this many s")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", default=None, help="keep the servers' logs here [default: a temporary folder]")
    parser.add_argument("--out", default="serve_bench.json", help="JSON results")
    parser.add_argument("--md", default=None, help="also write the markdown table here")
    args = parser.parse_args(argv)
    args.servers = [s for s in args.servers.split(",") if s]
    unknown = set(args.servers) - set(SERVERS)
    if unknown:
        parser.error(f"unknown servers {sorted(unknown)}; choose from {', '.join(SERVERS)}")
    args.clients = [int(c) for c in args.clients.split(",") if c]
    if not args.clients or min(args.clients) < 1 or args.max_tokens < 1 or args.passes < 1 or args.repeats < 1:
        parser.error("--clients, --max-tokens, --passes and --repeats must be >= 1")
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be in 1..{len(PROMPTS)}")
    return args


def build_specs(args, dtype: str) -> tuple[list[ServerSpec], list[dict]]:
    """The servers to run, and a record for each that cannot be (the reason)."""
    from specdec.models.resolution import resolve

    extra = shlex.split(args.specdec_args)
    max_batch = args.max_batch or max(args.clients)
    specs, skipped = [], []
    for name in args.servers:
        if name == "specdec":
            specs.append(specdec_spec(name, args.target, args.draft, dtype, args.device, max_batch, extra))
        elif name == "specdec-nodraft":
            specs.append(specdec_spec(name, args.target, "none", dtype, args.device, max_batch, extra))
        else:
            try:
                path, kwargs = resolve(args.target)
            except ValueError as error:
                skipped.append({"name": name, "error": f"not run: {error}"})
                continue
            if kwargs or not Path(path).is_dir():
                skipped.append({"name": name, "error": f"not run: {args.target} is no local save_pretrained directory"})
                continue
            extra = shlex.split(args.transformers_args)
            specs.append(transformers_spec(path, dtype, args.device, args.transformers_cb, extra))
    return specs, skipped


def warm_up(server: Running, args) -> None:
    """A request alone (specdec measures its costs on the first), then one per client at once; raises
    if any fails."""
    prompts = list(PROMPTS[: args.prompts])
    for clients, batch in ((1, prompts[:1]), (max(args.clients), (prompts * max(args.clients))[: max(args.clients)])):
        records, _ = asyncio.run(
            run_cell(
                server.base,
                server.spec.model,
                clients,
                batch,
                args.warmup_tokens,
                args.endpoint,
                args.request_timeout,
                args.request_timeout,
            )
        )
        failed = [r for r in records if not r.get("ok")]
        if failed:
            raise ServerFailed(f"{server.spec.name}: a warm-up request failed: {failed[0]['error']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from specdec.models.forms import parse_dtype

    dtype = args.resolved_dtype = str(parse_dtype(args.dtype, args.device)).removeprefix("torch.")
    host = host_info()
    specs, skipped = build_specs(args, dtype)
    prompts = [p for _ in range(args.passes) for p in PROMPTS[: args.prompts]]
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="serve-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = {s.name: {"name": s.name, "command": s.command(0)[:-2], "starts": []} for s in specs}
    servers.update({s["name"]: s for s in skipped})
    cells: list[dict] = []
    began = time.monotonic()

    def say(line: str) -> None:  # progress on stderr, the table on stdout
        print(f"[{time.monotonic() - began:6.0f} s] {line}", file=sys.stderr, flush=True)

    say(f"serve bench: {', '.join(s.name for s in specs)}; dtype {dtype}; logs in {log_dir}")
    failed: set[str] = set()
    for repeat in range(args.repeats):
        order = specs[repeat % len(specs) :] + specs[: repeat % len(specs)] if specs else []
        for spec in order:
            if spec.name in failed:
                continue
            record = servers[spec.name]
            try:
                server = _start(spec, args, log_dir, repeat, record, say)
            except ServerFailed as error:
                record["error"] = f"failed: {error}"
                failed.add(spec.name)
                say(f"  {spec.name}: {error}")
                continue
            with server:
                cells += [_measure_cell(server, spec, clients, repeat, prompts, args, say) for clients in args.clients]
                record["continuous_batching_used"] = server.used_continuous_batching()
    data = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "host": host,
        "loadavg_after": os.getloadavg(),
        "settings": _settings(args, dtype, sys.argv[1:] if argv is None else list(argv)),
        "servers": list(servers.values()),
        "cells": cells,
    }
    data["summary"] = summarise(cells)
    data["ratios"] = ratios(data["summary"])
    table = markdown(data)
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1))
    if args.md:
        Path(args.md).write_text(table)
    return data


def _measure_cell(server: Running, spec: ServerSpec, clients: int, repeat: int, prompts: list, args, say) -> dict:
    """One cell: `clients` concurrent clients against a running server, with its load and counters around it."""
    before, load = server.metrics(), os.getloadavg()
    records, wall = asyncio.run(
        run_cell(
            server.base,
            spec.model,
            clients,
            prompts,
            args.max_tokens,
            args.endpoint,
            args.cell_timeout,
            args.request_timeout,
        )
    )
    after = server.metrics()
    summary = cell_summary(records, wall)
    cell = {"server": spec.name, "clients": clients, "repeat": repeat, "summary": summary}
    cell |= {"loadavg_before": load, "loadavg_after": os.getloadavg(), "server_rss_mb": server.rss_mb()}
    cell["records"] = records
    if before and after:  # specdec's own counters over the cell
        cell["server_metrics"] = {k: after[k] - before.get(k, 0) for k in after if k.endswith("_total")}
    accept = f", acceptance {summary['acceptance_rate']:.2f}" if summary.get("acceptance_rate") is not None else ""
    say(
        f"  repeat {repeat + 1} {spec.name} x{clients}: {summary['tokens_per_second']:.1f} tokens/s, "
        f"{summary['completed']}/{summary['requests']} requests{accept}"
    )
    return cell


def _settings(args, dtype: str, argv: list[str]) -> dict:
    """The run's settings, as the JSON records them."""
    return {
        "target": args.target,
        "draft": args.draft,
        "dtype": dtype,
        "device": args.device,
        "servers": args.servers,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "passes": args.passes,
        "repeats": args.repeats,
        "endpoint": args.endpoint,
        "threads": args.threads,
        "cell_timeout_s": args.cell_timeout,
        "request_timeout_s": args.request_timeout,
        "prompts": list(PROMPTS[: args.prompts]),
        "argv": argv,
    }


def _commit() -> str | None:
    """The checkout's commit (with "+dirty" when it has changes), where git and a checkout are here."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def _start(spec: ServerSpec, args, log_dir: Path, repeat: int, record: dict, say) -> Running:
    """Start and warm up a server. transformers serve that fails with continuous batching is retried
    once without it, and stays so for the later repeats (the record says why)."""
    while True:
        tag = f"{spec.name}-r{repeat + 1}" + ("-nocb" if spec.continuous_batching is False else "")
        server = Running(spec, log_dir, tag, args.threads, args.startup_timeout)
        try:
            server.start()
            try:
                warm_up(server, args)
            except BaseException:
                server.stop()
                raise
        except ServerFailed as error:
            if spec.continuous_batching:
                say(f"  {spec.name}: failed with --continuous-batching ({error}); retrying without")
                record["note"] = f"--continuous-batching failed: {error}"
                extra = shlex.split(args.transformers_args)
                plain = transformers_spec(spec.model, args.resolved_dtype, args.device, False, extra)
                spec.args, spec.continuous_batching = plain.args, False
                record["command"] = spec.command(0)[:-2]
                continue
            raise
        say(f"  {spec.name} up in {server.startup_s:.1f} s, warmed up")
        record["starts"].append(
            {"repeat": repeat, "startup_s": round(server.startup_s, 2), "log": str(server.log_path)}
        )
        return server
