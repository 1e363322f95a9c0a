"""The `specdec` command line."""

import typer

app = typer.Typer(no_args_is_help=True, help="Exact speculative decoding for Hugging Face causal LMs.")


@app.command()
def version() -> None:
    """Print the installed version."""
    from importlib.metadata import version as installed

    typer.echo(installed("specdec"))


def main() -> None:
    app()
