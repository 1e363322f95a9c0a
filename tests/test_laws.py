"""Engine-level output laws: `specdec.generate` against transformers' own sampling law.

The models are tiny (a vocabulary of 8), so the exact law of the first three generated
tokens is enumerated from the target alone (tests/lawcheck.outcome_law, built from
transformers' warpers in generate's order: temperature, top-k, top-p). Each case runs
ROWS copies of its prompt as one batch with one seed and compares, per bin at 6 sigma,
every position's marginal law and the joint law of whole outcomes.

Broken variants that the same check must catch: a draft that hands verification
softmax(raw logits) while sampling from the warped law (transformers #32867), and
top-p applied before top-k (the samples must reject that law). tools/mutants.py
plants more (residual, bonus position, rollback, EOS, hole masks, shared seeds).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

import specdec
from specdec.drafters import ModelDrafter
from specdec.metrics import SpeculativeMetrics
from specdec.models.adapters import HFCausalLM
from specdec.models.quantize import quantize_int8
from tests.lawcheck import generate_law, generate_warpers, outcome_law, outcome_violations
from tests.tiny import CharTokenizer, build, hf_greedy, perturbed

ROWS = 3000
STEPS = 3  # tokens generated per row: the first round drafts up to 2, the bonus or recovered token is the 3rd
VOCAB = 8
PROMPT = [1, 5, 2]
REPEATS = [2, 6, 4, 2, 6]  # the n-gram drafter finds [2, 6] earlier and proposes what followed it
EOS = 6  # likely after PROMPT: rows end inside the first window


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("law-models")
    target = build("llama", 20, root / "target", layers=1, hidden=16, vocab=VOCAB, sharpness=20.0)
    near = perturbed(target, 0.5, seed=21)  # agrees often, not always: both accept and recover paths run
    eos_target = copy.deepcopy(target)
    eos_target.generation_config.eos_token_id = EOS
    return {
        "target": target,
        "near": near,
        "eos-target": eos_target,
        "int8": quantize_int8(copy.deepcopy(near)),
        "vocab-12": resized(near, 12, seed=22),
        "vocab-6": resized(near, 6, seed=23),
    }


def resized(model, vocab: int, seed: int):
    """A copy of model with a vocabulary of `vocab` tokens: shared ids keep their embedding and
    head rows, new ids get random ones. Exercises the drafter's vocabulary cut (larger) and pad (smaller)."""
    config = copy.deepcopy(model.config)
    config.vocab_size = vocab
    torch.manual_seed(seed)
    other = type(model)(config).eval()
    shared = min(vocab, model.config.vocab_size)
    state = {}
    for name, tensor in model.state_dict().items():
        mine = other.state_dict()[name]
        if mine.shape == tensor.shape:
            state[name] = tensor
        else:  # embedding or head: [vocab, hidden]
            mine = mine.clone() * float(tensor.std() / mine.std().clamp_min(1e-12))
            mine[:shared] = tensor[:shared]
            state[name] = mine
    other.load_state_dict(state)
    return other


@dataclass(frozen=True)
class Case:
    draft: str  # a key of `models`, "target" (the target drafts for itself), or "ngram"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    k: int | str = 2
    prompts: tuple[tuple[int, ...], ...] = (tuple(PROMPT),)
    eos: bool = False
    verification: str = "token"
    width: int | str = 1  # draft_width: > 1 or "auto" grows draft trees
    lookup: bool | str = "auto"  # prompt_lookup: copy drafts after the chain (specdec.drafters.lookup)


