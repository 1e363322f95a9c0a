"""Models kept ready to run: an offline alias loaded on the CPU is cached on disk in the form it runs
in, so the next start skips the work between the file and that form.

- A float model (bfloat16, float16, float32) is kept as safetensors in its dtype (`<alias>/<dtype>/`),
  memory-mapped at load: the float32 conversion of the GGUF (`<alias>/model/`) is read once, not
  at every start. The oneDNN packing of its Linears (specdec.models.packing) is still done at each load: a
  packed weight is an opaque tensor that cannot be saved.
- An int8 model (specdec.models.quantize) is kept whole, pickled by torch.save (int8 weights, scales, fused
  projections), and loaded memory-mapped: quantising the 0.5B draft from float32 took 19 s (a busy
  host), loading the kept one 1.3 s. The file is keyed by torch's version and the quantized engine;
  one that fails to load is rebuilt. Its fbgemm-packed weights are kept unpacked (`Unpacked`) and
  packed at load on a pool of threads: a packed weight unpickles through `linear_prepack`, one at a
  time, which was nearly all of the load (2.4 of 2.5 s for the draft; 2026-11-27, AVX-512 host).
- An int4 target (specdec.models.int4, opt-in) keeps its packed 4-bit codes and bfloat16 scales and zeros as
  safetensors (`<alias>/int4-torch*.safetensors`): decoding the GGUF's tensors and packing them took
  most of a 21 s start of the 1.5B, which then fell to 9-11 s (docs/notes/int4.md).
- The tokenizer is kept pickled (`<alias>/tokenizer-*.pkl`, keyed by transformers' and tokenizers'
  versions): transformers 5 builds a fast tokenizer by parsing its JSON in Python, 1.0 s for Qwen2.5's,
  and unpickling the built one took 0.4 s (2026-11-27, AVX-512 host, busy).

A float model is loaded from its memory-mapped file and packed Linear by Linear; each packed weight's
file pages are then dropped from the process (madvise), so peak memory is about the packed model, not
the file and the packed model together (6.4 GB for the 1.5B target in bfloat16 before this). What stays
plain (embeddings, norms, biases, a plain Linear's weight) keeps reading from the file's private mapping,
as an int8 model's do: copying them out wrote fresh memory, 0.25-1.5 s of the default pair's start and
0.6 GB of its peak (docs/notes/2026-12-04-session.md).

Files are written to a temporary name and renamed into place, so a killed write leaves no half file.
The pickled files are this cache's own (written by this code into the user's cache directory); they are
never read from anywhere else. Kept files take the directory's permission bits (follow_umask).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import secrets
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def float_dir(model_dir: Path, dtype: torch.dtype) -> Path | None:
    """Where the alias's model is kept in `dtype` (None: float32, which `model_dir` already is)."""
    if dtype not in DTYPE_NAMES or dtype == torch.float32:
        return None
    return model_dir.parent / DTYPE_NAMES[dtype]


