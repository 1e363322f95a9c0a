"""The one description of the host a figure was measured on, for every suite's JSON."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

# The CPU features the figures depend on: torch's and oneDNN's kernels (AVX-512, its bf16, AMX) and ggml's.
ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")  # what a run's dispatch and threads follow
ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def commit() -> str | None:
    """The checkout's commit (with "+changes" when the tree differs from it), or None outside git."""

    def git(*args: str) -> str:
        here = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=here).stdout.strip()

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if dirty else "")


def host_info() -> dict:
    """What the figures depend on: the CPU and which of ISA_FLAGS it has (as lscpu lists them), what torch
    dispatches to (`isa`; ATEN_CPU_CAPABILITY can lower it, as for a simulated AVX2 host), threads, cores,
    the load average, the versions, the date and the commit."""
    import torch
    import transformers

    from specdec.models.forms import native_bf16
    from specdec.models.packing import cpu_flags

    flags = cpu_flags()
    return {
        "cpu": cpu_model(),
        "flags": {flag: flag in flags for flag in ISA_FLAGS},
        "isa": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16(),
        "env": {k: os.environ[k] for k in ENV if k in os.environ},
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
    }


def describe(host: dict) -> str:
    """One line: the CPU, its listed features, torch's dispatch, threads and the load average."""
    older = isinstance(host.get("isa"), dict)  # JSON from before this helper: "isa" held the flags
    flags = host.get("flags") or (host["isa"] if older else {})
    listed = ", ".join(flag for flag, on in flags.items() if on) or "no features listed"
    isa = host.get("torch_cpu_capability", "?") if older else host.get("isa", "?")
    load = host.get("loadavg")
    cpu, cores, threads = host.get("cpu", "CPU not recorded"), host.get("cores", "?"), host.get("threads", "?")
    line = f"Host: {cpu} ({cores} cores; {listed}; torch dispatch {isa}), {threads} threads"
    return line + (f", load {load[0]:.2f}" if load else "") + "."
