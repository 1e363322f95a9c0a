"""The `specdec` command (Typer + rich); installed as the package `specdec_cli`."""