CASES = {
    "T1-model-k2": Case("near"),
    "T0.7-top3-model-k3": Case("near", temperature=0.7, top_k=3, k=3),
    "top-p-model-k2": Case("near", top_p=0.7),
    "top3-top-p-model-k2": Case("near", temperature=0.7, top_k=3, top_p=0.75),
    "top4-top-p-ngram-k3": Case("ngram", temperature=0.8, top_k=4, top_p=0.8, k=3, prompts=(tuple(REPEATS),)),
    "top-p-ngram-auto": Case("ngram", top_p=0.7, k="auto", prompts=(tuple(REPEATS),)),
    "draft-is-target-k3": Case("target", temperature=0.7, top_k=4, k=3),
    "eos-in-window-model-k3": Case("near", k=3, eos=True),
    "ragged-batch-eos-top-p-k2": Case("near", top_p=0.9, eos=True, prompts=((4,), (3, 1, 5, 2), (1, 7, 7, 0, 3, 2))),
    "int8-draft-top3-k3": Case("int8", temperature=0.7, top_k=3, k=3),
    "draft-vocab-larger-k3": Case("vocab-12", temperature=0.9, k=3),
    "block-T0.7-top3-model-k3": Case("near", temperature=0.7, top_k=3, k=3, verification="block"),
    "block-ragged-eos-top-p-k3": Case(
        "near", top_p=0.9, k=3, eos=True, prompts=((4,), (3, 1, 5, 2)), verification="block"
    ),
    "race-T1-model-k3": Case("near", k=3, verification="race"),
    "race-top-p-ngram-auto": Case("ngram", top_p=0.8, k="auto", prompts=(tuple(REPEATS),), verification="race"),
    "draft-vocab-smaller-top-p-k3": Case("vocab-6", top_p=0.9, k=3),
    "tree-w3-T1-model-k2": Case("near", width=3),
    "tree-w2-top3-top-p-model-k3": Case("near", temperature=0.7, top_k=3, top_p=0.75, k=3, width=2),
    "tree-w3-ragged-eos-top-p-k2": Case(
        "near", top_p=0.9, eos=True, prompts=((4,), (3, 1, 5, 2), (1, 7, 7, 0, 3, 2)), width=3
    ),
    "tree-auto-T0.7-model-auto": Case("near", temperature=0.7, k="auto", width="auto"),
    "tree-race-w3-T1-model-k3": Case("near", k=3, verification="race", width=3),
    # copies after a one-draft chain (sampled: one-hot laws after the draft's), after none, in a tree
    "lookup-T1-model-k1": Case("near", k=1, prompts=(tuple(REPEATS),), lookup=True),
    "lookup-alone-T1": Case("none", k=1, prompts=(tuple(REPEATS),), lookup=True),
    "lookup-ragged-eos-top-p-k1": Case("near", top_p=0.9, k=1, eos=True, prompts=((4,), tuple(REPEATS)), lookup=True),
    "lookup-tree-w2-T0.8-k1": Case("near", temperature=0.8, k=1, width=2, prompts=(tuple(REPEATS),), lookup=True),
    "lookup-block-T1-k1": Case("near", k=1, prompts=(tuple(REPEATS),), verification="block", lookup=True),
    "lookup-race-T1-k1": Case("near", k=1, prompts=(tuple(REPEATS),), verification="race", lookup=True),
}


def drafter_for(case: Case, models, drafter_class=ModelDrafter):
    if case.draft in ("ngram", "none"):
        return None if case.draft == "none" else "ngram"
    if case.draft == "target":
        return models["target"]
    if case.draft.startswith("vocab-") or drafter_class is not ModelDrafter:
        # Passed as a drafter: generate() refuses a vocabulary mismatch between loaded models without a tokenizer.
        return drafter_class(HFCausalLM(models[case.draft]), vocab_size=VOCAB)
    return models[case.draft]


def run(case: Case, models, drafter_class=ModelDrafter, rows: int = ROWS):
    """-> {prompt: list of generated rows}, metrics. Rows of all prompts interleave in one batch."""
    prompts = [list(p) for _ in range(rows) for p in case.prompts]
    metrics = SpeculativeMetrics()
    out = specdec.generate(
        prompts,
        target=models["eos-target" if case.eos else "target"],
        draft=drafter_for(case, models, drafter_class),
        max_new_tokens=STEPS,
        num_draft_tokens=case.k,
        temperature=case.temperature,
        top_k=case.top_k,
        top_p=case.top_p,
        seed=0,
        metrics=metrics,
        verification=case.verification,
        draft_width=case.width,
        prompt_lookup=case.lookup,
    )
    by_prompt = {p: [] for p in case.prompts}
    for row in out:
        by_prompt[tuple(row.prompt_ids)].append(row.token_ids)
    return by_prompt, metrics


