"""Cross-tokenizer drafting (specdec.drafters.crosstok) on tiny models with two different tokenizers.

The target reads one token per character of ALPHABET (8 ids); the draft's tokenizer is a BPE over
the same characters with longer tokens ("ab", "abc", " a", ...) and its ids in another order. The
draft model copies the target's rows for its single characters (so it agrees often), reads a longer
token like its last character and predicts it like its first (so it puts real mass on tokens the
target does not have). Exact laws of the first three tokens are enumerated from the target
(tests/lawcheck.py), as in tests/test_laws.py.

The drafter also drafts trees: the draft's runners-up, re-encoded, become point-mass siblings where
their target tokens part from the chain's (law cases with draft_width 2 and 3, greedy equality).

Broken variants the same checks must catch: the drafter handing verification the draft's own law
over its ids (chain and tree).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

import specdec
from specdec.drafters.crosstok import CommittedText, CrossTokenizerDrafter, decode
from specdec.metrics import SpeculativeMetrics
from specdec.models.adapters import HFCausalLM
from tests.lawcheck import outcome_law, outcome_violations
from tests.tiny import build, hf_greedy, perturbed

ALPHABET = "abcdef ."  # the target's tokens, one per character
MERGES = [("a", "b"), ("c", "d"), ("ab", "c"), (" ", "a"), ("e", "f"), (" ", "b")]  # the draft's longer tokens
ROWS = 3000
STEPS = 3
PROMPTS = [[0, 1, 6, 2], [4, 6, 0, 7, 3], [5], [2, 3, 0, 1, 6, 6, 4], [1, 0]]


def target_tokenizer() -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(ALPHABET)}, unk_token="."))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def draft_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """BPE with words that carry their leading space (GPT-2's way); merged tokens get the low ids."""
    merged = [a + b for a, b in MERGES if set(a + b) <= set(alphabet)]
    vocab = {token: i for i, token in enumerate(merged)}
    for c in reversed(alphabet):
        vocab[c] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[m for m in MERGES if m[0] + m[1] in vocab]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(" ?[^ ]+| +"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core)


def draft_model(target, tokenizer, directory, seed: int, scale: float):
    """A draft in the draft tokenizer's ids, saved with that tokenizer (so generate() finds it)."""
    config = copy.deepcopy(target.config)
    config.vocab_size = len(tokenizer)
    draft = type(target)(config).eval()
    state = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    embed, head = state["model.embed_tokens.weight"], state["lm_head.weight"]
    rows = {token: (ALPHABET.index(token[-1]), ALPHABET.index(token[0])) for token in tokenizer.get_vocab()}
    order = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    state["model.embed_tokens.weight"] = torch.stack([embed[rows[token][0]] for token, _ in order])
    state["lm_head.weight"] = torch.stack([head[rows[token][1]] for token, _ in order])
    draft.load_state_dict(state)
    draft = perturbed(draft, scale, seed)
    draft.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("crosstok")
    target = build("llama", 40, root / "target", layers=1, hidden=16, vocab=len(ALPHABET), sharpness=20.0)
    tokenizer = target_tokenizer()
    tokenizer.save_pretrained(root / "target")
    draft = draft_model(target, draft_tokenizer(), root / "draft", seed=41, scale=0.4)
    return {
        "root": root,
        "target": target,
        "draft": draft,
        "tokenizer": tokenizer,
        "draft_tokenizer": AutoTokenizer.from_pretrained(root / "draft"),
    }


def drafter(pair, cls=CrossTokenizerDrafter, **options) -> CrossTokenizerDrafter:
    adapter = HFCausalLM(pair["draft"])
    return cls(adapter, pair["draft_tokenizer"], pair["tokenizer"], len(ALPHABET), **options)


# ------------------------------------------------------------------ wiring, errors, text bookkeeping


def test_a_draft_with_another_tokenizer_is_drafted_through_text(pair):
    decoder = specdec.SpeculativeDecoder(pair["target"], pair["draft"], pair["tokenizer"])
    assert isinstance(decoder.drafter, CrossTokenizerDrafter)


def test_from_pretrained_drafts_through_text_for_a_draft_with_another_tokenizer(pair):
    root = pair["root"]
    decoder = specdec.SpeculativeDecoder.from_pretrained(
        str(root / "target"), str(root / "draft"), device="cpu", dtype="float32"
    )
    assert isinstance(decoder.drafter, CrossTokenizerDrafter)
    out = decoder.generate(PROMPTS[0], max_new_tokens=12, temperature=0, num_draft_tokens=3)
    assert out.token_ids == hf_greedy(pair["target"], PROMPTS[0], 12)


def test_incompatible_pairs_are_clear_errors(pair, tmp_path):
    # A draft whose tokenizer cannot spell the target's text ("e", "f" and "." are missing).
    narrow = draft_model(pair["target"], draft_tokenizer("abcd "), tmp_path / "narrow", seed=42, scale=0.1)
    with pytest.raises(ValueError, match="disagree.*does not return the target's text"):
        specdec.SpeculativeDecoder(pair["target"], narrow, pair["tokenizer"])
    # No tokenizers known: the vocabulary check stands.
    bare_target, bare_draft = copy.deepcopy(pair["target"]), copy.deepcopy(pair["draft"])
    bare_target.config._name_or_path = bare_draft.config._name_or_path = ""
    with pytest.raises(ValueError, match="vocabularies disagree"):
        specdec.generate(PROMPTS[0], target=bare_target, draft=bare_draft, max_new_tokens=2)


def test_committed_text_and_draft_ids_stay_in_step(pair):
    """Target tokens arrive in rounds of 1-4; each sync keeps the text exact and the draft ids equal
    to the draft tokenizer's own encoding of the whole text, while re-encoding only a short tail."""
    text = CommittedText(pair["draft_tokenizer"], pair["tokenizer"])
    text.reset(1)
    generator = torch.Generator().manual_seed(0)
    sequence = [0, 1, 6]
    choices = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6, 6, 7])  # spaces are frequent: words stay short
    windows = []
    for _ in range(40):
        count = int(torch.randint(1, 5, (1,), generator=generator))
        sequence += choices[torch.randint(0, len(choices), (count,), generator=generator)].tolist()
        row = text.rows[0]
        start = row.marks[-2][1] if len(row.marks) > 1 else 0  # where this round re-encodes from
        assert text.sync(0, sequence)
        windows.append(len(row.text) - start)
        assert row.text == decode(pair["tokenizer"], sequence)
        assert row.ids == pair["draft_tokenizer"](row.text)["input_ids"]
    assert len(sequence) > 100 and max(windows) <= 24, "each round re-encodes a short tail, never the whole text"


