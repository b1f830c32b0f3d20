"""`serve`'s options, built from the settings' declarations (the ServeArgs fields), and read back.

typer builds a command's options from its function's signature, so `serve_options` writes that
signature: for each ServeArgs field with a flag, its option (or the MODEL_DIR argument), then
TGI's name for it and its companions (--sharded), in the fields' order; then --version and the
hidden TGI-only flags (settings/serve_flags.py TGI_ONLY_FLAGS). `flag_values` reads each
setting back under whichever of its names was given (`choose`), converted by the flag's `parse`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import types
import typing
from typing import Any, Callable, List, Optional

import typer

from text_generation_server.cli.common import version_option
from text_generation_server.settings.serve_args import AS_SETTING, Flag, ServeArgs, flag_of, option_name
from text_generation_server.settings.serve_flags import TGI_ONLY_FLAGS


# -- the options ---------------------------------------------------------------------------------------
def _bare(annotation: Any) -> Any:
    """The type without None (Optional[int] -> int); list[str] as typer knows it (List[str])."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    if typing.get_origin(annotation) is list:
        return List[typing.get_args(annotation)[0]]  # type: ignore[misc]
    return annotation


def _declarations(name: str, negatable: bool) -> str:
    """`--name`, or `--name/--no-name` for a switch that is on by default (so it can be turned off)."""
    option = option_name(name)
    return f"{option}/--no-{option[2:]}" if negatable else option


def _keyword(name: str, default: Any, annotation: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def _parameters(name: str, setting_type: Any, default: Any, flag: Flag) -> list[inspect.Parameter]:
    """The command's parameters for one setting: its option (or argument), TGI's name for it, its companions."""
    cli_type = _bare(flag.option_type if flag.option_type is not None else setting_type)
    cli_default = default if flag.option_default is AS_SETTING else flag.option_default
    param = flag.param or name
    negatable = cli_type is bool and cli_default is True
    if flag.argument is not None:
        ours = flag.argument
        main = typer.Argument(cli_default, metavar=flag.argument, show_default=False, help=flag.help)
    else:
        ours = option_name(param)
        names = flag.env or (param.upper(),)
        # A single name as a string: click then names just that variable in its parse errors.
        main = typer.Option(cli_default, _declarations(param, negatable), envvar=names[0] if len(names) == 1
                            else list(names), show_envvar=True, help=flag.help,
                            metavar=flag.metavar or ("|".join(flag.choices) if flag.choices else None))
    params = [_keyword(param, main, Optional[cli_type] if cli_default is None else cli_type)]
    if flag.tgi is not None:
        alias = typer.Option(None, _declarations(flag.tgi, negatable), envvar=flag.tgi.upper(), show_envvar=True,
                             hidden=flag.tgi_older, help=f"TGI's {'older ' if flag.tgi_older else ''}name for {ours}.")
        params.append(_keyword(flag.tgi, alias, Optional[cli_type]))
    for companion in flag.companions:
        params += _parameters(companion.param or "", None, None, companion)
    return params


def _tgi_only_parameters() -> list[inspect.Parameter]:
    """Every TGI_ONLY_FLAGS option, hidden from --help; `check_tgi_only_flags` reads them."""
    params = []
    for flag in TGI_ONLY_FLAGS:
        help_text = f"TGI's flag; here it is {'refused' if flag.refuse else 'a no-op'}: {flag.reason}."
        option = typer.Option(
            False if flag.is_flag else None, flag.option, hidden=True, help=help_text,
            envvar=flag.envvar if flag.read_env else None,
        )
        params.append(_keyword(flag.name, option, bool if flag.is_flag else Optional[str]))
    return params


def serve_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """Gives `command(ctx, **flags)` the signature typer reads `serve`'s options from."""
    hints = typing.get_type_hints(ServeArgs)
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    for item in dataclasses.fields(ServeArgs):
        flag = flag_of(item)
        if flag is not None:
            factory: Any = item.default_factory
            default = item.default if item.default is not dataclasses.MISSING else factory()
            params += _parameters(item.name, hints[item.name], default, flag)
    params.append(_keyword("version", version_option(), bool))
    params += _tgi_only_parameters()
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return command


# -- where a value came from ----------------------------------------------------------------------
def _source(ctx: typer.Context, name: str) -> str:
    """COMMANDLINE, ENVIRONMENT or DEFAULT (click's ParameterSource, by name)."""
    source = ctx.get_parameter_source(name)
    return "DEFAULT" if source is None else source.name


def _param(ctx: typer.Context, name: str):
    for param in ctx.command.params:
        if param.name == name:
            return param
    raise KeyError(name)


def origin(ctx: typer.Context, name: str) -> str:
    """How an error names a setting: the flag, or the variable it was read from."""
    param = _param(ctx, name)
    if _source(ctx, name) == "ENVIRONMENT":
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
        for variable in names:
            if os.environ.get(variable):
                return f"environment variable {variable}"
    if param.param_type_name == "argument":
        return param.metavar or param.name.upper()
    return param.opts[0]


def choose(ctx: typer.Context, name: str, *aliases: str) -> str:
    """Which of a setting's names gives its value: command line first, then the environment,
    then `name` (its default). Names that disagree at the same level are an error."""
    for level in ("COMMANDLINE", "ENVIRONMENT"):
        given = [n for n in (name, *aliases) if _source(ctx, n) == level and ctx.params[n] is not None]
        values = {repr(ctx.params[n]) for n in given}
        if len(values) > 1:
            described = " and ".join(f"{origin(ctx, n)} ({ctx.params[n]})" for n in given)
            raise ValueError(f"{described} name the same setting with different values; give one")
        if given:
            return given[0]
    return name


def flag_value(ctx: typer.Context, name: str, flag: Flag) -> Any:
    """The setting as given under any of its names, converted by the flag's `parse`."""
    given = choose(ctx, name, *([flag.tgi] if flag.tgi is not None else []))
    value = ctx.params[given]
    return value if flag.parse is None or value is None else flag.parse(value, origin(ctx, given))


def check_tgi_only_flags(ctx: typer.Context) -> list[str]:
    """ValueError for the first refused TGI flag that is set; the warnings for ignored ones."""
    warnings = []
    for flag in TGI_ONLY_FLAGS:
        value = ctx.params.get(flag.name)
        if value is None or value is False or _source(ctx, flag.name) == "DEFAULT":
            continue
        where = origin(ctx, flag.name)
        if flag.refuse:
            raise ValueError(f"{where}: {flag.reason}")
        if str(value).lower() not in flag.quiet:
            given = where if flag.is_flag else f"{where}{'=' if where.startswith('environment') else ' '}{value}"
            warnings.append(f"{given}: {flag.reason}")
    return warnings