def law_of(case: Case, models, prompt, warpers=None):
    return outcome_law(
        models["target"],
        prompt,
        STEPS,
        temperature=case.temperature,
        top_k=case.top_k,
        top_p=case.top_p,
        eos_ids=[EOS] if case.eos else [],
        warpers=warpers,
    )


def violations(case: Case, models, outputs, warpers=None) -> list[str]:
    problems = []
    for prompt, rows in outputs.items():
        law = law_of(case, models, prompt, warpers)
        problems += [f"prompt {list(prompt)}: {p}" for p in outcome_violations(rows, law)]
    return problems


_runs: dict[str, tuple] = {}  # case name -> (outputs, metrics): the broken-variant checks reuse runs


def cached_run(name: str, models):
    if name not in _runs:
        _runs[name] = run(CASES[name], models)
    return _runs[name]


@pytest.mark.parametrize("name", list(CASES))
def test_output_law_matches_transformers(models, name):
    case = CASES[name]
    outputs, metrics = cached_run(name, models)
    assert violations(case, models, outputs) == []
    if case.draft != "target":
        assert 0 < metrics.acceptance_rate < 1, "both paths (accept and recover) must run"
    else:
        # p == q up to float rounding between the two forwards: every draft is accepted, bonus tokens run
        assert metrics.acceptance_rate > 0.999 and metrics.bonus_tokens > ROWS // 2
    if case.draft != "ngram":
        assert len(metrics.accepted_per_position) >= 2, "some windows must accept two drafts"
    if case.eos:
        ended = sum(len(r) < STEPS for rows in outputs.values() for r in rows)
        assert ended > ROWS // 10, "EOS must end a good share of rows early"
    if case.width != 1:
        assert metrics.sibling_tokens > ROWS // 20, "trees must end rounds on an accepted sibling"
    if case.lookup is True:
        assert 0 < metrics.lookup_accepted < metrics.lookup_tokens, "copies must be both accepted and rejected"


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 3, 0.75), (1.0, 0, 0.7), (0.8, 4, 1.0)])
def test_reference_law_is_the_one_generate_samples_from(models, temperature, top_k, top_p):
    """lawcheck's reference equals softmax of the scores transformers' generate() samples from."""
    target = models["target"]
    prompts = torch.tensor([PROMPT, [3, 3, 7], [0, 4, 1]])
    out = target.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        do_sample=True,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=1,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    with torch.inference_mode():
        logits = target(prompts).logits[:, -1]
    law = generate_law(logits, temperature, top_k, top_p)
    assert torch.allclose(torch.softmax(out.scores[0].float(), -1).double(), law, atol=1e-6)


# ------------------------------------------------------------------ broken variants the check must catch


class UnwarpedDraftProbs(ModelDrafter):
    """transformers #32867: draws each draft token from the warped law but hands verification
    softmax(raw logits) as its law. (Hooks ModelDrafter._next_logits, which every draft logit
    passes through; if that name changes, this variant stops planting the bug and its test fails.)"""

    def _next_logits(self, raw, active, generator, flags):
        logits = super()._next_logits(raw, active, generator, flags)
        self.raw_logits.append(logits)
        return logits

    def propose(self, *args, **kwargs):
        self.raw_logits = []
        proposal = super().propose(*args, **kwargs)
        if proposal.probs is not None:
            width = proposal.probs.shape[1]
            proposal.probs = torch.stack([torch.softmax(x.float(), -1) for x in self.raw_logits[:width]], 1)
        return proposal


def test_check_catches_draft_probs_from_raw_logits(models):
    case = CASES["T0.7-top3-model-k3"]
    outputs, _ = run(case, models, drafter_class=UnwarpedDraftProbs)
    assert any(p.startswith(f"prompt {PROMPT}: token 1,") for p in violations(case, models, outputs))


