"""Command-line options generated from a config: one `--field-name` option per field, with
the field's default and help, so a config's knobs are declared once (in the config).

Two kinds of config: pydantic models (`ServerConfig`, `ClusterConfig`: each field's
`description`) and frozen dataclasses (every bench's and experiment's `Config`: each field's
`metadata={"help": ...}`).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import typing

import typer
from pydantic import BaseModel, SecretStr

ENV_VARS = {"api_key": "METRONOME_API_KEY"}  # secrets: read from the environment, not shown
# where an option left at its default came from, by name: typer's ParameterSource is not
# always click's (`in (click.core.ParameterSource.DEFAULT, ...)` never matched typer's)
UNSET = (None, "DEFAULT", "DEFAULT_MAP")


def cli_annotation(annotation):
    """The type typer parses a config field as (the config validates the value after)."""
    if annotation == SecretStr | None:
        return str | None
    if typing.get_origin(annotation) is tuple:
        return list[typing.get_args(annotation)[0]]
    return annotation


def shown(default):
    """A config default as its CLI option shows it."""
    if isinstance(default, tuple):
        return list(default)
    if isinstance(default, enum.Enum):
        return default.value
    return default


def model_options(model: type[BaseModel]) -> list[inspect.Parameter]:
    """One option per field of a pydantic model, with its default and description."""
    params = []
    for name, field in model.model_fields.items():
        secret = name in ENV_VARS
        option = typer.Option(None if secret else shown(field.default), help=field.description,
                              envvar=ENV_VARS.get(name), show_default=not secret)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=cli_annotation(field.annotation)))
    return params


def dataclass_options(config: type) -> list[inspect.Parameter]:
    """One option per field of a dataclass, with its default and `metadata["help"]`."""
    hints = typing.get_type_hints(config)
    params = []
    for field in dataclasses.fields(config):
        default = (field.default_factory() if field.default is dataclasses.MISSING
                   else field.default)
        option = typer.Option(shown(default), help=field.metadata.get("help"),
                              show_default=default is not None)
        params.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY,
                                        default=option,
                                        annotation=cli_annotation(hints[field.name])))
    return params


def given_fields(ctx: typer.Context, config: type, values: dict) -> dict:
    """The dataclass fields the command line set (not left at their default), as the config
    takes them (lists back to tuples)."""
    hints = typing.get_type_hints(config)
    given = {}
    for name, value in values.items():
        source = ctx.get_parameter_source(name)
        if (source if source is None else source.name) in UNSET:
            continue
        given[name] = tuple(value) if typing.get_origin(hints[name]) is tuple else value
    return given


def with_signature(function, params: list[inspect.Parameter]):
    """`function` as typer sees a command with these parameters."""
    function.__signature__ = inspect.Signature(params, return_annotation=None)
    function.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    return function