# ------------------------------------------------------------------ greedy: token for token


def test_greedy_equals_transformers_greedy(pair):
    expected = [hf_greedy(pair["target"], p, 24) for p in PROMPTS]
    decoder = specdec.SpeculativeDecoder(pair["target"], pair["draft"], pair["tokenizer"])
    metrics = SpeculativeMetrics()
    batch = decoder.generate(PROMPTS, max_new_tokens=24, num_draft_tokens=3, temperature=0, metrics=metrics)
    assert [r.token_ids for r in batch] == expected
    assert [decoder.generate(p, max_new_tokens=24, temperature=0).token_ids for p in PROMPTS[:2]] == expected[:2]
    assert 0 < metrics.acceptance_rate < 1 and metrics.drafted_tokens > 50


@pytest.mark.parametrize("width", [2, 3, "auto"])
def test_greedy_trees_equal_transformers_greedy(pair, width):
    expected = [hf_greedy(pair["target"], p, 24) for p in PROMPTS]
    decoder = specdec.SpeculativeDecoder(pair["target"], pair["draft"], pair["tokenizer"])
    metrics = SpeculativeMetrics()
    batch = decoder.generate(
        PROMPTS, max_new_tokens=24, num_draft_tokens=3, temperature=0, metrics=metrics, draft_width=width
    )
    assert [r.token_ids for r in batch] == expected
    if width != "auto":  # a fixed width always scores siblings, and some win
        assert metrics.tree_nodes > 0 and metrics.sibling_tokens > 0


