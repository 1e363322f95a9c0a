"""Float Linears packed for oneDNN (specdec.models.packing): the same function, biases kept, tied heads left
alone, packed by the loading path on CPU only, and decoding on a packed model stays exact."""

import copy

import pytest
import torch

from specdec import SpeculativeDecoder
from specdec.models import packing
from specdec.models.adapters import HFCausalLM
from specdec.models.packing import (
    FORMS,
    MIN_ROWS,
    PackedLinear,
    SharedInputPart,
    measured_forms,
    pack_linears,
    packable,
    shape_key,
)
from specdec.models.quantize import quantize_int8
from specdec.models.resolution import load_model
from specdec.tuning.calibration import signature
from tests.tiny import build, hf_greedy, perturbed

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """Qwen2 has biases on q/k/v (zero at init: made random here): a packed Linear must keep them."""
    model = build("qwen2", 60, tmp_path_factory.mktemp("packing") / "qwen", layers=2, hidden=32, sharpness=4.0)
    generator = torch.Generator().manual_seed(60)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=generator))
    return model


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "separate"])
def test_packed_model_computes_the_same_logits(qwen, fuse):
    """Packed one by one, or q/k/v and gate/up each packed as one weight (PackedInputs): the q/k/v biases
    are kept, and the logits are the plain model's."""
    packed = copy.deepcopy(qwen)
    linears = sum(type(m) is torch.nn.Linear for m in qwen.modules())
    assert pack_linears(packed, fuse=fuse) == linears == packed.specdec_packed_linears
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    groups = {id(m.group): m.group for m in packed.modules() if isinstance(m, SharedInputPart)}
    assert len(groups) == (2 * 2 if fuse else 0)  # q/k/v and gate/up in each of the 2 layers
    held = [m for m in packed.modules() if isinstance(m, PackedLinear)] + [g.linear for g in groups.values()]
    assert any(m.bias is not None for m in held)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(packed, ids), _logits(qwen, ids), atol=1e-5, rtol=1e-5)


def test_siblings_in_another_form_are_not_fused(qwen):
    """A group is fused only where every member is packed: plain k/v leave q packed alone."""
    model = copy.deepcopy(qwen)
    attention = model.model.layers[0].self_attn
    forms = {shape_key(attention.k_proj): FORMS[0]}  # plain
    assert shape_key(attention.k_proj) != shape_key(attention.q_proj)
    pack_linears(model, forms=forms)
    assert type(attention.k_proj) is torch.nn.Linear and isinstance(attention.q_proj, PackedLinear)
    assert isinstance(model.model.layers[0].mlp.up_proj, SharedInputPart)


