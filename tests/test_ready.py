"""Models kept ready to run (specdec.models.ready): an offline alias is kept in the dtype it runs in, and its
int8 form whole, so the next load skips the conversion and the quantisation, and loads the same model."""

import gc
import os

import pytest
import torch
from torch.nn import Linear
from transformers import AutoModelForCausalLM

from specdec.models import ready, resolution
from specdec.models.packing import FORMS, packed_linears, plain_weights, shape_key
from specdec.models.resolution import OfflineModel, load_model
from tests.tiny import build

ALIAS = "ready-fake"


@pytest.fixture
def alias(tmp_path, monkeypatch):
    """An offline alias whose float32 model is already in the cache (as fetch_alias leaves it)."""
    monkeypatch.setitem(resolution.ALIASES, ALIAS, OfflineModel(ALIAS, "test", (), 0, ""))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    build("qwen2", 0, tmp_path / "cache" / ALIAS / "model")
    return tmp_path / "cache" / ALIAS


@pytest.fixture
def loads(monkeypatch):
    """Where each transformers load read from, and how many quantisations ran."""
    seen = {"from": [], "quantised": 0}
    real_load, real_quantise = AutoModelForCausalLM.from_pretrained, resolution_quantise()

    def from_pretrained(where, *args, **kwargs):
        seen["from"].append(str(where))
        return real_load(where, *args, **kwargs)

    def quantise(*args, **kwargs):
        seen["quantised"] += 1
        return real_quantise(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr("specdec.models.quantize.quantize_int8", quantise)
    return seen


def resolution_quantise():
    from specdec.models.quantize import quantize_int8

    return quantize_int8


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([[1, 5, 9, 2]])).logits


def test_a_bfloat16_alias_is_kept_in_bfloat16_and_loaded_from_there(alias, loads):
    first = load_model(ALIAS, dtype="bfloat16", device="cpu")
    kept = alias / "bfloat16"
    assert ready.is_ready(kept) and loads["from"] == [str(alias / "model")]
    again = load_model(ALIAS, dtype="bfloat16", device="cpu")
    assert loads["from"][-1] == str(kept)  # the float32 conversion is not read again
    assert next(again.parameters()).dtype == torch.bfloat16
    assert torch.equal(logits(first), logits(again))
    assert not list(alias.glob(".ready-*"))  # no temporary left behind
    pages = ready.FilePages(kept / "model.safetensors")
    assert pages.holds(again.get_input_embeddings().weight)  # what stays plain reads from the kept file, not copied
    del first, again
    gc.collect()
    assert ready.FilePages(kept / "model.safetensors").ranges == []  # the mapping goes with the model


def test_a_linear_left_plain_streams_its_weight_from_memory_of_its_own_the_rest_stays_in_the_kept_file(
    alias, loads, monkeypatch
):
    load_model(ALIAS, dtype="bfloat16", device="cpu")  # kept in bfloat16
    plain = lambda model, *args, **kwargs: {shape_key(m): FORMS[0] for m in model.modules() if type(m) is Linear}  # noqa: E731
    monkeypatch.setattr(resolution, "measured_forms", plain)
    model = load_model(ALIAS, dtype="bfloat16", device="cpu")
    pages = ready.FilePages(alias / "bfloat16" / "model.safetensors")
    weights = plain_weights(model)
    assert len(weights) >= 7 and not any(pages.holds(w) for w in weights)  # copied out: read every forward
    norms = [m.weight for m in model.modules() if "RMSNorm" in type(m).__name__]
    assert norms and all(pages.holds(w) for w in norms)  # the rest still reads from the file
    assert torch.equal(logits(model), logits(load_model(ALIAS, dtype="bfloat16", device="cpu", pack=False)))


def test_file_pages_drop_only_what_lies_in_the_file_and_a_dropped_tensor_reads_back_from_it(tmp_path):
    from safetensors.torch import safe_open, save_file

    saved = {"w": torch.randn(512, 1024), "b": torch.randn(3)}
    save_file(saved, tmp_path / "t.safetensors")
    with safe_open(tmp_path / "t.safetensors", framework="pt") as handle:
        mapped = {name: handle.get_tensor(name) for name in ("w", "b")}
    pages = ready.FilePages(tmp_path / "t.safetensors")
    own = torch.randn(4)
    kept = own.clone()
    assert pages.holds(mapped["w"]) and pages.holds(mapped["b"]) and not pages.holds(own)
    pages.drop(own)  # not the file's: untouched
    pages.drop(mapped["w"])
    assert torch.equal(own, kept)
    assert torch.equal(mapped["w"], saved["w"]) and torch.equal(mapped["b"], saved["b"])  # read again from the file