def test_check_catches_tree_verified_with_the_wrong_draft_law(models, monkeypatch):
    """A tree whose chain drafts are judged against a law they were not drawn from (uniform):
    the tree form of #32867. The siblings' residual then comes from the wrong q as well."""
    import specdec.engine.trees

    exact = specdec.engine.trees.tree_verify

    def wrong_q(target_probs, *args, draft_probs=None, **kwargs):
        if draft_probs is not None:
            draft_probs = torch.full_like(draft_probs, 1 / draft_probs.shape[-1])
        return exact(target_probs, *args, draft_probs=draft_probs, **kwargs)

    monkeypatch.setattr(specdec.engine.trees, "tree_verify", wrong_q)
    case = CASES["tree-w3-T1-model-k2"]
    outputs, _ = run(case, models)
    assert violations(case, models, outputs) != []


def test_check_catches_copies_judged_against_a_law_they_were_not_drawn_from(models, monkeypatch):
    """Copy drafts after a sampled chain judged by a uniform q instead of their point mass:
    accepted with min(1, p V) rather than p, so the check must reject the output."""
    import specdec.drafters.lookup

    exact = specdec.drafters.lookup.copy_laws

    def uniform_copies(probs, lengths, added, width):
        laws = exact(probs, lengths, added, width)
        for row, copied in enumerate(added):
            start = int(lengths[row])
            laws[row, start : start + len(copied)] = 1 / laws.shape[-1]
        return laws

    monkeypatch.setattr(specdec.drafters.lookup, "copy_laws", uniform_copies)
    case = CASES["lookup-T1-model-k1"]
    outputs, _ = run(case, models)
    assert violations(case, models, outputs) != []


def test_check_catches_top_p_before_top_k(models):
    name = "top3-top-p-model-k2"
    case = CASES[name]
    outputs, _ = cached_run(name, models)
    right = generate_warpers(case.temperature, case.top_k, case.top_p)
    swapped = LogitsProcessorList([right[0], right[2], right[1]])
    assert [type(w) for w in swapped[1:]] == [TopPLogitsWarper, TopKLogitsWarper]
    assert violations(case, models, outputs, warpers=swapped) != []


# ------------------------------------------------------------------ caches, checked at every forward


class CheckedLM(HFCausalLM):
    """An adapter that checks every feed: each active row's next-token logits after its committed
    tokens equal a fresh forward over them (a stale draft left in the cache, or a hole attended
    to, shows here even where the output law cannot see it: a draft's cache only moves acceptance)."""

    checks = 0

    def feed(self, sequences, active, extra=None, extra_valid=None, keep_logits=1, extra_parents=None):
        logits = super().feed(sequences, active, extra, extra_valid, keep_logits, extra_parents)
        after_committed = logits[:, -1 - (0 if extra is None else extra.shape[1])]  # [batch, vocab]
        for row in active.nonzero().flatten().tolist():
            with torch.inference_mode():
                fresh = self.model(torch.tensor([list(sequences[row])], device=self.device)).logits[0, -1]
            assert torch.allclose(after_committed[row], fresh, atol=1e-4), f"{self.name}: row {row} is stale"
            self.checks += 1
        return logits


@pytest.mark.parametrize("width", [1, 3])
def test_caches_match_fresh_forwards_in_a_sampled_ragged_batch(models, width):
    target, draft = CheckedLM(models["eos-target"], "target"), CheckedLM(models["near"], "draft")
    prompts = [[4], [3, 1, 5, 2], [1, 7, 7, 0, 3, 2], [2, 2], [6, 0, 1], [5, 5, 5, 5, 5]]
    metrics = SpeculativeMetrics()
    out = specdec.generate(
        prompts * 4,
        target=target,
        draft=ModelDrafter(draft, vocab_size=VOCAB, stop_below=0.4),  # ragged draft lengths across rows
        max_new_tokens=12,
        num_draft_tokens=3,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        seed=1,
        metrics=metrics,
        draft_width=width,
    )
    assert len({len(r.token_ids) for r in out}) > 1, "rows must end at different rounds (EOS)"
    if width > 1:
        assert metrics.sibling_tokens > 0 and metrics.tree_nodes > 0, "paths through siblings, then rollback"
    assert metrics.recovered_tokens > 0 and len(metrics.accepted_per_position) >= 2
    assert len(metrics.drafted_per_position) >= 3, "drafts fed to the draft model, then rejected"
    assert target.checks >= 40 and draft.checks >= 40


