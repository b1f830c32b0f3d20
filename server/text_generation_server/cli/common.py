"""What every command shares: the `error:` line and its exit code, logging to stderr, the version."""

from __future__ import annotations

import sys
from importlib import metadata
from typing import NoReturn

import typer
from loguru import logger

from text_generation_server.about import __version__
from text_generation_server.settings.serve_flags import parse_log_level

PACKAGE = "text-generation-server"
LEVEL_HELP = "trace, debug, info, warning or error."
SHARD_SIZE_HELP = "Largest safetensors file written, in MB."


def package_version() -> str:
    """The installed distribution's version; the source tree's when it is not installed."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return __version__


def print_version(value: bool) -> None:
    """The --version callback (top level and serve): prints and exits before anything else runs."""
    if value:
        typer.echo(f"{PACKAGE} {package_version()}")
        raise typer.Exit(0)


def version_option() -> bool:
    """A fresh --version option for a command's signature."""
    return typer.Option(False, "--version", is_eager=True, callback=print_version, help="Print the version and exit.")


def setup_logging(level: str = "INFO") -> None:
    """Loguru to stderr, so stdout stays clean for results (--json)."""
    try:
        name = parse_log_level(level)
    except ValueError as exc:
        fail(str(exc))
    logger.remove()
    logger.add(sys.stderr, level=name, backtrace=False, diagnose=False)


def fail(message: str, code: int = 2) -> NoReturn:
    """The one way a command reports a user error: `error: ...` on stderr, exit 2 (1: the server said no)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)
