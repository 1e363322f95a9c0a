"""The live page at `/` of `specdec serve`, driven in a real browser (headless Chromium from Debian's
packages, through Playwright): its token spans and kinds are the server's own stream, its acceptance bars
are /metrics, it works behind the Guard and with an API key, and its comparison runs the prompt without a
draft. `make install` puts chromium there (apt) and playwright in the venv."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from tests import test_serve
from tests.test_serve import live

tiny = test_serve.tiny  # the served pair
CHROMIUM = os.environ.get("SPECDEC_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert CHROMIUM, "no chromium on PATH: `make install` installs Debian's (apt-get install chromium)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield launched
        launched.close()


def streamed_tokens(body: str) -> list[tuple[str, str]]:
    """(text, kind) of every token in a completion stream's events, in order."""
    tokens = []
    for line in body.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                tokens += [(t["text"], t["kind"]) for t in choice.get("specdec_tokens") or []]
    return tokens


def per_position(metrics: str, name: str, positions: int) -> list[int]:
    """/metrics' counter by draft position, 1..positions (a position past the last accepted one: 0)."""
    values = {}
    for line in metrics.splitlines():
        if line.startswith(f"specdec_{name}_total{{"):
            values[int(line.split('position="')[1].split('"')[0])] = int(float(line.rsplit(" ", 1)[1]))
    return [values.get(p, 0) for p in range(1, positions + 1)]


def test_the_page_shows_the_servers_own_stream_and_its_bars_equal_metrics(tiny, browser, tmp_path):
    with live(tiny["decoder"], api_key="sesame") as base:
        page = browser.new_page()
        page.goto(base + "/")
        page.fill("#prompt", "def fib(n):")
        page.fill("#max_tokens", "40")
        page.fill("#api_key", "sesame")
        with page.expect_response(lambda r: r.url.endswith("/v1/completions")) as answer:
            page.click("#run")
        page.wait_for_function("document.getElementById('status').textContent !== 'running'", timeout=60_000)
        assert page.text_content("#status") == "done", page.text_content("#error")
        spans = page.eval_on_selector_all("#first .tok", "els => els.map(e => [e.textContent, e.dataset.kind])")
        server = streamed_tokens(answer.value.text())
        assert [tuple(s) for s in spans] == server and len(server) == 40  # the page shows what the server sent
        titles = page.eval_on_selector_all("#first .tok", "els => els.map(e => e.title)")
        assert all(" · round " in t and " · logprob -" in t for t in titles)  # the hover: kind, round, logprob
        bars = page.eval_on_selector_all(
            "#first .bar", "els => els.map(e => [+e.dataset.accepted, +e.dataset.drafted])"
        )
        metrics = httpx.get(base + "/metrics").text
        drafted = per_position(metrics, "drafted_per_position", len(bars) + 1)
        assert bars and [d for _, d in bars] + [0] == drafted  # every position the server counted, no more
        assert [a for a, _ in bars] == per_position(metrics, "accepted_per_position", len(bars))
        page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        assert (tmp_path / "page.png").stat().st_size > 0


def test_the_page_compares_with_no_draft_and_a_wrong_key_is_told(tiny, browser):
    with live(tiny["decoder"], api_key="sesame") as base:
        page = browser.new_page()
        page.goto(base + "/")
        page.fill("#max_tokens", "16")
        page.fill("#api_key", "wrong")
        page.click("#run")
        page.wait_for_function("document.getElementById('status').textContent !== 'running'", timeout=60_000)
        assert page.text_content("#status") == "failed" and page.text_content("#error")
        page.fill("#api_key", "sesame")
        page.click("#compare")
        page.wait_for_function("document.getElementById('status').textContent !== 'running'", timeout=60_000)
        assert page.text_content("#status") == "done", page.text_content("#error")
        alone = page.eval_on_selector_all("#second .tok", "els => els.map(e => e.dataset.kind)")
        spec = page.eval_on_selector_all("#first .tok", "els => els.map(e => e.textContent)")
        texts = page.eval_on_selector_all("#second .tok", "els => els.map(e => e.textContent)")
        assert set(alone) == {"target"} and texts == spec  # greedy: the same text, the target alone
        assert page.text_content("#speedup").startswith("measured speedup: ")
