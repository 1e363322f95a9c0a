"""The engine on tiny random models: greedy equals transformers' greedy, cache invariants,
exact sampling laws (and a broken variant that the check catches), batches, stops, errors."""

import copy
import itertools

import pytest
import torch

import specdec
import specdec.engine.scoring as scoring_module
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.models.adapters import HFCausalLM
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify import speculative_verify
from specdec.verify.sampling import SamplingConfig
from tests.lawcheck import bin_violations, logits_to_probs
from tests.tiny import CharTokenizer, build, decode, hf_greedy


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    made = {}
    for arch in ("gpt2", "qwen2"):
        made[arch, "target"] = build(arch, 0, root / f"{arch}-target", layers=2, hidden=32)
        made[arch, "unrelated"] = build(arch, 1, root / f"{arch}-unrelated", layers=2, hidden=32)
        made[arch, "smaller"] = build(arch, 2, root / f"{arch}-smaller", layers=1, hidden=16)
    return made


def prompt_of(length: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (length,), generator=g).tolist()


# (prompt length, max_new_tokens) pairs cover 1..20 and {1, 8, 33}
SHAPES = [(1, 33), (7, 8), (20, 1), (12, 33)]


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
@pytest.mark.parametrize("draft_kind", ["target", "unrelated", "smaller", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 7, "auto"])
def test_greedy_equals_transformers_greedy(models, arch, draft_kind, k):
    target = models[arch, "target"]
    draft = "ngram" if draft_kind == "ngram" else models[arch, draft_kind]
    for prompt_len, max_new in SHAPES:
        prompt = prompt_of(prompt_len, seed=prompt_len)
        out = specdec.generate(prompt, target=target, draft=draft, max_new_tokens=max_new, num_draft_tokens=k)
        assert out.token_ids == hf_greedy(target, prompt, max_new), (prompt_len, max_new)
        assert len(out.token_ids) == max_new
        if draft_kind == "target" and out.metrics.drafted_tokens > out.metrics.lookup_tokens:
            assert out.metrics.draft_acceptance_rate == 1.0  # the draft's own drafts (copies may miss)


def test_cache_matches_fresh_forward_after_every_round(models):
    target, draft = models["qwen2", "target"], models["qwen2", "smaller"]
    target_adapter, draft_adapter = HFCausalLM(target), HFCausalLM(draft)
    checked = []

    def fresh_next_logits(model, sequence):
        with torch.inference_mode():
            return model(torch.tensor([sequence], device=model.device)).logits[0, -1]

    def check(engine):
        committed = engine.lengths()
        assert torch.equal(target_adapter.lengths.cpu(), committed - 1)  # the documented invariant
        assert bool((draft_adapter.lengths.cpu() <= committed - 1).all())
        for adapter, model in ((target_adapter, target), (draft_adapter, draft)):
            probe = copy.copy(adapter)
            probe.cache = copy.deepcopy(adapter.cache)
            cached = probe.feed(engine.sequences, torch.ones(len(engine.sequences), dtype=torch.bool))[:, -1]
            for row, sequence in enumerate(engine.sequences):
                assert torch.allclose(cached[row], fresh_next_logits(model, sequence), atol=1e-4)
        checked.append(len(engine.sequences))

    prompts = [prompt_of(3, 1), prompt_of(11, 2), prompt_of(6, 3)]
    for sampling in (SamplingConfig(temperature=0), SamplingConfig(temperature=1.0)):
        decode(
            target_adapter,
            ModelDrafter(draft_adapter),
            prompts,
            max_new_tokens=20,
            sampling=sampling,
            policy=DraftLengthPolicy(k=3),
            generator=torch.Generator(target.device).manual_seed(0),
            on_round=check,
        )
    assert len(checked) >= 10
    assert min(checked) < len(prompts), "finished rows leave the forwards (and the caches)"


