"""Models kept ready to run: an offline alias loaded on the CPU is cached on disk in the form it runs
in, so the next start skips the work between the file and that form.

- A float model (bfloat16, float16, float32) is kept as safetensors in its dtype (`<alias>/<dtype>/`),
  memory-mapped at load: the float32 conversion of the GGUF (`<alias>/model/`) is read once, not
  at every start. Its Linears packed for oneDNN (specdec.models.packing) are kept too, as their bytes and
  layouts in one file per dtype and host (`<alias>/packed-<dtype>-<host>.bin`, KeptPacks) that a load maps:
  the 1.5B target's load fell from 1.8-2.0 s to 0.23 s (2026-12-04, AMX host).
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
the file and the packed model together (6.4 GB for the 1.5B target in bfloat16 before this). Embeddings,
norms and biases keep reading from the file's private mapping, as an int8 model's do: copying them out wrote
fresh memory, 0.25-1.5 s of the default pair's start and 0.6 GB of its peak. A Linear left plain streams its
whole weight every forward, and on the AMX guest one read from the file's pages made the bf16 target alone
1.24x slower (simulated AVX2, where no bf16 Linear packs): its weight is copied out (FilePages.copy_out;
docs/notes/2026-12-04-session.md).

Files are written to a temporary name and renamed into place, so a killed write leaves no half file.
The pickled files are this cache's own (written by this code into the user's cache directory); they are
never read from anywhere else. Kept files take the directory's permission bits (follow_umask).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
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

    def copy_out(self, tensors) -> None:
        """Copy each of `tensors` still read from the file into memory of its own, and drop its pages."""
        for tensor in tensors:
            if self.holds(tensor):
                old = tensor.data
                tensor.data = old.clone()
                self.drop(old)

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
            _advise(begin, end - begin, self.MADV_DONTNEED)


def packs_file(model_dir: Path, dtype: torch.dtype, host: str) -> Path:
    """Where an alias's packed float Linears are kept (KeptPacks): keyed by the dtype and the host (packing.host_id:
    the CPU and its flags, torch's version, the ISA limits; not the threads), whose oneDNN layout they are in."""
    digest = hashlib.sha256(host.encode()).hexdigest()[:12]
    return model_dir.parent / f"packed-{DTYPE_NAMES.get(dtype, str(dtype))}-{digest}.bin"


