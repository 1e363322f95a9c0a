"""A client no one here wrote: lm-evaluation-harness's `local-completions` model pointed at `specdec serve`
scores a small multiple-choice task (a local file, no download) with the same per-item log-likelihoods and
accuracy as lm-eval's own `hf` model on the target (echo + logprobs: the prompt scored by the target)."""

from __future__ import annotations

import json
import os

import pytest

from tests import test_serve
from tests.test_serve import MODEL, live

tiny = test_serve.tiny  # the served pair: a char tokenizer, one token a character

ITEMS = [
    {"question": "a b c a b", "choices": [" c", " a", " x"], "answer": 0},
    {"question": "hello wor", "choices": ["ld", "lk", "ms"], "answer": 0},
    {"question": "the cat sat on the", "choices": [" mat", " hat", " dog"], "answer": 0},
    {"question": "1 2 3 4", "choices": [" 5", " 6", " 7 8"], "answer": 0},
    {"question": "def fib(n):", "choices": [" return", " pass", "\n    if"], "answer": 2},
    {"question": "abc abc ab", "choices": ["c", "d", "cab"], "answer": 0},
]
TASK = """task: specdec_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow  # lm-eval's imports (datasets, evaluate) take most of its 12 s: make test-all runs it
def test_lm_eval_through_the_server_scores_as_lm_evals_hf_model_on_the_target(tiny, tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "specdec_mc.yaml").write_text(TASK.format(items=tmp_path / "items.jsonl"))
    tasks = TaskManager(include_path=str(tmp_path))

    def evaluate(model: str, args: str) -> dict:
        return lm_eval.simple_evaluate(model=model, model_args=args, tasks=["specdec_mc"], task_manager=tasks,
                                       log_samples=True, batch_size=1)  # fmt: skip

    with live(tiny["decoder"]) as base:
        served = evaluate("local-completions", f"model={MODEL},base_url={base}/v1/completions,tokenizer={tiny['dir']},"
                          "tokenized_requests=True,num_concurrent=1,max_retries=1")  # fmt: skip
    alone = evaluate("hf", f"pretrained={tiny['dir']},dtype=float32,device=cpu,prefix_token_id=0")

    def loglikelihoods(run: dict) -> list[float]:
        return [float(resp[0]) for sample in run["samples"]["specdec_mc"] for resp in sample["filtered_resps"]]

    assert len(loglikelihoods(served)) == sum(len(item["choices"]) for item in ITEMS)
    assert loglikelihoods(served) == pytest.approx(loglikelihoods(alone), abs=1e-4)
    assert served["results"]["specdec_mc"]["acc,none"] == alone["results"]["specdec_mc"]["acc,none"]
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # nothing was fetched: the task is a local file