def test_auto_drafts_past_its_k_while_the_draft_is_sure_and_right(models):
    """A draft equal to its target, greedy: every draft is accepted, so once the stop has learned
    that, it carries rounds past the k the policy chose (here held at 2), up to max_k; the output is
    still the target's greedy."""

    class HeldAtTwo(DraftLengthPolicy):  # auto (k=None), but choosing 2 every round
        def next_k(self) -> int:
            self.history.append(2)
            return 2

    target = models["qwen2", "target"]
    prompt = prompt_of(4, 11)
    policy, metrics = HeldAtTwo(k=None, max_k=8), specdec.SpeculativeMetrics()
    drafts = []  # drafted tokens so far, after each round
    batch, _ = decode(
        HFCausalLM(target),
        ModelDrafter(HFCausalLM(target)),
        [prompt],
        max_new_tokens=60,
        sampling=SamplingConfig(temperature=0),
        policy=policy,
        on_round=lambda engine: drafts.append(engine.rows[0].metrics.drafted_tokens),
        metrics=metrics,
    )
    per_round = [b - a for a, b in zip([0] + drafts, drafts)]
    assert batch[0].new_tokens == hf_greedy(target, prompt, 60)
    assert metrics.acceptance_rate == 1.0
    assert per_round[0] <= 3  # the stop's priors (0.7 a draft) allow little past k at first
    assert max(per_round) == 8 and per_round.count(8) >= len(per_round) // 2, per_round


def test_batch_rows_equal_solo_runs(models):
    target = models["gpt2", "target"]
    prompts = [prompt_of(2, 5), prompt_of(15, 6), prompt_of(8, 7)]
    for draft in (models["gpt2", "unrelated"], "ngram", models["gpt2", "target"]):
        batch = specdec.generate(prompts, target=target, draft=draft, max_new_tokens=25, num_draft_tokens=3)
        for prompt, row in zip(prompts, batch):
            solo = specdec.generate(prompt, target=target, draft=draft, max_new_tokens=25, num_draft_tokens=3)
            assert row.token_ids == solo.token_ids == hf_greedy(target, prompt, 25)


def test_eos_is_last_token_and_nothing_after(models):
    target = copy.deepcopy(models["qwen2", "target"])
    prompt = prompt_of(5, 9)
    free = hf_greedy(target, prompt, 30)
    eos = free[6]
    first = free.index(eos)
    target.generation_config.eos_token_id = eos
    for draft in (None, "ngram", models["qwen2", "target"], models["qwen2", "unrelated"]):
        out = specdec.generate(prompt, target=target, draft=draft, max_new_tokens=30, num_draft_tokens=4)
        assert out.token_ids == free[: first + 1]


def test_same_seed_same_tokens(models):
    kwargs = dict(
        target=models["gpt2", "target"],
        draft=models["gpt2", "smaller"],
        max_new_tokens=20,
        temperature=1.0,
        num_draft_tokens=3,
    )
    a = specdec.generate(prompt_of(4), seed=7, **kwargs)
    b = specdec.generate(prompt_of(4), seed=7, **kwargs)
    c = specdec.generate(prompt_of(4), seed=8, **kwargs)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids  # different seeds differ (20 tokens of near-uniform laws)


# ------------------------------------------------------------------ sampling laws


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    root = tmp_path_factory.mktemp("peaked")
    return (
        build("llama", 10, root / "t", vocab=8, sharpness=60.0),
        build("llama", 11, root / "d", vocab=8, sharpness=60.0),
    )


def exact_marginals(model, prompt, sampling, steps=3):
    """Law of each of the first `steps` generated tokens, by enumerating all continuations."""
    vocab = model.config.vocab_size
    prefixes, weights, marginals = [list(prompt)], torch.ones(1, dtype=torch.float64), []
    for _ in range(steps):
        with torch.inference_mode():
            logits = model(torch.tensor(prefixes, device=model.device)).logits[:, -1].cpu()
        law = logits_to_probs(logits, sampling).double() * weights[:, None]  # [prefixes, vocab] joint
        marginals.append(law.sum(0))
        prefixes = [p + [x] for p in prefixes for x in range(vocab)]
        weights = law.flatten()
    return marginals


