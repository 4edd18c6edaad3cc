"""A command's flags, made from its options object: each field of an ``Options`` model becomes an option with the
field's description as its help, its default, and the spelling, panel and environment variable its
``json_schema_extra`` gives. A new option of a command is then one field of its model; the CLI follows.

``command`` registers a typer command whose parameters are the given arguments, the model's fields and any
CLI-only options (output format, --html), and which calls ``run(options, cli)``: ``options`` the validated
model, ``cli`` the CLI-only values and the arguments.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer
from rich.markup import escape
from typer.core import TyperCommand

from dtypelab.cli._common import guarded
from dtypelab.core.errors import DtypelabError
from dtypelab.core.options import Options

CLI_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "floats": list[float]}


def _cli_type(annotation: Any, hint: str | None) -> Any:
    """The one plain type a flag takes: ``cli_type`` when the field says, else its annotation without None."""
    if hint:
        return CLI_TYPES[hint]
    args = [a for a in typing.get_args(annotation) if a is not type(None)] if isinstance(
        annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union else [annotation]
    if typing.get_origin(args[0]) is typing.Literal:
        return str
    return args[0] if args and isinstance(args[0], type) else str


def option_params(model: type[Options]) -> list[inspect.Parameter]:
    """One keyword parameter per field that has a flag, annotated for typer."""
    params = []
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if extra.get("cli") is False:
            continue
        kind = _cli_type(field.annotation, extra.get("cli_type"))
        flags = [model.flag(name), *extra.get("aliases", ()), *([extra["short"]] if extra.get("short") else [])]
        if kind is bool and field.default is True:  # on by default: the flag that turns it off
            flags[0] = f"{flags[0]}/--no-{flags[0].removeprefix('--')}"
        required = field.is_required()  # export's --policy and --output: no default to show, click says it is missing
        default = inspect.Parameter.empty if required else field.default
        if kind is not bool:
            kind = kind | None if default is None else kind  # type: ignore[assignment]
        # escaped: rich would read "[default: the task's]" as a markup tag and drop it from the help
        info = typer.Option(*flags, help=escape(field.description or ""), envvar=extra.get("envvar"),
                            rich_help_panel=extra.get("panel"),
                            show_default=not required and default not in (None, (), False))
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=Annotated[kind, info]))
    return params


class _RestCommand(TyperCommand):
    """A command that passes what follows ``--`` on (a script's own arguments): click puts those and any unknown
    option before ``--`` in one list, so the raw arguments are kept to tell a misspelt flag from a script's."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta["dtypelab_raw_args"] = list(args)
        return super().parse_args(ctx, args)


def _rest(ctx: Any) -> tuple[str, ...]:
    """The arguments after ``--``; an unknown option before it is a one-line error, not a script argument."""
    rest = tuple(ctx.args)
    raw = ctx.meta.get("dtypelab_raw_args", [])
    after = len(raw) - raw.index("--") - 1 if "--" in raw else 0
    stray = rest[:len(rest) - after]
    if stray:
        hint = " (a training script's own arguments go after --)"
        raise DtypelabError(f"no such option: {stray[0]}" + hint if stray[0].startswith("-")
                            else f"unexpected argument: {stray[0]}" + hint)
    return rest


def command(app: typer.Typer, name: str, model: type[Options] | None, run: Callable[[Any, dict[str, Any]], None], *,
            help: str, arguments: list[inspect.Parameter] = (), extra: list[inspect.Parameter] = (),
            takes_rest: bool = False) -> None:
    """Register ``name``: its parameters are ``arguments``, the model's fields and ``extra``; it calls ``run`` with the
    validated options (built here: a bad value is a one-line error) and the other values by name."""
    fields = set(model.model_fields) if model is not None else set()

    def cmd(**given: Any) -> None:
        ctx = given.pop("ctx", None)
        cli = {k: v for k, v in given.items() if k not in fields}
        with guarded():
            if takes_rest:
                cli["rest"] = _rest(ctx) if ctx is not None else ()
            options = model.build(**{k: v for k, v in given.items() if k in fields}) if model is not None else None
        run(options, cli)

    params = list(arguments) + (option_params(model) if model is not None else []) + list(extra)
    if takes_rest:
        params.insert(0, inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context))
    cmd.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    cmd.__annotations__ = {p.name: p.annotation for p in params}
    cmd.__doc__ = help
    cmd.__name__ = name.replace("-", "_")
    settings = {"allow_extra_args": True, "ignore_unknown_options": True} if takes_rest else {}
    app.command(name, context_settings=settings or None, cls=_RestCommand if takes_rest else None)(cmd)


def argument(name: str, kind: Any, help: str, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    """A positional argument of a generated command."""
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default,
                             annotation=Annotated[kind, typer.Argument(help=help)])


def flag(name: str, kind: Any, default: Any, help: str, *decls: str) -> inspect.Parameter:
    """A CLI-only option of a generated command (how to show the result: --format, --html, --strict)."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, typer.Option(*decls, help=help)])
