"""Tiny random causal LMs built from configs, saved and reloaded with save_pretrained (no downloads).

SPECDEC_TEST_DEVICE=cuda runs the engine tests on a GPU (never required: the default is cpu).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

VOCAB = 96
DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")


def config(arch: str, layers: int = 2, hidden: int = 32, vocab: int = VOCAB):
    common = dict(vocab_size=vocab, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "gpt2":
        return GPT2Config(n_layer=layers, n_embd=hidden, n_head=2, n_positions=512, **common)
    cls = Qwen2Config if arch == "qwen2" else LlamaConfig
    return cls(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **common,
    )


def build(
    arch: str, seed: int, directory: Path, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, sharpness: float = 1.0
):
    """A random model, saved then loaded back. sharpness scales the output head: >1 gives peaked laws."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(arch, layers, hidden, vocab))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpness)
    model.save_pretrained(directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(DEVICE).eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    inputs = torch.tensor([prompt], device=model.device)
    out = model.generate(
        inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


class CharTokenizer:
    """A stand-in tokenizer: token i is the letter chr(97 + i % 26); enough for text, stop strings, streaming."""

    eos_token_id = None

    def __len__(self):
        return VOCAB

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i) % 26) for i in ids)

    def __call__(self, text):
        return {"input_ids": [ord(c) - 97 for c in text]}


def save_char_tokenizer(directory: Path, vocab: int = VOCAB) -> None:
    """A character-level fast tokenizer over printable ASCII, saved beside a tiny model."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = {chr(32 + i): i for i in range(vocab - 1)}
    chars["<unk>"] = vocab - 1
    core = Tokenizer(models.WordLevel(vocab=chars, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>").save_pretrained(directory)


def noisy_pair(root: Path):
    """A SpeculativeDecoder over a tiny Llama saved in root/target (a char tokenizer) and, as its draft, a
    perturbed copy: a draft that agrees often, not always (rollbacks, accepted and recovered tokens)."""
    from transformers import AutoTokenizer

    from specdec import SpeculativeDecoder

    target = build("llama", 0, root / "target", sharpness=3.0)
    save_char_tokenizer(root / "target")
    return SpeculativeDecoder(target, perturbed(target, 0.3, seed=5), AutoTokenizer.from_pretrained(root / "target"))


def perturbed(model, scale: float, seed: int):
    """A copy of model with every weight moved by scale * (its tensor's std) of Gaussian noise:
    a draft that agrees with the target often, but not always."""
    import copy

    generator = torch.Generator().manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in other.parameters():
            noise = torch.randn(parameter.shape, generator=generator).to(parameter.device)
            parameter.add_(noise * scale * (parameter.float().std() if parameter.numel() > 1 else 1.0))
    return other


def decode(
    target,
    drafter,
    prompts,
    *,
    max_new_tokens,
    policy,
    warping=None,
    sampling=None,
    eos_ids=frozenset(),
    stop=None,
    on_commit=None,
    generator=None,
    clock=None,
    on_round=None,
    metrics=None,
    row_metrics=None,
    verification="token",
    race_seed=None,
    row_seeds=None,
    draft_width=1,
    read_ahead=None,
    prompt_lookup=False,
):
    """The engine over token-id prompts with every option a keyword, for the tests: rows (`rows_for`),
    the plan (`plan_for`) and the run (`specdec.engine.decoder.decode`), as SpeculativeDecoder builds them.
    Give `warping` (processors; RowWarpings: one per row) or a plain `sampling` config. on_round(engine):
    called after each round (the tests' invariants on the caches)."""
    import time
    import unittest.mock

    from specdec.drafters import as_drafter
    from specdec.engine import decoder as engine
    from specdec.metrics import SpeculativeMetrics, Stopwatch
    from specdec.verify.sampling import Warping

    if (warping is None) == (sampling is None):
        raise ValueError("give exactly one of warping= and sampling=")
    warping = warping if warping is not None else Warping.from_sampling(sampling)
    drafter = as_drafter(drafter)
    rows = engine.rows_for(prompts, max_new_tokens, warping, target.vocab_size, race_seed=race_seed,
                           row_seeds=row_seeds, stops=stop, on_commit=on_commit, metrics=row_metrics)  # fmt: skip
    plan = engine.plan_for(target, drafter, policy, warping.greedy, eos_ids=eos_ids, verification=verification,
                           draft_width=draft_width, generator=generator, read_ahead=read_ahead,
                           prompt_lookup=prompt_lookup)  # fmt: skip
    watch = Stopwatch(metrics if metrics is not None else SpeculativeMetrics(), clock or time.perf_counter)
    if on_round is None:
        return engine.decode(target, drafter, rows, plan, watch)
    real = engine.Decoder.round

    def round_then_check(self):  # on_round(engine) after each round, for the tests' invariants
        real(self)
        on_round(self)

    with unittest.mock.patch.object(engine.Decoder, "round", round_then_check):
        return engine.decode(target, drafter, rows, plan, watch)
