"""Serving configs: specdec's measured settings written for vLLM and SGLang.

Users outgrow one process by serving with vLLM or SGLang. `serving_config`
maps a pair and the best measured draft length to each engine's documented
option names (vLLM's `--speculative-config` JSON keys; SGLang's
`--speculative-*` server flags). docs/SCALING.md lists what has no equivalent.
"""

from __future__ import annotations

import json
import shlex

ENGINES = ("vllm", "sglang")


def best_fixed_k(summary: dict) -> int | None:
    """The fastest fixed draft length in a bench summary ({"specdec_k4": {"tokens_per_second": ...}, ...})."""
    fixed = {int(m[len("specdec_k") :]): row["tokens_per_second"] for m, row in summary.items() if m[9:].isdigit()}
    if not fixed and "specdec_ngram" in summary:
        return None
    if not fixed:
        raise ValueError("the bench summary has no specdec_k<N> runs to choose a draft length from")
    return max(fixed, key=fixed.get)


def serving_config(engine: str, target: str, draft: str | None, k: int, max_ngram: int = 3, min_ngram: int = 1):
    """-> (config dict, command line) for `engine`. draft: a model id/path, "ngram", or None."""
    if engine not in ENGINES:
        raise ValueError(f"unknown serving engine {engine!r}; choose one of: {', '.join(ENGINES)}")
    if draft is None:
        raise ValueError("there is nothing to export without a draft: give a draft model or 'ngram'")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"the draft length must be an integer >= 1, got {k!r}")
    if engine == "vllm":
        if draft == "ngram":
            config = {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_max": max_ngram,
                "prompt_lookup_min": min_ngram,
            }
        else:
            config = {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
        command = f"vllm serve {shlex.quote(target)} --speculative-config {shlex.quote(json.dumps(config))}"
        return config, command
    if draft == "ngram":
        config = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": k + 1}
    else:
        config = {
            "speculative_algorithm": "STANDALONE",
            "speculative_draft_model_path": draft,
            "speculative_num_steps": k,
            "speculative_eagle_topk": 1,  # a chain, as specdec's draft_width=1
            "speculative_num_draft_tokens": k + 1,
        }
    flags = " ".join(f"--{key.replace('_', '-')} {shlex.quote(str(value))}" for key, value in config.items())
    return config, f"python -m sglang.launch_server --model-path {shlex.quote(target)} {flags}"
