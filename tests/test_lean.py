"""The lean llama-family forward gives transformers' logits bit for bit, and runs only where it may."""

import pytest
import torch

from specdec.models.adapters import HFCausalLM
from specdec.models.lean import lean_forward
from specdec.models.packing import pack_linears
from specdec.tuning.calibration import signature
from tests.tiny import build

ALL = torch.ones(2, dtype=torch.bool)


def both_ways(model, script) -> None:
    """Run the same adapter calls through the lean forward and through transformers' forward,
    each on its own cache, and require every logits tensor to be equal."""
    lean, plain = HFCausalLM(model), HFCausalLM(model)
    assert lean.lean is not None
    plain.lean = None
    for a, b in zip(script(lean), script(plain), strict=True):
        assert torch.equal(a, b)


def rounds(adapter):
    """Ragged prompts (left padding), single-token steps, a chain with a rejected column, a tree, keep_path,
    rollback, a row leaving and a row joining: every mask form the engine builds."""
    adapter.reset(2)
    seqs = [[5, 6, 7, 8, 9, 10], [11, 12]]
    yield adapter.feed(seqs, ALL, keep_logits=3)
    for step in range(2):
        seqs = [s + [20 + step] for s in seqs]
        yield adapter.feed(seqs, ALL)
    drafts, valid = torch.tensor([[30, 31, 32], [33, 34, 35]]), torch.tensor([[True] * 3, [True, False, False]])
    yield adapter.feed(seqs, ALL, drafts, valid, keep_logits=4)
    adapter.rollback(adapter.lengths - torch.tensor([2, 0]))
    seqs = [seqs[0] + [30, 40], seqs[1] + [33, 41]]
    parents = torch.tensor([[-1, 0, -1, 2], [-1, -1, 1, 0]])
    yield adapter.feed(seqs, ALL, drafts.repeat(1, 2)[:, :4], torch.ones(2, 4, dtype=torch.bool), 5, parents)
    adapter.commit(torch.tensor([len(seqs[0]) + 1, len(seqs[1])]), torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]).bool())
    seqs = [seqs[0] + [30, 50], seqs[1] + [51]]
    yield adapter.feed(seqs, ALL)
    adapter.select_rows(torch.tensor([1]))
    adapter.add_rows(1)
    seqs = [seqs[1] + [52], [60, 61, 62]]
    yield adapter.feed(seqs, ALL, keep_logits=2)
    yield adapter.feed([s + [70] for s in seqs], torch.tensor([False, True]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_forward_equals_transformers_bit_for_bit(arch, dtype, tmp_path):
    model = build(arch, 1, tmp_path / arch).to(dtype)
    both_ways(model, rounds)


def test_lean_forward_equals_transformers_with_packed_linears(tmp_path):
    model = build("llama", 2, tmp_path / "llama").to(torch.bfloat16)
    pack_linears(model)  # the bf16 target as the CPU default runs it
    both_ways(model, rounds)


def test_lean_forward_runs_only_where_it_repeats_transformers(tmp_path):
    assert lean_forward(build("gpt2", 1, tmp_path / "gpt2")) is None  # another family
    model = build("llama", 1, tmp_path / "llama")
    lean = signature(HFCausalLM(model, name="m"))
    model.config._attn_implementation = "eager"
    assert lean_forward(model) is None  # another attention
    assert signature(HFCausalLM(model, name="m")) != lean  # and other costs: calibrated apart
    model.config._attn_implementation = "sdpa"
    model.model.norm = torch.nn.LayerNorm(model.config.hidden_size)
    assert lean_forward(model) is None  # a part that is not the family's own
    hooked = build("llama", 1, tmp_path / "hooked")
    adapter = HFCausalLM(hooked)
    assert adapter.lean.runs()
    seen = []
    handle = hooked.register_forward_pre_hook(lambda module, args: seen.append(module))
    assert not adapter.lean.runs()
    adapter.feed([[1, 2, 3]], torch.ones(1, dtype=torch.bool))
    assert seen == [hooked]  # a hook on the model sees transformers' forward run
    handle.remove()
    assert adapter.lean.runs()