class KeptPacks:
    """oneDNN's packed Linear weights of an alias, kept in one file beside it and read back through the file's
    private mapping. A packed weight is an opaque oneDNN tensor, but its bytes and oneDNN's description of
    their layout can be saved, and torch's AOTInductor shim (`aoti_torch_create_tensor_from_blob_v2`) makes
    the same tensor over mapped bytes again: a start then neither reorders the weights nor writes their
    2.6 GB (the 1.5B target) into fresh memory (docs/notes/2026-12-04-session.md). The file is keyed by
    the host (the layout follows its ISA) and stamped with the source file its weights were read from (size,
    mtime, inode), and the first weight a load reads is packed anew and compared with it (`_same`); a weight
    it lacks (another source, name, shape or dtype) is packed anew, and the file rewritten with it beside the
    others."""

    ALIGN = 4096  # the data and each weight's bytes start on a page
    MADV_HUGEPAGE = 14

    def __init__(self, path: Path, source: Path):
        self.path, self.stamp = path, _stamp(source) if _blob_api() is not None else None  # None: keeps nothing
        self.entries, self.mapped, self.packed, self.fresh, self.checked = {}, None, {}, False, False
        if self.stamp is not None:
            self.entries, self.mapped = read_kept(path, self._read, "packed weights") or ({}, None)

    def _read(self, path: Path):
        with open(path, "rb") as file:
            header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
        if header["source"] != self.stamp:
            raise ValueError("packed from another source file")
        size, start = path.stat().st_size, header["start"]
        if any(start + entry["offset"] + entry["nbytes"] > size for entry in header["weights"].values()):
            raise ValueError("truncated")
        mapped = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        _advise(mapped.data_ptr(), size, self.MADV_HUGEPAGE)  # read into huge pages: fewer TLB misses per forward
        return header["weights"], mapped[start:]

    def pack(self, name: str, shape: tuple[int, int], dtype: torch.dtype, weight):
        """(the packed form of `weight()`, a [out, in] tensor of `shape`, kept under `name`; the bytes it
        reads, which its holder keeps alive, or None): from the file where it holds this shape and dtype,
        else reordered now (and kept at `keep`)."""
        entry, packed, kept = self.entries.get(name), None, self.mapped
        if (
            entry is not None
            and entry["shape"] == list(shape)
            and entry["dtype"] == str(dtype)
            and self._same(entry, weight)
        ):
            packed = _from_blob(self.mapped[entry["offset"] :], shape, dtype, bytes.fromhex(entry["md"]))
        if packed is None:
            packed, kept = reorder(weight()), None
            self.fresh = True
        self.packed[name] = packed
        return packed, kept

    def _same(self, entry: dict, weight) -> bool:
        """Whether this host packs as the file says: the first weight read from the file is packed anew and
        compared, layout and bytes (2-3 ms for the 1.5B's first q/k/v); where they differ, nothing is read."""
        if not self.checked:
            fresh = reorder(weight())
            md = _layout(fresh)
            data = ctypes.string_at(torch.ops.mkldnn.data_ptr(fresh), torch.ops.mkldnn._nbytes(fresh))
            kept = ctypes.string_at(self.mapped.data_ptr() + entry["offset"], entry["nbytes"])
            if md != entry["md"] or data != kept:
                logger.warning("the kept packed weights %s do not match this host's packing; packing again", self.path)
                self.entries = {}
            self.checked = True
        return bool(self.entries)

    def keep(self) -> None:
        """Write every weight this load packed into the file, where any of them was packed anew."""
        if not self.fresh or self.stamp is None:
            return
        sources = {}  # name -> (its entry, the address of its bytes): the file's others too, so loads that pack
        for name, entry in self.entries.items():  # other subsets of the model (other measured forms) converge
            sources[name] = (entry, self.mapped.data_ptr() + entry["offset"])
        for name, packed in self.packed.items():
            nbytes = torch.ops.mkldnn._nbytes(packed)
            entry = dict(shape=list(packed.shape), dtype=str(packed.dtype), md=_layout(packed), nbytes=nbytes)
            sources[name] = (entry, torch.ops.mkldnn.data_ptr(packed))
        weights, offset = {}, 0
        for name, (entry, _) in sources.items():
            weights[name] = {**entry, "offset": offset}
            offset += -(-entry["nbytes"] // self.ALIGN) * self.ALIGN
        header = json.dumps(dict(source=self.stamp, weights=weights, start=0)).encode()
        start = -(-(8 + len(header) + 16) // self.ALIGN) * self.ALIGN  # 16: room for the start's own digits
        header = json.dumps(dict(source=self.stamp, weights=weights, start=start)).encode()

        def write(tmp: Path):
            with open(tmp, "wb") as file:
                file.write(len(header).to_bytes(8, "little") + header)
                for name, (entry, address) in sources.items():
                    file.seek(start + weights[name]["offset"])
                    file.write((ctypes.c_char * entry["nbytes"]).from_address(address))
                file.flush()
                os.fsync(file.fileno())  # written out, so that its cached pages can go: the next load reads
                if hasattr(os, "posix_fadvise"):  # them again into the huge pages its mapping asks for
                    os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

        write_kept(self.path, write)


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight in oneDNN's blocked layout for a Linear (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def _layout(packed: torch.Tensor) -> str:
    """oneDNN's serialized description of a packed weight's layout, as hex."""
    return bytes(torch.ops.mkldnn._get_mkldnn_serialized_md(packed).tolist()).hex()


def _advise(address: int, size: int, advice: int) -> None:
    """madvise over the pages from `address` (rounded down to a page) for `size` bytes; Linux only, advisory."""
    begin = address // FilePages.PAGE * FilePages.PAGE
    try:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(begin), ctypes.c_size_t(size + address - begin), advice)
    except (OSError, AttributeError):
        pass


def _stamp(path: Path) -> list[int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


@functools.cache
def _blob_api():
    """(libtorch_cpu, torch's handle-to-tensor function) for `_from_blob`, or None where this torch lacks them."""
    steal = getattr(getattr(torch._C, "_aoti", None), "alloc_tensor_by_stealing_from_void_ptr", None)
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        lib.aoti_torch_create_tensor_from_blob_v2.restype = ctypes.c_int32
        for code in (lib.aoti_torch_device_type_cpu, lib.aoti_torch_layout__mkldnn, lib.aoti_torch_dtype_bfloat16,
                     lib.aoti_torch_dtype_float32):  # fmt: skip
            code.restype = ctypes.c_int32
    except (OSError, AttributeError):
        return None
    return None if steal is None else (lib, steal)


def _from_blob(data: torch.Tensor, shape, dtype: torch.dtype, md: bytes) -> torch.Tensor | None:
    """An mkldnn tensor over `data`'s bytes, laid out as oneDNN's serialized description `md` says; None where
    this torch cannot make one. It does not own the bytes: the caller keeps `data` alive (PackedLinear.kept)."""
    api = _blob_api()
    if api is None:
        return None
    lib, steal = api
    codes = {torch.bfloat16: lib.aoti_torch_dtype_bfloat16(), torch.float32: lib.aoti_torch_dtype_float32()}
    if dtype not in codes:
        return None
    sizes, strides = (ctypes.c_int64 * 2)(*shape), (ctypes.c_int64 * 2)(shape[1], 1)
    handle, layout = ctypes.c_void_p(), (ctypes.c_uint8 * len(md)).from_buffer_copy(md)
    error = lib.aoti_torch_create_tensor_from_blob_v2(
        ctypes.c_void_p(data.data_ptr()), ctypes.c_int64(2), sizes, strides, ctypes.c_int64(0),
        ctypes.c_int32(codes[dtype]), ctypes.c_int32(lib.aoti_torch_device_type_cpu()), ctypes.c_int32(0),
        ctypes.byref(handle), ctypes.c_int32(lib.aoti_torch_layout__mkldnn()), layout, ctypes.c_int64(len(md)),
    )  # fmt: skip
    if error != 0 or not handle.value:
        return None
    capsule = ctypes.pythonapi.PyCapsule_New
    capsule.restype, capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return steal(capsule(handle.value, None, None))
