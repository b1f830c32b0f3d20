"""The `text-generation-server` command line: the app and its commands, each defined in the module
of its role (cli/serve.py, cli/generate.py, cli/remote.py, cli/jobs.py)."""

from __future__ import annotations

import typer

from text_generation_server.cli import generate, jobs, remote, serve
from text_generation_server.cli.common import version_option

# Plain click help (rich_markup_mode=None): rich's tables cut long flag names ("--max-batch-pre…")
# at 80 columns, where plain help wraps the text and keeps every name whole.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Serve, run, convert and quantize large language models.",
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


@app.callback()
def main_options(version: bool = version_option()) -> None:
    """Serve, run, convert and quantize large language models."""


# In the order `--help` lists them.
app.command()(generate.generate)
app.command()(jobs.convert)
app.command(epilog=serve.SERVE_EPILOG)(serve.serve)
app.command()(remote.health)
app.command()(jobs.quantize)
app.command()(jobs.perplexity)


def serve_environment_variables() -> list[str]:
    """Every variable `serve` reads a setting from (HOSTNAME included), for wrappers and tests
    that must start it from a clean environment."""
    command = typer.main.get_command(app).commands["serve"]
    names = set()
    for param in command.params:
        names.update([param.envvar] if isinstance(param.envvar, str) else param.envvar or ())
    return sorted(names)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
