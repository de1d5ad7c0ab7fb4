"""moectl's Typer app, its two consoles and how a command fails (one line on stderr; exit 1
failed, 2 bad usage). Every command module registers on `app`."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

app = typer.Typer(add_completion=True, no_args_is_help=True, help="Serve Mixture-of-Experts models on Ray Serve.")
err = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 4096)  # like kubectl: piped tables are never folded


def fail(message: str, code: int = 1) -> None:
    sys.stderr.write(f"error: {message}\n")  # one line, never wrapped
    raise typer.Exit(code)