def law_violations(model, draft, sampling, rows=3000, k=2, **options):  # 6 sigma at 3,000 rows, as tests/test_laws.py
    prompt = [1, 5, 2]
    out = specdec.generate(
        [prompt] * rows,
        target=model,
        draft=draft,
        max_new_tokens=3,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        num_draft_tokens=k,
        seed=0,
        **options,
    )
    samples = torch.tensor([r.token_ids for r in out])  # [rows, 3]
    problems = []
    for j, law in enumerate(exact_marginals(model, prompt, sampling)):
        counts = torch.bincount(samples[:, j], minlength=law.numel())
        problems += [f"token {j + 1}: {p}" for p in bin_violations(counts, law, rows)]
    return problems, out[0].batch_metrics


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3)])
def test_sampled_tokens_follow_target_law(peaked, sampling):
    target, draft = peaked
    problems, metrics = law_violations(target, draft, sampling)
    assert problems == []
    assert 0 < metrics.acceptance_rate < 1  # both paths (accept and recover) were exercised


def test_law_check_catches_always_accept(peaked, monkeypatch):
    target, draft = peaked

    def always_accept(target_probs, drafts, draft_probs=None, **kwargs):
        # Scores every draft against its own law (p == q): all accepted, bonus from the real row K.
        if draft_probs is None:  # no drafts this round
            return speculative_verify(target_probs, drafts, None, **kwargs)
        return speculative_verify(torch.cat([draft_probs, target_probs[:, -1:]], 1), drafts, draft_probs, **kwargs)

    monkeypatch.setattr(scoring_module, "speculative_verify", always_accept)
    problems, _ = law_violations(target, draft, SamplingConfig(temperature=1.0), draft_width=1)  # a chain
    assert problems != []


# ------------------------------------------------------------------ stops, streaming, errors


