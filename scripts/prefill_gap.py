"""The longest wait of a running stream while a long prompt joins its batch: chunked prefill (at each
--chunks size) against the prompt fed at once, in one process, interleaved (issue 48).

    .venv/bin/specdec bench prefill -- --target smollm2-135m --draft ngram --dtype float32 --repeats 2

One SpeculativeDecoder, one `specdec serve` app on uvicorn in this process (max_batch 8). Each repeat runs
both settings in turn: a streamed greedy request decodes; once it has streamed for a while, a prompt of
--prompt-tokens tokens is sent (not streamed, 8 new tokens). The figure is the longest gap between two
chunks of the running stream from that moment until the long prompt's reply, and the long prompt's own
latency. "at once" sets the engine's prefill_chunk to None (the whole prompt in the next round's forward).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import threading
import time
from pathlib import Path

import httpx

from specdec import SpeculativeDecoder
from specdec.bench.host import host_info
from specdec.serving import session as session_module
from specdec.serving.server import ServeSettings, create_app, serving_in_thread

TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. Each department presented "
    "its figures, and the members asked about travel, equipment and the new building. "
)


def one_join(base: str, decoder, prompt_tokens: int, stream_tokens: int) -> dict:
    """A running stream, then the long prompt: the stream's longest gap while the prompt joins."""
    ids = decoder.tokenizer(TEXT * (prompt_tokens // 30 + 1))["input_ids"][:prompt_tokens]
    arrivals, joined = [], {}
    stream_body = {"model": "bench", "prompt": "def fib(n):", "max_tokens": stream_tokens, "temperature": 0,
                   "stream": True}  # fmt: skip

    def read_stream() -> None:
        with httpx.stream("POST", base + "/v1/completions", json=stream_body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())

    reader = threading.Thread(target=read_stream)
    reader.start()
    while len(arrivals) < 10:  # the stream is decoding
        time.sleep(0.01)
    joined["sent"] = time.perf_counter()
    body = {"model": "bench", "prompt": decoder.tokenizer.decode(ids), "max_tokens": 8, "temperature": 0}
    reply = httpx.post(base + "/v1/completions", json=body, timeout=600).json()
    joined["answered"] = time.perf_counter()
    reader.join()
    window = [t for t in arrivals if joined["sent"] <= t <= joined["answered"]]
    before = [t for t in arrivals if t < joined["sent"]][-1:]
    edges = before + window + [t for t in arrivals if t > joined["answered"]][:1]
    gaps = [b - a for a, b in zip(edges, edges[1:])]
    return {
        "longest_gap_s": max(gaps) if gaps else None,
        "chunks_during_join": len(window),
        "long_prompt_latency_s": joined["answered"] - joined["sent"],
        "long_prompt_tokens": reply["usage"]["prompt_tokens"],
        "stream_chunks": len(arrivals),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--draft", default="ngram")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--stream-tokens", type=int, default=400)
    parser.add_argument("--chunks", default=str(session_module.PREFILL_CHUNK), help="chunk sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    decoder = SpeculativeDecoder.from_pretrained(args.target, args.draft, dtype=args.dtype)
    app = create_app(decoder, ServeSettings(model="bench", max_batch=8))
    engine = app.state.runner.session.engine  # the server's engine: its plan decides the chunk
    chunked = engine.plan
    settings = [("at once", None)] + [(f"chunk {c}", int(c)) for c in args.chunks.split(",")]
    results = {name: [] for name, _ in settings}
    with serving_in_thread(app) as base:
        httpx.post(base + "/v1/completions", json={"model": "bench", "prompt": "hi", "max_tokens": 4}, timeout=600)
        for _ in range(args.repeats):
            for name, chunk in settings:
                engine.plan = dataclasses.replace(chunked, prefill_chunk=chunk)
                results[name].append(one_join(base, decoder, args.prompt_tokens, args.stream_tokens))
                print(name, json.dumps(results[name][-1]), flush=True)
    engine.plan = chunked
    summary = {name: max(r["longest_gap_s"] for r in runs) for name, runs in results.items()}
    print("longest gap (s):", json.dumps(summary))
    if args.out:
        date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        options = {k: str(v) for k, v in vars(args).items()}
        record = {"date": date, "host": host_info(), "args": options, "results": results, "longest_gap_s": summary}
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
