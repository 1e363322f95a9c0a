"""specdec.models.int4: GGUF 4-bit decoding, Int4Linear and the module swap, on small synthetic data."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

from specdec.models.int4 import (
    DECODERS,
    GROUP,
    Int4Groups,
    Int4Linear,
    apply_gguf_int4,
    int4_groups,
    rounded_groups,
)
from tests.tiny import config


def random_q4_k(rows: int, inner: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K bytes [rows, inner / 256 * 144]: random codes and 6-bit scales, finite positive d, dmin."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * inner // 256, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-4, 1e-2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    blocks[:, 2:4] = rng.uniform(1e-4, 1e-2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def quantized(type_: Q, rows: int, inner: int, seed: int = 0) -> np.ndarray:
    """Bytes [rows, ...] of a tensor in type_: Q4_K random blocks, the others by gguf.quants.quantize."""
    if type_ == Q.Q4_K:
        return random_q4_k(rows, inner, seed)
    weights = np.random.default_rng(seed).normal(0, 0.05, (rows, inner)).astype(np.float32)
    return weights if type_ == Q.F32 else gguf.quants.quantize(weights, type_)


@pytest.mark.parametrize("type_", [Q.Q4_K, Q.Q4_0, Q.Q4_1])
def test_decoder_gives_gguf_quants_dequantisation_bit_for_bit(type_):
    data = quantized(type_, 8, 512, seed=3)
    groups = int4_groups(data, type_.name, (8, 512))
    assert groups.codes.min() >= 0 and groups.codes.max() <= 15 and groups.scale.shape == (8, 512 // GROUP)
    np.testing.assert_array_equal(groups.dequantize(), gguf.quants.dequantize(data, type_).reshape(8, 512))


def test_decoder_check_catches_swapped_nibbles():
    data = random_q4_k(4, 256)
    groups = int4_groups(data, "Q4_K", (4, 256))
    swapped = Int4Groups(groups.codes.reshape(4, -1, 2, 32)[:, :, ::-1].reshape(4, 256), groups.scale, groups.minimum)
    assert not np.array_equal(swapped.dequantize(), gguf.quants.dequantize(data, Q.Q4_K).reshape(4, 256))


def rounded_weight(groups: Int4Groups) -> torch.Tensor:
    """The weight the kernel holds: w = (q - 8) * scale + zero, scale and zero rounded to bfloat16 (float64)."""
    scale = torch.from_numpy(groups.scale).double()
    zero = (8 * torch.from_numpy(groups.scale) - torch.from_numpy(groups.minimum)).bfloat16().double()
    scale = scale.bfloat16().double()
    q = torch.from_numpy(groups.codes).double() - 8
    return q * scale.repeat_interleave(GROUP, 1) + zero.repeat_interleave(GROUP, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_linear_computes_the_dequantised_matmul(dtype):
    groups = int4_groups(random_q4_k(96, 512, seed=1), "Q4_K", (96, 512))
    bias = torch.randn(96)
    linear = Int4Linear.of(groups, bias)
    x = torch.randn(2, 3, 512).to(dtype)
    y = linear(x)
    assert y.shape == (2, 3, 96) and y.dtype == dtype
    exact = x.double() @ torch.from_numpy(groups.dequantize()).double().t() + bias.bfloat16().double()
    kernel = x.bfloat16().double() @ rounded_weight(groups).t() + bias.bfloat16().double()
    scale = exact.abs().max()
    assert (y.double() - kernel).abs().max() <= 2e-2 * scale  # the kernel's own bfloat16 rounding
    assert (y.double() - exact).abs().max() <= 5e-2 * scale  # plus the bfloat16 scale, zero and input
    unshifted = Int4Groups(groups.codes, groups.scale, groups.minimum - 8 * groups.scale)  # w = q * scale + zero
    wrong = x.double() @ torch.from_numpy(unshifted.dequantize()).double().t() + bias.bfloat16().double()
    assert (y.double() - wrong).abs().max() > 5e-2 * scale


TYPES = {  # GGUF type per Linear of the tiny model; lm_head stays float
    "attn_q": Q.Q4_K, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0,
    "ffn_gate": Q.Q4_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q5_0,
}  # fmt: skip


def tiny_gguf(model, path, architecture: str = "qwen2"):
    """A GGUF holding the model's Linears in TYPES (output.weight in F32); returns the bytes written per name."""
    writer = gguf.GGUFWriter(str(path), architecture)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, model.config.num_hidden_layers)
    written = {}
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            name = names.get_name(f"{module_name}.weight", try_suffixes=(".weight",))
            kind = next((t for key, t in TYPES.items() if f".{key}." in name), Q.F32)
            written[name] = (kind, quantized(kind, *module.weight.shape, seed=len(written)))
            writer.add_tensor(name, written[name][1], raw_dtype=None if kind == Q.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def tiny_qwen2():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config("qwen2", layers=2, hidden=256), dtype=torch.bfloat16).eval()