def test_gpt2_conv1d_layers_are_packed_too(tmp_path):
    from transformers.pytorch_utils import Conv1D

    gpt2 = build("gpt2", 62, tmp_path / "gpt2", layers=2, hidden=32)
    with torch.no_grad():  # biases are zero at init
        for module in gpt2.modules():
            if isinstance(module, Conv1D):
                module.bias.normal_(generator=torch.Generator().manual_seed(62))
    packed = copy.deepcopy(gpt2)
    conv1ds = sum(isinstance(m, Conv1D) for m in gpt2.modules())
    assert pack_linears(packed) == conv1ds + 1 > 1  # and the head tied to the embeddings, as a copy
    assert not any(isinstance(m, Conv1D) for m in packed.modules())
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(packed, ids), _logits(gpt2, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not packable(torch.bfloat16), reason="oneDNN packs bfloat16 only with AVX-512 or AVX-NE-CONVERT")
def test_packed_bfloat16_model_computes_the_same_logits(qwen):
    plain = copy.deepcopy(qwen).bfloat16()
    packed = copy.deepcopy(plain)
    assert pack_linears(packed) > 0
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(packed, ids).float(), _logits(plain, ids).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not packable(torch.bfloat16), reason="oneDNN packs bfloat16 only with AVX-512 or AVX-NE-CONVERT")
def test_a_bfloat16_input_of_few_rows_is_padded_and_each_row_keeps_its_value(monkeypatch):
    """The padded form: one to three rows run as MIN_ROWS (zero rows added, dropped after); each row's output
    is the one it gets inside a wider input, bit for bit, so padding changes the speed, not the function of
    any row. A packed Linear pads only where its form says so."""
    generator = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 64, generator=generator))
        linear.bias.copy_(torch.randn(48, generator=generator))
    packed = PackedLinear.of(linear.bfloat16(), MIN_ROWS)
    wide = torch.randn(1, 6, 64, generator=generator).bfloat16()
    seen = []  # the rows oneDNN was handed, per call
    run = packing._LINEAR
    monkeypatch.setattr(packing, "_LINEAR", lambda x, *args: seen.append(x.numel() // 64) or run(x, *args))
    with torch.inference_mode():
        full = packed(wide)
        for rows in (1, 2, 3):
            out = packed(wide[:, :rows])
            assert out.shape == (1, rows, 48)
            assert torch.equal(out, full[:, :rows])
        assert seen == [6, MIN_ROWS, MIN_ROWS, MIN_ROWS]
        assert PackedLinear.of(linear).min_rows == 1


def test_only_dtypes_onednn_runs_are_packed(qwen):
    assert packable(torch.float32)  # every x86 build of torch with oneDNN
    assert not packable(torch.float16) and not packable(torch.int8)
    half = copy.deepcopy(qwen).half()
    assert pack_linears(half) == 0 and half.specdec_packed_linears == 0
    assert not any(isinstance(m, PackedLinear) for m in half.modules())


def test_a_tied_head_is_packed_as_a_copy_and_the_embedding_keeps_its_weight(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.tiny import config

    tied = config("llama")
    tied.tie_word_embeddings = True
    model = AutoModelForCausalLM.from_config(tied).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plain = copy.deepcopy(model)
    embedding = model.model.embed_tokens.weight
    released = []  # `release` may free a packed weight's memory: never the one the embedding still reads
    packed = pack_linears(model, release=lambda weight: released.append(weight) or weight.data.zero_())
    assert len(released) == packed - 1 and all(w.data_ptr() != embedding.data_ptr() for w in released)
    assert isinstance(model.lm_head, PackedLinear) and model.model.embed_tokens.weight is embedding
    assert packed == sum(isinstance(m, (PackedLinear, SharedInputPart)) for m in model.modules()) > 0
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(_logits(model, ids), _logits(plain, ids), atol=1e-5, rtol=1e-5)


def test_int8_models_pack_only_their_float_linears(qwen):
    quantized = quantize_int8(copy.deepcopy(qwen))
    assert pack_linears(quantized) == 0  # every Linear is int8
    quantized.model.layers[0].mlp.down_proj = copy.deepcopy(qwen.model.layers[0].mlp.down_proj)  # as an outlier
    assert pack_linears(quantized) == 1
    assert isinstance(quantized.model.layers[0].mlp.down_proj, PackedLinear)


def test_load_model_packs_on_cpu_unless_asked_not_to(qwen, tmp_path):
    qwen.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    plain = load_model(str(tmp_path), device="cpu", dtype="float32", pack=False)
    assert loaded.specdec_packed_linears > 0 and isinstance(loaded.lm_head, PackedLinear)
    assert not hasattr(plain, "specdec_packed_linears") and type(plain.lm_head) is torch.nn.Linear
    assert signature(HFCausalLM(loaded, name="m")) != signature(HFCausalLM(plain, name="m"))  # costs differ


@pytest.mark.parametrize("k", [1, 4, "auto"])
def test_greedy_on_packed_models_equals_transformers(qwen, k):
    target = copy.deepcopy(qwen)
    draft = perturbed(qwen, 0.3, seed=61)
    pack_linears(target), pack_linears(draft)
    decoder = SpeculativeDecoder(target, draft)
    for seed in range(3):
        prompt = torch.randint(0, 96, (6,), generator=torch.Generator().manual_seed(seed)).tolist()
        out = decoder.generate(prompt, max_new_tokens=24, num_draft_tokens=k)
        assert out.token_ids == hf_greedy(target, prompt, 24)
    assert out.metrics.accepted_tokens > 0


def _timings(fastest: str) -> dict[str, list[float]]:
    """time_forms' answer in which `fastest` (a form's name) takes half the others' time at every width."""
    return {form.name: [1.0 if form.name == fastest else 2.0] * len(packing.TIMED_WIDTHS) for form in FORMS}


def test_each_shape_runs_in_the_form_its_timings_name_and_the_table_is_kept(qwen, tmp_path, monkeypatch):
    """A shape heavier than MEASURED_BYTES is timed once per host (the table on disk is read after), and
    runs in its fastest form: plain stays an nn.Linear, packed is a PackedLinear; a lighter shape is packed
    untimed. The logits stay the unpacked model's."""
    model = copy.deepcopy(qwen)
    sizes = {shape_key(m): 0 for m in model.modules() if type(m) is torch.nn.Linear}
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            sizes[shape_key(m)] += m.weight.nbytes
    light, *heavy = sorted(sizes, key=sizes.get)
    monkeypatch.setattr(packing, "MEASURED_BYTES", sizes[light] + 1)  # every shape but the lightest is timed
    fastest = {key: FORMS[i % len(FORMS)].name for i, key in enumerate(heavy)}
    timed = []

    def time_forms(linears):
        timed.append(shape_key(linears[0]))
        return _timings(fastest[shape_key(linears[0])])

    monkeypatch.setattr(packing, "time_forms", time_forms)
    table = tmp_path / "kernels.json"
    forms = measured_forms(model, table)
    assert sorted(timed) == sorted(heavy) and {k: f.name for k, f in forms.items()} == fastest
    assert measured_forms(model, table) == forms and len(timed) == len(heavy)  # read back, not timed again
    table.write_text("{not json")
    assert measured_forms(model, table) == forms and len(timed) == 2 * len(heavy)  # a damaged cache: timed again
    pack_linears(model, forms=forms)
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, PackedLinear)):
            key = shape_key(m) if type(m) is torch.nn.Linear else f"float32:{m.out_features}x{m.in_features}"
            form = forms.get(key, packing.DEFAULT)
            assert isinstance(m, PackedLinear) == form.packed
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(8))
    torch.testing.assert_close(_logits(model, ids), _logits(qwen, ids), atol=1e-5, rtol=1e-5)


