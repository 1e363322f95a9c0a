"""int8 quantisation: with keep_outliers (the opt-in int8 target) the Linears fed massive activations
stay in float and the rest become int8; drafts quantise every Linear; an int8 draft keeps greedy output
equal to the target's."""

import copy

import pytest
import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

from specdec import SpeculativeDecoder
from specdec.models.quantize import SharedInputLinears, SharedInputPart, outlier_linears, quantize_int8
from tests.tiny import DEVICE, build, hf_greedy

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="int8 dynamic quantisation is CPU-only")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantize")
    return build("llama", 0, root / "t", layers=3, hidden=64), build("llama", 1, root / "d", layers=2, hidden=64)


def with_massive_activation(model, layer: int):
    """A copy whose MLP in `layer` feeds one huge channel to its down-projection (as Qwen2.5's do)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        model.model.layers[layer].mlp.up_proj.weight[3].mul_(300.0)
    return model


def test_a_planted_massive_activation_keeps_that_linear_in_float(models):
    target, _ = models
    assert outlier_linears(target) == set()  # a random model has none
    planted = with_massive_activation(target, 1)
    assert outlier_linears(planted) == {"model.layers.1.mlp.down_proj"}
    quantised = quantize_int8(planted, keep_outliers=True)
    assert type(quantised.model.layers[1].mlp.down_proj) is torch.nn.Linear
    assert isinstance(quantised.model.layers[0].mlp.down_proj, DynamicInt8Linear)
    assert isinstance(quantised.model.layers[1].mlp.up_proj, SharedInputPart)  # int8, packed with gate_proj
    assert isinstance(quantised.model.layers[1].mlp.up_proj.group, SharedInputLinears)
    assert quantised.specdec_float_linears == ["model.layers.1.mlp.down_proj"]


def test_keeping_the_outlier_in_float_is_closer_to_the_float_model(models):
    planted = with_massive_activation(models[0], 1)
    ids = torch.randint(0, planted.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        reference = planted(ids).logits
        kept = quantize_int8(copy.deepcopy(planted), keep_outliers=True)(ids).logits
        all_int8 = quantize_int8(copy.deepcopy(planted))(ids).logits
    assert (kept - reference).abs().mean() < 0.75 * (all_int8 - reference).abs().mean()  # 0.45x when written


def test_an_int8_draft_runs_in_the_engine_with_greedy_output_exact(models):
    # A smoke test of the quantised modules inside the engine: greedy output is exact for any draft.
    target, draft = models
    draft = quantize_int8(with_massive_activation(draft, 0))
    prompt = [5, 17, 3, 44, 9]
    out = SpeculativeDecoder(target, draft).generate(prompt, max_new_tokens=24, num_draft_tokens=3, temperature=0)
    assert out.token_ids == hf_greedy(target, prompt, 24)


def test_the_int8_target_keeps_its_outliers_and_the_int8_draft_does_not(tmp_path):
    from tests.tiny import save_char_tokenizer

    build("llama", 0, tmp_path / "t", hidden=64)
    save_char_tokenizer(tmp_path / "t")
    build("llama", 1, tmp_path / "d", hidden=64, layers=1)
    decoder = SpeculativeDecoder.from_pretrained(
        str(tmp_path / "t"), str(tmp_path / "d"), target_quantization="int8", draft_quantization="int8"
    )
    target, draft = decoder.target.model, decoder.drafter.adapter.model
    per_channel = torch.per_channel_affine
    assert target.model.layers[0].mlp.down_proj.weight().qscheme() == per_channel  # the faithful scheme
    assert draft.model.layers[0].mlp.down_proj.weight().qscheme() == torch.per_tensor_affine  # the fast one


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("keep_outliers", [False, True], ids=["per-tensor", "per-channel"])
def test_packed_projections_give_the_same_logits_as_separate_ones(arch, keep_outliers, tmp_path):
    model = build(arch, 3, tmp_path / arch, layers=2, hidden=64)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(2))
    separate = quantize_int8(copy.deepcopy(model), keep_outliers=keep_outliers, fuse=False)
    packed = quantize_int8(copy.deepcopy(model), keep_outliers=keep_outliers)
    groups = {m.group for m in packed.modules() if isinstance(m, SharedInputPart)}
    assert len(groups) == 2 * 2  # q/k/v and gate/up in each of the 2 layers
    assert not any(isinstance(m, SharedInputPart) for m in separate.modules())
    with torch.inference_mode():
        assert torch.equal(separate(ids).logits, packed(ids).logits)  # the int8 target stays the same model


def test_a_packed_group_serves_each_input_once_per_part(models):
    attention = quantize_int8(copy.deepcopy(models[1])).model.layers[0].self_attn
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    group = q.group
    x, y = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    with torch.inference_mode():
        qx = q(x)
        assert group._input is x  # held until k and v have taken their parts
        kx, vx = k(x), v(x)
        assert group._input is None and group._outputs is None  # then released
        whole = torch.ops.quantized.linear_dynamic(x, group.packed, reduce_range=True)
        assert torch.equal(torch.cat([qx, kx, vx], -1), whole)
        ky = k(y)  # another input recomputes, whichever part asks first
        assert torch.equal(ky, torch.ops.quantized.linear_dynamic(y, group.packed, True).split(group.sizes, -1)[1])
        assert torch.equal(q(x), qx)  # and a part asked twice (here for an older input) is recomputed