# ------------------------------------------------------------------ batches with EOS and stop strings (greedy)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    target = build("llama", 30, root / "target", layers=2, hidden=32)
    return target, perturbed(target, 0.3, seed=31)


WIDE_PROMPTS = [[5, 17, 3], [40, 2, 2, 9, 71, 33, 6, 12, 50], [8], [60, 61, 62, 63, 1, 2]]


@pytest.mark.parametrize("draft_kind", ["model", "ngram"])
def test_batch_rows_with_eos_equal_solo_runs(wide, draft_kind):
    target, near = wide
    draft = near if draft_kind == "model" else "ngram"
    free = [hf_greedy(target, p, 16) for p in WIDE_PROMPTS]
    eos = free[0][4]  # ends row 0 mid-run; other rows end where (if) they produce it
    expected = [f[: f.index(eos) + 1] if eos in f else f for f in free]
    assert len({len(e) for e in expected}) > 1, "rows must end at different rounds"
    eos_target = copy.deepcopy(target)
    eos_target.generation_config.eos_token_id = eos
    kwargs = dict(target=eos_target, draft=draft, max_new_tokens=16, num_draft_tokens=3, temperature=0)
    batch = specdec.generate(WIDE_PROMPTS, **kwargs)
    assert [r.token_ids for r in batch] == expected
    assert [specdec.generate(p, **kwargs).token_ids for p in WIDE_PROMPTS] == expected


def stop_cut(prompt: list[int], new: list[int], stop: str) -> list[int]:
    """New tokens through the first one that completes `stop` (CharTokenizer: one character a token),
    counting a stop string that begins in the prompt, as transformers' StopStringCriteria does."""
    text = CharTokenizer().decode(prompt + new)
    for i in range(len(new)):
        if text[: len(prompt) + i + 1].endswith(stop):
            return new[: i + 1]
    return new


def test_batch_rows_with_stop_strings_equal_solo_runs(wide):
    target, near = wide
    free = [hf_greedy(target, p, 16) for p in WIDE_PROMPTS]
    stop = CharTokenizer().decode(free[1][5:7])
    expected = [stop_cut(p, f, stop) for p, f in zip(WIDE_PROMPTS, free)]
    assert len(expected[1]) <= 7 and len({len(e) for e in expected}) > 1
    kwargs = dict(
        target=target, draft=near, max_new_tokens=16, num_draft_tokens=3, temperature=0, tokenizer=CharTokenizer()
    )
    batch = specdec.generate(WIDE_PROMPTS, stop=[stop], **kwargs)
    assert [r.token_ids for r in batch] == expected
    assert [specdec.generate(p, stop=stop, **kwargs).token_ids for p in WIDE_PROMPTS] == expected


def test_target_alone_reading_ahead_follows_the_target_law(models):
    # The target alone with read-ahead (CUDA's default, forced here): a sampled ragged batch with top-p and EOS
    # (rows that end while their next round is already queued) still follows the target's law, row by row.
    from specdec.drafters import NoDrafter
    from specdec.tuning.policy import DraftLengthPolicy
    from specdec.verify.sampling import SamplingConfig
    from tests.tiny import decode

    case = Case("target", top_p=0.9, eos=True, prompts=((4,), (3, 1, 5, 2)))
    prompts = [list(p) for _ in range(ROWS) for p in case.prompts]
    batch, metrics = decode(
        HFCausalLM(models["target"]),
        NoDrafter(),
        prompts,
        max_new_tokens=STEPS,
        sampling=SamplingConfig(temperature=case.temperature, top_p=case.top_p),
        policy=DraftLengthPolicy(k=0),
        eos_ids={EOS},
        generator=torch.Generator().manual_seed(0),
        read_ahead=True,
    )
    outputs = {p: [] for p in case.prompts}
    for row, prompt in enumerate(prompts):
        outputs[tuple(prompt)].append(batch[row].new_tokens)
    assert violations(case, models, outputs) == []
    ended = sum(len(r) < STEPS for rows in outputs.values() for r in rows)
    assert ended > ROWS // 10, "EOS must end a good share of rows early"
    assert metrics.generated_tokens == sum(len(r) for rows in outputs.values() for r in rows)