def test_time_forms_times_every_form_at_every_width():
    linears = [torch.nn.Linear(64, 128) for _ in range(3)]
    timings = packing.time_forms(linears, repeats=1)
    assert set(timings) == {form.name for form in FORMS}
    assert all(len(t) == len(packing.TIMED_WIDTHS) and all(0 < s < 1 for s in t) for t in timings.values())
    assert all(type(m) is torch.nn.Linear for m in linears)  # the model's own Linears are left as they were


def test_another_form_is_taken_only_where_it_pays_at_the_widths_the_model_runs(monkeypatch):
    """DEFAULT stays unless a form is more than MARGIN faster summed over the model's widths: a plain weight
    fast at one row only is taken for a target alone (widths (1,)), not for one that verifies."""
    timings = {"plain": [0.7, 1.2, 1.2, 1.2], "packed": [1.0] * 4}
    assert packing.DEFAULT.name == "packed" and packing.TIMED_WIDTHS == (1, 2, 4, 8)
    monkeypatch.setattr(packing, "kernel_table", lambda *args: {"bfloat16:8x8": timings})
    assert measured_forms(None, widths=(1,))["bfloat16:8x8"].name == "plain"
    assert measured_forms(None)["bfloat16:8x8"] == packing.DEFAULT  # 1.2x slower at 2-8 rows
    timings["plain"] = [0.97] * 4
    assert measured_forms(None, widths=(1,))["bfloat16:8x8"] == packing.DEFAULT  # 3% faster: not enough


def test_padding_is_chosen_on_the_whole_forward_kept_and_leaves_the_logits(qwen, tmp_path, monkeypatch):
    """pad_inputs pads every packed Linear, fused groups included, where the one-token forward padded is more
    than MARGIN faster, keeps the timing in the table (read back, not timed again), and the logits stay the
    plain model's; a model whose packed weights fit in a cache is not timed and does not pad."""
    model = copy.deepcopy(qwen)
    pack_linears(model)
    linears = packing.packed_linears(model)
    assert len(linears) == 2 * 4 + 1  # per layer: q/k/v as one, o, gate/up as one, down; and the head
    table = tmp_path / "kernels.json"
    assert packing.pad_inputs(model, table) == {} and model.specdec_packed_rows == 1 and not table.exists()
    monkeypatch.setattr(packing, "MEASURED_BYTES", 1)
    timed = []
    answer = {"1": 1.0, str(MIN_ROWS): 0.9}
    monkeypatch.setattr(packing, "time_padding", lambda m: timed.append(m) or dict(answer))
    assert packing.pad_inputs(model, table) == answer and len(timed) == 1
    assert model.specdec_packed_rows == MIN_ROWS and all(m.min_rows == MIN_ROWS for m in linears)
    ids = torch.randint(0, 96, (1, 1), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_logits(model, ids), _logits(qwen, ids), atol=1e-5, rtol=1e-5)
    assert packing.pad_inputs(model, table) == answer and len(timed) == 1  # read back
    answer[str(MIN_ROWS)] = 0.97  # 3% faster: not enough
    table.unlink()
    packing.pad_inputs(model, table)
    assert len(timed) == 2 and model.specdec_packed_rows == 1 and all(m.min_rows == 1 for m in linears)


def test_time_padding_times_the_forward_unpadded_and_padded(qwen, monkeypatch):
    model = copy.deepcopy(qwen)
    pack_linears(model)
    seen = []  # the rows oneDNN was handed
    run = packing._LINEAR
    monkeypatch.setattr(packing, "_LINEAR", lambda x, *args: seen.append(x.shape[0]) or run(x, *args))
    timings = packing.time_padding(model, passes=1, calls=1)
    assert set(timings) == {"1", str(MIN_ROWS)} and all(0 < s < 1 for s in timings.values())
    assert set(seen) == {1, MIN_ROWS}


def test_weights_end_to_end_in_memory_are_joined_without_a_copy():
    rows = torch.randn(10, 4, generator=torch.Generator().manual_seed(9))
    joined = packing._joined([rows[:6], rows[6:]])  # end to end, as gate and up in a mapped safetensors file
    assert torch.equal(joined, rows) and joined.data_ptr() == rows.data_ptr()
    swapped = packing._joined([rows[6:], rows[:6]])  # not in memory order: a copy
    assert torch.equal(swapped, torch.cat([rows[6:], rows[:6]])) and swapped.data_ptr() != rows.data_ptr()
    assert torch.equal(packing._joined([rows[:6, :2], rows[6:, :2]]), rows[:, :2])  # not contiguous: a copy