def test_greedy_with_copy_drafts_equals_transformers_greedy(pair):
    """Copy drafts (prompt lookup) after a cross-tokenizer chain: the drafter's text state follows
    the committed tokens it never drafted."""
    expected = [hf_greedy(pair["target"], p, 24) for p in PROMPTS]
    decoder = specdec.SpeculativeDecoder(pair["target"], pair["draft"], pair["tokenizer"])
    metrics = SpeculativeMetrics()
    batch = decoder.generate(
        PROMPTS, max_new_tokens=24, num_draft_tokens=2, temperature=0, metrics=metrics, prompt_lookup=True
    )
    assert [r.token_ids for r in batch] == expected
    assert metrics.lookup_tokens > 0 and metrics.drafted_tokens > metrics.lookup_tokens


def test_greedy_from_a_text_prompt_with_auto_k(pair):
    prompt = "ab cab. fe"
    ids = pair["tokenizer"](prompt)["input_ids"]
    out = specdec.generate(
        prompt,
        target=pair["target"],
        draft=pair["draft"],
        tokenizer=pair["tokenizer"],
        max_new_tokens=30,
        num_draft_tokens="auto",
        temperature=0,
    )
    assert out.token_ids == hf_greedy(pair["target"], ids, 30)
    assert out.metrics.accepted_tokens > 0


# ------------------------------------------------------------------ sampled laws


@dataclass(frozen=True)
class Case:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    k: int = 2
    verification: str = "token"
    prompts: tuple[tuple[int, ...], ...] = (tuple(PROMPTS[0]),)
    width: int | str = 1


CASES = {
    "text-T1-k2": Case(),
    "text-T0.7-top3-k3-ragged": Case(temperature=0.7, top_k=3, k=3, prompts=(tuple(PROMPTS[0]), (5,))),
    "text-race-k3": Case(k=3, verification="race"),
    "text-tree-w2-T1-k3": Case(k=3, width=2),
    "text-tree-w3-T0.8-k3-ragged": Case(temperature=0.8, k=3, width=3, prompts=(tuple(PROMPTS[0]), (5,))),
    "text-tree-w2-race-k3": Case(k=3, width=2, verification="race"),
}


def run(pair, case: Case, cls=CrossTokenizerDrafter):
    """-> {prompt: generated rows}, metrics. Rows of all prompts interleave in one batch; drafting is not
    cut short by the draft's confidence, so that rounds accept several drafts."""
    metrics = SpeculativeMetrics()
    out = specdec.generate(
        [list(p) for _ in range(ROWS) for p in case.prompts],
        target=pair["target"],
        draft=drafter(pair, cls, stop_below=None),
        tokenizer=pair["tokenizer"],
        max_new_tokens=STEPS,
        num_draft_tokens=case.k,
        temperature=case.temperature,
        top_k=case.top_k,
        top_p=case.top_p,
        seed=0,
        metrics=metrics,
        verification=case.verification,
        draft_width=case.width,
    )
    outputs = {p: [] for p in case.prompts}
    for row in out:
        outputs[tuple(row.prompt_ids)].append(row.token_ids)
    return outputs, metrics


def violations(pair, case: Case, outputs) -> list[str]:
    problems = []
    for prompt, rows in outputs.items():
        law = outcome_law(
            pair["target"], prompt, STEPS, temperature=case.temperature, top_k=case.top_k, top_p=case.top_p
        )
        problems += [f"prompt {list(prompt)}: {p}" for p in outcome_violations(rows, law)]
    return problems


@pytest.mark.parametrize("name", list(CASES))
def test_output_law_matches_transformers(pair, name):
    case = CASES[name]
    outputs, metrics = run(pair, case)
    assert violations(pair, case, outputs) == []
    assert 0 < metrics.acceptance_rate < 1, "both paths (accept and recover) must run"
    assert len(metrics.accepted_per_position) >= 2, "some rounds must accept two drafts"
    if case.width != 1:
        assert metrics.tree_nodes > 0 and metrics.sibling_tokens > 0, "siblings must be scored, and some win"