def test_swap_puts_4_bit_tensors_in_int4_linears_and_keeps_the_rest(tmp_path):
    model = tiny_qwen2()
    written = tiny_gguf(model, tmp_path / "tiny.gguf")
    report = apply_gguf_int4(model, tmp_path / "tiny.gguf")
    assert report.counts() == {
        "int4": {"Q4_K": 6, "Q4_0": 2, "Q4_1": 2},
        "kept": {"Q8_0": 2, "Q5_0": 2, "F32": 1},
    }
    layer = model.model.layers[1]
    assert isinstance(layer.self_attn.q_proj, Int4Linear) and isinstance(layer.mlp.up_proj, Int4Linear)
    assert type(layer.self_attn.o_proj) is torch.nn.Linear and type(model.lm_head) is torch.nn.Linear
    assert layer.self_attn.k_proj.bias is not None  # qwen2's q/k/v biases carried over
    x = torch.randn(1, 4, 256).bfloat16()
    kind, data = written["blk.1.attn_v.weight"]
    groups = int4_groups(data, kind.name, (layer.self_attn.v_proj.out_features, 256))
    expected = x.double() @ torch.from_numpy(groups.dequantize()).double().t()
    expected += layer.self_attn.v_proj.bias.double()
    assert (layer.self_attn.v_proj(x).double() - expected).abs().max() <= 5e-2 * expected.abs().max()
    with torch.inference_mode():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_swap_refuses_other_architectures_and_mismatched_shapes(tmp_path):
    model = tiny_qwen2()
    tiny_gguf(model, tmp_path / "llama.gguf", architecture="llama")
    with pytest.raises(ValueError, match="qwen2 only, not 'llama'"):
        apply_gguf_int4(model, tmp_path / "llama.gguf")
    tiny_gguf(model, tmp_path / "tiny.gguf")
    other = AutoModelForCausalLM.from_config(config("qwen2", layers=2, hidden=512), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="has shape"):
        apply_gguf_int4(other, tmp_path / "tiny.gguf")


def test_decoders_cover_the_types_the_kernel_can_hold():
    assert set(DECODERS) == {"Q4_K", "Q4_0", "Q4_1"}


def reloaded_from_kept(monkeypatch, alias: str, form: str, first, builder: str):
    """The alias loaded again in `form` with its builder (of specdec.models.int4) refused: read from the kept
    file, and computing what the first load computed."""
    from specdec.models import resolution

    def not_again(*args):
        raise AssertionError(f"{builder} ran again: the kept file was not read")

    monkeypatch.setattr(f"specdec.models.int4.{builder}", not_again)
    again = resolution.load_model(alias, device="cpu", quantization=form)
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.inference_mode():
        assert torch.equal(again(ids).logits, first(ids).logits)
    return again