def test_packed_weights_are_kept_read_back_equal_and_packed_again_for_another_source(alias, loads):
    first = load_model(ALIAS, dtype="float32", device="cpu")
    assert packed_linears(first) and all(m.kept is None for m in packed_linears(first))  # packed at this load
    [kept] = alias.glob("packed-float32-*.bin")
    again = load_model(ALIAS, dtype="float32", device="cpu")
    assert all(m.kept is not None for m in packed_linears(again))  # read over the kept file's bytes
    assert len(packed_linears(again)) == len(packed_linears(first))
    assert torch.equal(logits(first), logits(again))
    source = alias / "model" / "model.safetensors"
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))  # another source file
    third = load_model(ALIAS, dtype="float32", device="cpu")
    assert all(m.kept is None for m in packed_linears(third)) and torch.equal(logits(third), logits(first))
    with open(kept, "r+b") as file:  # a damaged file (cut short) is packed again, not read
        file.truncate(kept.stat().st_size // 2)
    fourth = load_model(ALIAS, dtype="float32", device="cpu")
    assert all(m.kept is None for m in packed_linears(fourth)) and torch.equal(logits(fourth), logits(first))
    assert kept.stat().st_size > 0 and all(
        m.kept is not None for m in packed_linears(load_model(ALIAS, dtype="float32"))
    )


def test_kept_packs_that_this_host_would_pack_otherwise_are_packed_again(alias, loads):
    """The first weight read from the file is packed anew and compared: a byte that differs (another layout,
    another oneDNN) and nothing of the file is read."""
    import json

    first = load_model(ALIAS, dtype="float32", device="cpu")
    [kept] = alias.glob("packed-float32-*.bin")
    with open(kept, "r+b") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        entry = next(iter(header["weights"].values()))  # the first one a load reads
        file.seek(header["start"] + entry["offset"] + entry["nbytes"] // 2)
        byte = file.read(1)
        file.seek(-1, 1)
        file.write(bytes([byte[0] ^ 0x40]))
    again = load_model(ALIAS, dtype="float32", device="cpu")
    assert all(m.kept is None for m in packed_linears(again)) and torch.equal(logits(again), logits(first))
    assert all(m.kept is not None for m in packed_linears(load_model(ALIAS, dtype="float32", device="cpu")))


def test_a_torch_that_cannot_map_packed_weights_packs_at_each_load_and_keeps_nothing(alias, loads, monkeypatch):
    monkeypatch.setattr(ready, "_blob_api", lambda: None)
    first, again = (load_model(ALIAS, dtype="float32", device="cpu") for _ in range(2))
    assert not list(alias.glob("packed-*")) and all(m.kept is None for m in packed_linears(again))
    assert torch.equal(logits(first), logits(again))


def test_float32_is_the_cached_model_itself(alias, loads):
    load_model(ALIAS, dtype="float32", device="cpu")
    assert loads["from"] == [str(alias / "model")] and not (alias / "float32").exists()


def test_an_int8_alias_is_kept_whole_and_a_damaged_copy_is_rebuilt(alias, loads):
    first = load_model(ALIAS, device="cpu", quantization="int8")
    kept = ready.int8_file(alias / "model", keep_outliers=False)
    assert kept.is_file() and loads["quantised"] == 1
    again = load_model(ALIAS, device="cpu", quantization="int8")
    assert loads["quantised"] == 1 and len(loads["from"]) == 1  # neither loaded nor quantised again
    assert torch.equal(logits(first), logits(again))
    kept.write_bytes(b"not a pickle")
    rebuilt = load_model(ALIAS, device="cpu", quantization="int8")
    assert loads["quantised"] == 2 and torch.equal(logits(rebuilt), logits(first))
    assert ready.load_int8(kept) is not None  # written again, whole


def test_the_kept_int8_file_holds_weights_unpacked_and_an_older_packed_file_is_kept_again(alias, loads):
    first = load_model(ALIAS, device="cpu", quantization="int8")
    kept = ready.int8_file(alias / "model", keep_outliers=False)
    slots = ready.packed_slots(first)
    assert slots and all(ready._is_packed(getattr(holder, name)) for holder, name in slots)  # the model runs packed
    saved = torch.load(kept, weights_only=False)
    assert {type(getattr(h, n)) for h, n in ready.packed_slots(saved)} == {ready.Unpacked}  # the file does not
    torch.save(first, kept)  # a file kept before: packed weights, unpickled one by one
    again = load_model(ALIAS, device="cpu", quantization="int8")
    assert torch.equal(logits(first), logits(again)) and loads["quantised"] == 1
    assert all(ready._is_packed(getattr(h, n)) for h, n in ready.packed_slots(again))
    resaved = torch.load(kept, weights_only=False)
    assert {type(getattr(h, n)) for h, n in ready.packed_slots(resaved)} == {ready.Unpacked}  # kept again


def test_an_aliass_tokenizer_is_kept_built_and_a_damaged_copy_is_rebuilt(alias, monkeypatch):
    from transformers import AutoTokenizer

    from tests.tiny import save_char_tokenizer

    save_char_tokenizer(alias / "model")
    built = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: built.append(a) or real(*a, **k))
    first = resolution.load_tokenizer(ALIAS)
    kept = ready.tokenizer_file(alias / "model")
    again = resolution.load_tokenizer(ALIAS)
    assert kept.is_file() and len(built) == 1 and again is not first
    assert again("hello, world")["input_ids"] == first("hello, world")["input_ids"]
    kept.write_bytes(b"not a pickle")
    rebuilt = resolution.load_tokenizer(ALIAS)
    assert len(built) == 2 and rebuilt.get_vocab() == first.get_vocab() and ready.load_tokenizer(kept) is not None


def test_a_local_directory_is_never_written_to(tmp_path, loads):
    build("qwen2", 0, tmp_path / "mine")
    load_model(str(tmp_path / "mine"), dtype="bfloat16", device="cpu")
    load_model(str(tmp_path / "mine"), device="cpu", quantization="int8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]
    assert not (tmp_path / "mine" / "bfloat16").exists()


def test_the_kept_copy_follows_the_umask(alias):
    saved = os.umask(0o022)
    try:
        load_model(ALIAS, dtype="bfloat16", device="cpu")
    finally:
        os.umask(saved)
    modes = {path.name: path.stat().st_mode & 0o777 for path in (alias / "bfloat16").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}  # not safetensors' 0600