def is_ready(path: Path | None) -> bool:
    return path is not None and (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def follow_umask(directory: Path) -> None:
    """Give the directory's files the umask's permissions, as the directory took them (safetensors writes
    0600, through a temporary file, which would keep a shared cache from other users)."""
    file_mode = directory.stat().st_mode & 0o666
    for path in filter(Path.is_file, directory.iterdir()):
        path.chmod(file_mode)


def keep_float(model, path: Path) -> None:
    """Save the loaded (not yet packed) float model into `path`, atomically; a failure only logs."""
    tmp = path.parent / f".ready-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        model.save_pretrained(tmp)
        follow_umask(tmp)
        os.replace(tmp, path)
    except OSError as error:
        logger.warning("could not keep %s ready to run: %s", path, error)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def int8_file(model_dir: Path, keep_outliers: bool) -> Path:
    kind = "int8-outliers" if keep_outliers else "int8"
    version = torch.__version__.replace("+", "-")
    return model_dir.parent / f"{kind}-torch{version}-{torch.backends.quantized.engine}.pt"


def tokenizer_file(model_dir: Path) -> Path:
    import tokenizers
    import transformers

    return model_dir.parent / f"tokenizer-transformers{transformers.__version__}-tokenizers{tokenizers.__version__}.pkl"


def read_kept(path: Path, read, what: str):
    """`read(path)` of a kept file, or None where there is none or it cannot be read (it is then removed)."""
    if not path.is_file():
        return None
    try:
        return read(path)
    except Exception as error:  # noqa: BLE001 - a stale or damaged file is rebuilt, whatever the cause
        logger.warning("the kept %s %s cannot be read (%s); building it again", what, path, error)
        path.unlink(missing_ok=True)
        return None


def write_kept(path: Path, write) -> None:
    """`write(tmp)`, then tmp renamed into `path` (a killed write leaves no half file); a failure only logs."""
    tmp = path.parent / f".ready-{os.getpid()}-{secrets.token_hex(4)}{path.suffix}"
    try:
        write(tmp)
        tmp.chmod(path.parent.stat().st_mode & 0o666)  # as follow_umask: safetensors writes 0600
        os.replace(tmp, path)
    except (OSError, RuntimeError, pickle.PicklingError, TypeError) as error:
        logger.warning("could not keep %s ready to run: %s", path, error)
    finally:
        tmp.unlink(missing_ok=True)


def load_tokenizer(path: Path):
    return read_kept(path, lambda kept: pickle.loads(kept.read_bytes()), "tokenizer")  # our own file: see above


def keep_tokenizer(tokenizer, path: Path) -> None:
    write_kept(path, lambda tmp: tmp.write_bytes(pickle.dumps(tokenizer)))


def int4_file(model_dir: Path, kind: str = "int4") -> Path:
    """Where an alias's int4 Linears are kept (specdec.models.int4.keep_int4): keyed by the form ("int4": the
    GGUF's codes; "int4-rtn": its own weights rounded), torch's version and the ISA its kernels dispatch to,
    whose int4 packing they are in (the same codes pack to other bytes under AVX2 than under AVX-512)."""
    version = torch.__version__.replace("+", "-")
    return model_dir.parent / f"{kind}-torch{version}-{torch.backends.cpu.get_cpu_capability().lower()}.safetensors"


class Unpacked:
    """An fbgemm-packed int8 weight as the kept file holds it: the quantised weight and the bias."""

    def __init__(self, packed):
        self.weight, self.bias = torch.ops.quantized.linear_unpack(packed)

    def pack(self):
        return torch.ops.quantized.linear_prepack(self.weight, self.bias)


def _is_packed(value) -> bool:
    return isinstance(value, torch.ScriptObject) and value._type().name() == "LinearPackedParamsBase"


def packed_slots(model: torch.nn.Module) -> list[tuple[object, str]]:
    """(holder, attribute) of each packed int8 weight (or its `Unpacked` stand-in) in the model: torch.ao's
    LinearPackedParams modules and the fused groups of specdec.models.quantize, each once."""
    holders = {id(module): module for module in model.modules()}
    for module in model.modules():
        group = getattr(module, "group", None)
        if group is not None and hasattr(group, "packed"):
            holders[id(group)] = group
    return [
        (holder, name)
        for holder in holders.values()
        for name, value in vars(holder).items()
        if _is_packed(value) or isinstance(value, Unpacked)
    ]


def _pack_all(model: torch.nn.Module, pages: FilePages) -> int:
    """Pack every `Unpacked` weight, on all threads (the op lets the GIL go); returns how many."""
    slots = [(holder, name) for holder, name in packed_slots(model) if isinstance(getattr(holder, name), Unpacked)]

    def pack(slot):
        holder, name = slot
        unpacked = getattr(holder, name)
        setattr(holder, name, unpacked.pack())
        pages.drop(unpacked.weight)

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        list(pool.map(pack, slots))
    return len(slots)


def _read_int8(path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's packed weights still unpickle through TypedStorage
        model = torch.load(path, weights_only=False, mmap=True)  # our own file: see the module's docstring
    if not _pack_all(model, FilePages(path)) and packed_slots(model):  # an older file, weights packed
        keep_int8(model, path)  # kept again, unpacked
    return model


def load_int8(path: Path):
    """The kept int8 model, or None where there is none or it cannot be read (it is then removed)."""
    return read_kept(path, _read_int8, "int8 model")


def keep_int8(model, path: Path) -> None:
    """Save the int8 model into `path`, its packed weights unpacked (the model is left as it was)."""
    slots = [(holder, name, getattr(holder, name)) for holder, name in packed_slots(model)]
    try:
        for holder, name, packed in slots:
            setattr(holder, name, Unpacked(packed))
        write_kept(path, lambda tmp: torch.save(model, tmp))
    finally:
        for holder, name, packed in slots:
            setattr(holder, name, packed)


class FilePages:
    """The address ranges where `path` (a file, or any file under a directory) is mapped into this process
    (/proc/self/maps), to let tensors read from it go once they are no longer needed. Linux only; elsewhere
    it holds no range and does nothing."""

    PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
    MADV_DONTNEED = 4

    def __init__(self, path: Path):
        self.ranges = []
        inside = str(path.resolve()) + os.sep
        try:
            for line in Path("/proc/self/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and (fields[5] == str(path.resolve()) or fields[5].startswith(inside)):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    self.ranges.append((start, end))
        except OSError:
            pass

    def holds(self, tensor: torch.Tensor) -> bool:
        if tensor.is_mkldnn or not self.ranges:  # a packed weight is oneDNN's own (opaque) memory
            return False
        address = tensor.data_ptr()
        return any(start <= address < end for start, end in self.ranges)

    def drop(self, tensor: torch.Tensor) -> None:
        """Drop the file pages that lie wholly inside the tensor's bytes (read again from the file if touched)."""
        if not self.holds(tensor):
            return
        begin = -(-tensor.data_ptr() // self.PAGE) * self.PAGE
        end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // self.PAGE * self.PAGE
        if end > begin:
            ctypes.CDLL(None).madvise(ctypes.c_void_p(begin), ctypes.c_size_t(end - begin), self.MADV_DONTNEED)