def test_an_int4_target_by_name_keeps_the_gguf_4_bit_weights_and_speculation_stays_exact(tmp_path, monkeypatch):
    """target_quantization="int4" for an offline alias: its GGUF's 4-bit Linears in Int4Linears, the rest
    packed bfloat16 (or float32); in float32, greedy speculation equals that model's own greedy decoding."""
    import specdec
    from specdec.models import ready, resolution
    from specdec.models.packing import PackedLinear, packable
    from specdec.tuning.calibration import signature
    from tests.tiny import build, hf_greedy

    alias, cache = "int4-fake", tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    model = tiny_qwen2()
    model.float().save_pretrained(cache / alias / "model")  # as fetch_alias leaves it: the GGUF converted
    tiny_gguf(model, cache / alias / f"{alias}.gguf")  # kept beside it, as gguf_source keeps it
    size = (cache / alias / f"{alias}.gguf").stat().st_size
    monkeypatch.setitem(resolution.ALIASES, alias, resolution.OfflineModel(alias, "test", (), size, ""))
    target = resolution.load_model(alias, device="cpu", quantization="int4")
    assert target.specdec_int4 == {"int4": {"Q4_K": 6, "Q4_0": 2, "Q4_1": 2}, "kept": {"Q8_0": 2, "Q5_0": 2, "F32": 1}}
    layer = target.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Int4Linear)
    assert isinstance(layer.mlp.down_proj, PackedLinear) == packable(torch.bfloat16)  # Q5_0: bfloat16, packed
    kept = ready.int4_file(cache / alias / "model")
    assert kept.is_file()  # kept ready to run: the next load neither reads the GGUF's tensors nor packs codes
    assert kept.stat().st_mode & 0o777 == kept.parent.stat().st_mode & 0o666  # not safetensors' 0600

    again = reloaded_from_kept(monkeypatch, alias, "int4", target, "apply_gguf_int4")
    assert again.specdec_int4 == target.specdec_int4
    monkeypatch.undo()
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    monkeypatch.setitem(resolution.ALIASES, alias, resolution.OfflineModel(alias, "test", (), size, ""))
    kept.write_bytes(b"not safetensors")
    rebuilt = resolution.load_model(alias, device="cpu", quantization="int4")  # a damaged file: decoded again
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.inference_mode():
        assert torch.equal(rebuilt(ids).logits, target(ids).logits)
    assert read_kept_counts(kept) == target.specdec_int4
    build("qwen2", 1, tmp_path / "draft", layers=1, hidden=256)
    by_name = specdec.SpeculativeDecoder.from_pretrained(
        alias, str(tmp_path / "draft"), target_quantization="int4", device="cpu", dtype="float32"
    )
    assert by_name.target.model.dtype == torch.float32 and isinstance(
        by_name.target.model.model.layers[0].mlp.up_proj, Int4Linear
    )
    # Token-exact in float32, with a draft that is accepted: the same int4 model in bfloat16 (its other layers
    # rounded), so verifies of several tokens are scored and kept, not just the recovered token.
    draft = resolution.load_model(alias, device="cpu", quantization="int4")
    decoder = specdec.SpeculativeDecoder(by_name.target.model, draft)
    accepted = 0
    for prompt in ([1, 5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 1, 2, 9, 10]):
        out = decoder.generate(prompt, max_new_tokens=24, temperature=0, num_draft_tokens=4)
        assert out.token_ids == hf_greedy(decoder.target.model, prompt, 24)
        accepted += out.metrics.accepted_tokens
    assert accepted >= 24  # most drafts accepted: the exactness above covered wide verifies
    # A draft may take any weight form (it stays exact in each): the same alias drafting in int4 for its float self.
    pair = specdec.SpeculativeDecoder.from_pretrained(
        alias, alias, draft_quantization="int4", device="cpu", dtype="float32"
    )
    drafted = pair.drafter.adapter.model
    assert isinstance(drafted.model.layers[0].self_attn.q_proj, Int4Linear) and drafted.specdec_weights == "int4"
    assert pair.target.model.specdec_weights == "none"
    assert ":int4" in signature(pair.drafter.adapter) and ":int4" not in signature(pair.target)
    out = pair.generate([1, 5, 9, 2, 7], max_new_tokens=16, temperature=0, num_draft_tokens=3)
    assert out.token_ids == hf_greedy(pair.target.model, [1, 5, 9, 2, 7], 16)


def test_the_int4_kernel_computes_each_row_alone():
    # What makes float32 speculation over an int4 target token-exact: a verify's rows get the bits each
    # would get alone, so the width of the forward cannot flip a near-tie.
    for out, inner in ((96, 512), (1536, 1536)):
        linear = Int4Linear.of(int4_groups(random_q4_k(out, inner, seed=1), "Q4_K", (out, inner)), None)
        x = torch.randn(9, inner)
        assert torch.equal(linear(x), torch.cat([linear(x[i : i + 1]) for i in range(9)]))


def test_int4_is_refused_without_a_gguf_source_and_off_the_cpu(tmp_path, monkeypatch):
    from specdec.models import resolution
    from specdec.models.forms import WEIGHT_FORMS
    from tests.tiny import build

    build("qwen2", 0, tmp_path / "plain")
    with pytest.raises(ValueError, match="name a .gguf file or an offline alias"):
        resolution.load_model(str(tmp_path / "plain"), device="cpu", quantization="int4")
    monkeypatch.setattr(resolution, "parse_device", lambda device: "cuda")  # as on a host with a GPU
    with pytest.raises(ValueError, match="other layers in bfloat16 or float32: dtype float16"):
        WEIGHT_FORMS["int4"].dtype("float16", "cpu")
    with pytest.raises(ValueError, match="int4 weights run on CPU only"):
        resolution.load_model(str(tmp_path / "plain"), device="cuda", quantization="int4")


def read_kept_counts(path) -> dict:
    import json

    from safetensors import safe_open

    with safe_open(str(path), "pt") as file:
        return json.loads(file.metadata()["counts"])


