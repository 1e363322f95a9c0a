"""`specdec serve`: load the pair once, then serve it over OpenAI's HTTP API (specdec.serving; docs/SERVING.md)."""

from __future__ import annotations

import typer

from specdec_cli.app import (
    COMPILE_MODE_HELP,
    DRAFT_HELP,
    DTYPE_HELP,
    TARGET_HELP,
    _parse_k,
    _parse_switch,
    app,
    err,
    load_decoder,
    user_errors,
)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
WILDCARD = ("0.0.0.0", "::")


def _listed(values: list[str] | None) -> tuple[str, ...] | None:
    """A repeatable, comma-separable option as a tuple (None: not given)."""
    if not values:
        return None
    return tuple(item.strip() for value in values for item in value.split(",") if item.strip())


@app.command()
def serve(
    target: str | None = typer.Option(None, help=TARGET_HELP),
    draft: str | None = typer.Option(None, help=DRAFT_HELP),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    draft_quantization: str = typer.Option(
        "auto", help="Draft weights: auto (on CPU the faster of int8 and int4-rtn), int8, int4, int4-rtn or none."
    ),
    target_quantization: str = typer.Option(
        "none", help="int8: an int8-dynamic target (CPU); int4: a GGUF source's 4-bit weights (CPU); exact for it."
    ),
    cache: str = typer.Option("auto", help="KV cache: auto (static on CUDA), dynamic or static."),
    compile: bool | None = typer.Option(None, "--compile/--no-compile", help="Capture forwards. Default: on CUDA."),
    compile_mode: str | None = typer.Option(None, "--compile-mode", help=COMPILE_MODE_HELP),
    num_draft_tokens: str = typer.Option(
        "auto", "--num-draft-tokens", "-k", help="Drafts per round for every request: an integer, or auto."
    ),
    draft_width: str = typer.Option("auto", "--draft-width", help="Draft tree width: 1 (chains), w, or auto."),
    prompt_lookup: str = typer.Option("auto", "--prompt-lookup", help="Copy drafts after the chain: on, off or auto."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (loopback by default)."),
    port: int = typer.Option(8000, min=0, max=65535),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="The name clients send as 'model' [default: the target's name]."
    ),
    api_key: str | None = typer.Option(
        None, "--api-key", envvar="SPECDEC_API_KEY", help="Require 'Authorization: Bearer KEY' on /v1/*."
    ),
    max_queue: int = typer.Option(32, "--max-queue", min=1, help="Requests that may wait for a place in the batch."),
    max_batch: int = typer.Option(
        8, "--max-batch", min=1, help="Requests decoded together (continuous batching); 1: one at a time."
    ),
    max_prompt_tokens: int | None = typer.Option(
        None, "--max-prompt-tokens", min=1, help="Longest prompt accepted, in tokens [default: the context]."
    ),
    max_body_bytes: int = typer.Option(2 * 1024 * 1024, "--max-body-bytes", min=1, help="Largest request body."),
    shutdown_timeout: float = typer.Option(
        30.0, "--shutdown-timeout", min=0.0, help="On SIGTERM, seconds in-flight requests get before a 503."
    ),
    allowed_hosts: list[str] | None = typer.Option(
        None,
        "--allowed-hosts",
        help="Host names clients may reach it by (repeat or comma-separate; '*': any) [default: loopback and --host].",
    ),
    allowed_origins: list[str] | None = typer.Option(
        None,
        "--allowed-origins",
        help="Web origins (scheme://host:port) whose pages may call it; others' cross-origin requests get 403.",
    ),
) -> None:
    """Serve the pair over OpenAI's HTTP API (/v1/completions, /v1/chat/completions). Concurrent requests
    share speculative rounds (continuous batching): each joins the running batch at a round boundary and
    leaves when it ends."""
    try:
        from specdec.models.forms import parse_dtype
        from specdec.models.resolution import parse_device
        from specdec.serving.server import ServeSettings, check_address, check_api_key, create_app, run
        from specdec.serving.session import DraftChoices
    except ImportError as missing:  # FastAPI and uvicorn are the serve extra
        err.print(f"[bold red]error:[/] specdec serve needs the serve extra ({missing.name} is missing): "
                  "pip install 'specdec[serve]'", highlight=False)  # fmt: skip
        raise typer.Exit(2) from None

    k, width = _parse_k(num_draft_tokens, "--num-draft-tokens"), _parse_k(draft_width, "--draft-width")
    lookup = _parse_switch(prompt_lookup, "--prompt-lookup")
    with user_errors():
        api_key = check_api_key(api_key)  # what can be refused is refused before the models load
        hosts, origins = _listed(allowed_hosts), _listed(allowed_origins) or ()
        check_address(host, port)
        drafting = DraftChoices(k, width, lookup)  # a bad -k is refused before the models load
        if dtype == "auto" and max_batch > 1:  # batched forwards are wide: bfloat16 only where it is native
            dtype = str(parse_dtype(dtype, parse_device(device))).removeprefix("torch.")
        decoder, target_name, draft_name = load_decoder(
            target,
            draft,
            dtype,
            device,
            draft_quantization,
            target_quantization,
            cache,
            compile,
            compile_mode=compile_mode,
        )
        settings = ServeSettings(
            model=served_model_name or target_name,
            api_key=api_key,
            max_queue=max_queue,
            max_batch=max_batch,
            max_body_bytes=max_body_bytes,
            max_prompt_tokens=max_prompt_tokens,
            host=host,
            allowed_hosts=hosts,
            allowed_origins=origins,
            drafting=drafting,
        )
        decoder.on_status = lambda message: err.print(f"[dim]{message} ...[/]", highlight=False)
        application = create_app(decoder, settings)
        if host not in LOOPBACK and api_key is None:
            err.print(
                f"[bold yellow]warning:[/] serving on {host} without --api-key: anyone who can reach it may use it"
            )
        if host in WILDCARD and hosts is None:
            err.print(
                f"[bold yellow]note:[/] on {host}, clients must name it by a loopback address unless --allowed-hosts "
                "lists the names they use",
                highlight=False,
            )
        err.print(f"serving {settings.model!r} (draft: {draft_name}) on http://{host}:{port}/v1", highlight=False)
        run(application, host=host, port=port, shutdown_timeout=shutdown_timeout)