class DraftLawInTextMode(CrossTokenizerDrafter):
    """Broken: text mode hands verification the draft's softmax over its own ids (cut to the target's
    vocabulary) as if the target tokens had been drawn from it."""

    def _choose(self, scores, *args):
        self.seen = [*getattr(self, "seen", []), torch.softmax(scores, -1)[:, : self.vocab_size]]
        return super()._choose(scores, *args)

    def propose(self, *args, **kwargs):
        self.seen = []
        proposal = super().propose(*args, **kwargs)
        width = proposal.tokens.shape[1]
        if width and self.seen:
            proposal.probs = torch.stack([self.seen[min(j, len(self.seen) - 1)] for j in range(width)], 1)
        return proposal


@pytest.mark.parametrize(
    "name, broken",
    [
        ("text-T1-k2", DraftLawInTextMode),
        ("text-tree-w2-T1-k3", DraftLawInTextMode),
    ],
)
def test_check_catches_broken_draft_laws(pair, name, broken):
    case = CASES[name]
    outputs, _ = run(pair, case, broken)
    assert violations(pair, case, outputs) != []


# ------------------------------------------------------------------ real tokenizers and models (marked)

REAL_TARGET, REAL_DRAFT = "qwen2.5-coder-1.5b", "smollm2-135m"


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"])


@pytest.mark.realmodel
def test_real_tokenizers_keep_smollm2_ids_canonical_over_qwen_text():
    """Qwen tokens of a chat and of code with non-ASCII text arrive 1-5 at a time; SmolLM2's ids stay
    SmolLM2's own encoding of the text (up to the edge), and a character split over Qwen tokens is held
    back until it is whole."""
    from specdec.bench.main import PROMPTS as BENCH_PROMPTS

    qwen, smol = specdec.load_tokenizer(REAL_TARGET), specdec.load_tokenizer(REAL_DRAFT)
    text = BENCH_PROMPTS["editing"][0] + "\n# naïve café — 数据 🙂 🦜 ꙮ𝔘 done\n    return résumé\n"
    sequence = chat_ids(qwen, text)
    committed = CommittedText(smol, qwen)
    committed.reset(1)
    generator = torch.Generator().manual_seed(1)
    done, held = 0, 0
    while done < len(sequence):
        done = min(len(sequence), done + int(torch.randint(1, 3, (1,), generator=generator)))
        held += not committed.sync(0, sequence[:done])
        row = committed.rows[0]
        assert row.text == decode(qwen, sequence[: row.consumed]) and "\ufffd" not in row.text
        assert decode(smol, row.ids) == row.text
        canonical = smol(row.text, add_special_tokens=False)["input_ids"]
        stable = max(0, len(row.ids) - 3)  # the last word may still be re-split by text to come
        assert row.ids[:stable] == canonical[:stable]
    assert row.consumed == len(sequence) and held > 0


@pytest.mark.realmodel
def test_smollm2_drafting_for_qwen_greedy_equals_target_greedy_float32():
    """Five prompts x 128 tokens: specdec with SmolLM2 (its own tokenizer) drafting equals
    transformers' greedy output of Qwen2.5-Coder-1.5B token for token, in float32."""
    from specdec.bench.main import PROMPTS as BENCH_PROMPTS

    decoder = specdec.SpeculativeDecoder.from_pretrained(REAL_TARGET, REAL_DRAFT, dtype="float32", device="cpu")
    assert isinstance(decoder.drafter, CrossTokenizerDrafter)
    texts = BENCH_PROMPTS["code"] + BENCH_PROMPTS["editing"][:1] + BENCH_PROMPTS["chat"]
    accepted = 0
    for text in texts:
        ids = chat_ids(decoder.tokenizer, text)
        reference = decoder.target.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=128,
            do_sample=False,
        )[0, len(ids) :].tolist()
        out = decoder.generate(ids, max_new_tokens=128, num_draft_tokens=4, temperature=0)
        assert out.token_ids == reference, text
        accepted += out.metrics.accepted_tokens
    assert accepted > 128