def test_rounded_groups_span_each_group_and_round_to_nearest():
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(4))
    weight[3, :GROUP] = 0.25  # a constant group: its codes are all 0, the weight exact
    groups = rounded_groups(weight)
    assert groups.codes.min() == 0 and groups.codes.max() == 15 and groups.scale.shape == (16, 128 // GROUP)
    error = np.abs(groups.dequantize() - weight.numpy())
    assert (error <= np.repeat(groups.scale, GROUP, axis=1) / 2 + 1e-6).all()  # nearest: half a step at most
    assert np.allclose(groups.dequantize()[3, :GROUP], 0.25)


def test_an_int4_rtn_draft_by_alias_rounds_every_linear_is_kept_and_stays_exact(tmp_path, monkeypatch):
    """quantization="int4-rtn": every Linear (the tied head too) in Int4Linears of its own weights rounded, the
    embedding untouched; kept beside the alias and read back; as a draft, greedy speculation equals the
    float32 target's greedy decoding."""
    import specdec
    from specdec.models import ready, resolution
    from specdec.tuning.calibration import signature
    from tests.tiny import hf_greedy

    alias, cache = "rtn-fake", tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    tiny_qwen2().float().save_pretrained(cache / alias / "model")
    monkeypatch.setitem(resolution.ALIASES, alias, resolution.OfflineModel(alias, "test", (), 0, ""))
    draft = resolution.load_model(alias, device="cpu", quantization="int4-rtn")
    linears = [m for m in draft.modules() if isinstance(m, (torch.nn.Linear, Int4Linear))]
    assert linears and all(isinstance(m, Int4Linear) for m in linears) and isinstance(draft.lm_head, Int4Linear)
    assert draft.specdec_int4 == {"int4": {"rtn": len(linears)}, "kept": {"float": 0}}
    assert draft.get_input_embeddings().weight.dtype == torch.bfloat16 and draft.specdec_weights == "int4-rtn"
    kept = ready.int4_file(cache / alias / "model", "int4-rtn")
    assert kept.is_file() and kept != ready.int4_file(cache / alias / "model")

    reloaded_from_kept(monkeypatch, alias, "int4-rtn", draft, "quantize_int4")
    pair = specdec.SpeculativeDecoder.from_pretrained(
        alias, alias, draft_quantization="int4-rtn", device="cpu", dtype="float32"
    )
    assert pair.drafter.adapter.model.specdec_weights == "int4-rtn" and ":int4-rtn" in signature(pair.drafter.adapter)
    accepted = 0
    for prompt in ([1, 5, 9, 2, 7], [3, 3, 8]):
        out = pair.generate(prompt, max_new_tokens=16, temperature=0, num_draft_tokens=3)
        assert out.token_ids == hf_greedy(pair.target.model, prompt, 16)
        accepted += out.metrics.accepted_tokens
    assert accepted >= 8  # the rounded self drafts well: verifies of several tokens were kept


def test_the_draft_takes_the_form_measured_fastest_on_the_host(tmp_path, monkeypatch):
    """draft_quantization "auto" for an alias: the fastest of DRAFT_FORMS by its one-token forward, where it
    beats int8 by more than MARGIN, timed once and kept; int8 for a draft that is not an alias or in a dtype."""
    from specdec.loading import draft_quantization_for
    from specdec.models import resolution

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(resolution.ALIASES, "fake", resolution.OfflineModel("fake", "test", (), 0, ""))
    loads, answer = [], {"int8": 0.040, "int4-rtn": 0.036}
    monkeypatch.setattr(resolution, "load_model", lambda name, quantization, **load: loads.append(quantization))
    monkeypatch.setattr(resolution, "time_forwards", lambda variants: {k: answer[k] for k in variants})
    assert draft_quantization_for("auto", "cpu", "fake") == "int4-rtn" and loads == ["int8", "int4-rtn"]
    answer["int4-rtn"] = 0.039  # kept: not timed again, so still the first answer
    assert draft_quantization_for("auto", "cpu", "fake") == "int4-rtn" and len(loads) == 2
    (tmp_path / "kernels.json").unlink()
    assert draft_quantization_for("auto", "cpu", "fake") == "int8" and len(loads) == 4  # 2.5% faster: not enough
    assert draft_quantization_for("auto", "cpu", "not-an-alias") == "int8"
    assert draft_quantization_for("auto", "cpu", "fake", dtype="float32") == "int8" and len(loads) == 4
    assert draft_quantization_for("auto", "cuda", "fake") is None


def test_kept_int4_codes_are_kept_per_isa(tmp_path, monkeypatch):
    # The int4 packing of the same codes differs by the ISA torch dispatches to: a file packed under AVX-512 read
    # under AVX2 (ATEN_CPU_CAPABILITY=avx2) would be other weights.
    from specdec.models import ready

    assert ready.int4_file(tmp_path / "model").name.endswith(
        f"-{torch.backends.cpu.get_cpu_capability().lower()}.safetensors"
    )
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert ready.int4_file(tmp_path / "model").name.endswith("-avx2.safetensors")