def test_stop_string_and_streaming(models):
    target = models["gpt2", "target"]
    prompt = prompt_of(4, 3)
    free = CharTokenizer().decode(hf_greedy(target, prompt, 20))
    stop = free[5:7]
    pieces = []
    out = specdec.generate(
        prompt,
        target=target,
        draft="ngram",
        max_new_tokens=20,
        tokenizer=CharTokenizer(),
        stop=[stop],
        stream=pieces.append,
    )
    assert out.text == free[: free.index(stop) + len(stop)]
    assert "".join(pieces) == out.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"num_draft_tokens": "many"}, "num_draft_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": []}, "empty"),
        ({"prompt": ""}, "empty"),
        ({"prompt": [3, 999]}, "outside the target's vocabulary"),
        ({"prompt": "abc"}, "tokenizer"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_bad_arguments_raise_value_error(models, kwargs, message):
    args = {"prompt": [1, 2, 3], "target": models["gpt2", "target"], "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        specdec.generate(args.pop("prompt"), **args)


def test_vocabulary_mismatch_names_both_sizes(models, tmp_path):
    other = build("gpt2", 3, tmp_path / "v", vocab=50)
    with pytest.raises(ValueError, match="50.*96|96.*50"):
        specdec.generate([1, 2], target=models["gpt2", "target"], draft=other, max_new_tokens=4)


def test_non_finite_logits_name_the_model_and_step(models):
    broken = copy.deepcopy(models["qwen2", "unrelated"])
    with torch.no_grad():
        broken.get_output_embeddings().weight.fill_(float("nan"))
    with pytest.raises(ValueError, match=r"draft model .* step 1"):
        specdec.generate([1, 2], target=models["qwen2", "target"], draft=broken, max_new_tokens=4)
    with pytest.raises(ValueError, match=r"target model .* step 1"):
        specdec.generate([1, 2], target=broken, max_new_tokens=4)
    drafter = ModelDrafter(HFCausalLM(broken), stop_below=None)  # no stop: its check is read with the verify result
    with pytest.raises(ValueError, match=r"draft model .* step 1"):
        specdec.generate([1, 2], target=models["qwen2", "target"], draft=drafter, max_new_tokens=4, draft_width=1)


def test_prompt_longer_than_context_says_so(models):
    with pytest.raises(ValueError, match="context"):
        specdec.generate(
            list(itertools.islice(itertools.cycle(range(90)), 600)), target=models["gpt2", "target"], max_new_tokens=4
        )


def test_ngram_drafter_finds_repeats():
    drafter = NgramDrafter(max_ngram=3)
    assert drafter.find([1, 2, 3, 4, 9, 1, 2, 3], 3)[1] == [4, 9, 1]
    assert drafter.find([5, 6, 7], 3)[1] == []


def test_ngram_earliest_and_latest_matches():
    sequence = [7, 1, 2, 5, 1, 2, 6, 1, 2]
    assert NgramDrafter(max_ngram=2).find(sequence, 2)[1] == [5, 1]
    assert NgramDrafter(max_ngram=2, match="latest").find(sequence, 2)[1] == [6, 1]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_tree_forward_scores_every_node_as_a_fresh_forward_over_its_path(arch, tmp_path):
    """HFCausalLM.forward(parents=...): each node's logits equal a fresh forward over the committed
    tokens plus its path (ragged rows, an invalid node); keep_path then rollback leaves a chain cache
    whose next logits equal a fresh forward; select_rows drops a row and keeps the other's cache."""
    model = build(arch, 3, tmp_path / arch)
    adapter = HFCausalLM(model)
    adapter.reset(2)
    sequences = [[5, 6, 7, 8], [9, 10]]
    tokens = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    parents = torch.tensor([[-1, 0, 1, -1, 0], [-1, 0, 1, -1, 0]])  # chain 0-1-2, siblings 3 (root) and 4 (of 0)
    valid = torch.tensor([[True] * 5, [True, True, False, True, True]])
    logits = adapter.feed(sequences, torch.ones(2, dtype=torch.bool), tokens, valid, 6, extra_parents=parents)

    def fresh(ids):
        with torch.inference_mode():
            return model(torch.tensor([ids], device=model.device)).logits[0, -1]

    def path(row, node):
        out = []
        while node >= 0:
            out.append(int(tokens[row, node]))
            node = int(parents[row, node])
        return out[::-1]

    for row in range(2):
        assert torch.allclose(logits[row, 0], fresh(sequences[row]), atol=1e-4)
        for node in range(5):
            if valid[row, node]:
                assert torch.allclose(logits[row, 1 + node], fresh(sequences[row] + path(row, node)), atol=1e-4)
    keep = torch.zeros(2, 5, dtype=torch.bool)
    keep[0, [0, 4]] = True  # row 0 took chain node 0, then its sibling 4
    keep[1, 3] = True  # row 1 took the root's sibling 3
    adapter.keep_path(keep)
    committed = [sequences[0] + [11, 15, 30], sequences[1] + [24, 31]]
    adapter.rollback(torch.tensor([len(c) - 1 for c in committed]))
    after = adapter.feed(committed, torch.ones(2, dtype=torch.bool))[:, -1]
    for row in range(2):
        assert torch.allclose(after[row], fresh(committed[row]), atol=1e-4)
    adapter.select_rows(torch.tensor([1]))
    committed[1].append(32)
    alone = adapter.feed(committed[1:], torch.ones(1, dtype=torch.bool))[:, -1]
    assert torch.allclose(alone[0], fresh(committed[1]), atol=1e-4)
    assert int(adapter.lengths[0]) == adapter.num_slots == len(committed[1])  # the left padding is gone too
