"""Long runs, memory, faults and interrupts."""

import errno
import gc

import psutil
import pytest
import torch
from typer.testing import CliRunner

import specdec
import specdec.models.resolution as resolution
from specdec.drafters import ModelDrafter
from specdec.models.adapters import HFCausalLM
from specdec.tuning.policy import DraftLengthPolicy
from specdec.verify.sampling import SamplingConfig
from specdec_cli.app import app
from tests.tiny import build, decode, hf_greedy, save_char_tokenizer


@pytest.fixture(scope="module")
def long_models(tmp_path_factory):
    """Tiny Llama models with a 4096-token context (and peaked laws, so drafts are often right)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("long")
    made = []
    for name, seed, layers in (("target", 20, 2), ("draft", 21, 1)):
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        model = AutoModelForCausalLM.from_config(config)
        model.save_pretrained(root / name)
        made.append(AutoModelForCausalLM.from_pretrained(root / name, dtype=torch.float32).eval())
    return made


def test_2000_tokens_with_auto_k_equal_transformers_greedy_and_keep_the_invariant(long_models):
    target, draft = long_models
    prompt = [3, 14, 15, 9, 26, 5]
    target_adapter, draft_adapter = HFCausalLM(target), HFCausalLM(draft)
    rounds = []

    def invariant(engine):
        committed = engine.lengths()
        assert torch.equal(target_adapter.lengths.cpu(), committed - 1)
        assert target_adapter.num_slots == int(committed[0]) - 1  # one row: no holes, plain crop
        assert target_adapter.cache.get_seq_length() == target_adapter.num_slots
        assert int(draft_adapter.lengths[0]) <= int(committed[0]) - 1
        rounds.append(1)

    batch, metrics = decode(
        target_adapter,
        ModelDrafter(draft_adapter),
        [prompt],
        max_new_tokens=2000,
        sampling=SamplingConfig(temperature=0),
        policy=DraftLengthPolicy(k=None),
        on_round=invariant,
    )
    assert batch[0].new_tokens == hf_greedy(target, prompt, 2000)
    assert metrics.generated_tokens == 2000 and len(rounds) == metrics.rounds


@pytest.mark.slow  # ~30 s: four 800-token runs
def test_repeated_long_runs_keep_memory_flat(long_models):
    target, draft = long_models
    process = psutil.Process()
    readings = []
    for _ in range(4):
        specdec.generate([1, 2, 3], target=target, draft=draft, max_new_tokens=800, num_draft_tokens="auto")
        gc.collect()
        readings.append(process.memory_info().rss)
    growth_mb = (readings[-1] - readings[1]) / 2**20  # after the allocator's first warm-up
    assert growth_mb < 40, readings


def test_full_cache_disk_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))

    def no_space(spec, target, progress):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(resolution, "_assemble_gguf", no_space)
    with pytest.raises(ValueError, match="No space left on device.*free space"):
        resolution.fetch_alias("smollm2-135m")
    assert not (tmp_path / "smollm2-135m" / "model").exists()


def test_ctrl_c_prints_partial_text_and_metrics(tmp_path, monkeypatch):
    build("llama", 0, tmp_path / "m")
    save_char_tokenizer(tmp_path / "m")
    calls = []
    original = specdec.api.DeltaStreamer.__call__

    def interrupt_on_third(self, row, tokens):
        calls.append(tokens)
        if len(calls) == 3:
            raise KeyboardInterrupt
        original(self, row, tokens)

    monkeypatch.setattr(specdec.api.DeltaStreamer, "__call__", interrupt_on_third)
    result = CliRunner().invoke(
        app, ["generate", "Hi", "--target", str(tmp_path / "m"), "-n", "50", "--draft", "ngram", "--dtype", "float32"]
    )
    assert result.exit_code == 130, result.output
    assert "interrupted after" in result.output and "acceptance rate" in result.output
    assert "Traceback" not in result.output
