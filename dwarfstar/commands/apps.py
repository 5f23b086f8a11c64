"""The `dwarfstar` command groups, and how a command's flag groups become its options.

The command modules register on these apps (`@app.command()`, `@bench_app.command("kv")`);
dwarfstar/cli.py imports them and runs `app`. A parameter typed with a group of
dwarfstar/commands/flags.py stands for the group's options: the command line shows each of them, and
the command receives the group's values as one object. A command with groups also takes
`--config FILE`, TOML whose keys are its flag names (`ctx = 65536`, `dist-role = "worker"`); the
command line wins over the file, the file over the defaults. Relative paths in it are taken from the
working directory, as on the command line.

Also here: `-h`, ds4's spellings kept readable but not shown (`--nothink`, `-sys`), flags shown
without a `<bool>` type, and `given`, which tells a flag the user set from one left at its default.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup
from typer.models import OptionInfo

from dwarfstar.errors import DwarfStarError

TOOLS = "Tools"  # the help panel of everything but run, serve, agent, pull and bench
# ds4's spellings, still read but not shown: the old name -> the name it stands for
DS4_SPELLINGS = {"--nothink": "--no-think", "--no-nothink": "--think", "-sys": "-s"}


def is_option(param: Any) -> bool:
    return param.param_type_name == "option"


def _plain_help(option: Any) -> Any:
    if option is not None:
        option.metavar = ""  # `-h, --help` without a `<bool>`
    return option


class Command(TyperCommand):
    """A command that also reads ds4's spellings of its options (DS4_SPELLINGS)."""

    def get_help_option(self, ctx: typer.Context) -> Any:
        return _plain_help(super().get_help_option(ctx))

    def make_parser(self, ctx: typer.Context) -> Any:
        parser = super().make_parser(ctx)
        for param in self.get_params(ctx):
            if not is_option(param):
                continue
            for old, new in DS4_SPELLINGS.items():
                if new in param.secondary_opts:  # the off side of a --x/--no-x flag
                    parser.add_option(obj=param, opts=[old], dest=param.name, action="store_const", const=False)
                elif new in param.opts and param.is_flag:
                    parser.add_option(obj=param, opts=[old], dest=param.name, action="store_const", const=True)
                elif new in param.opts:
                    parser.add_option(obj=param, opts=[old], dest=param.name, action="store", nargs=param.nargs)
        return parser


class Group(TyperGroup):
    def get_help_option(self, ctx: typer.Context) -> Any:
        return _plain_help(super().get_help_option(ctx))


class CommandApp(typer.Typer):
    """A Typer app whose commands may take flag groups (see `with_flags`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cls=Group, **kwargs)

    def command(self, *args: Any, **kwargs: Any) -> Callable[[Callable], Callable]:
        kwargs.setdefault("cls", Command)
        register = super().command(*args, **kwargs)
        return lambda func: register(with_flags(func))

    def callback(self, *args: Any, **kwargs: Any) -> Callable[[Callable], Callable]:
        register = super().callback(*args, **kwargs)
        return lambda func: register(with_flags(func))


app = CommandApp(
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
bench_app = CommandApp(
    no_args_is_help=True, help="Measure the engine: prefill and decode speed, KV cache I/O, kernels."
)
steer_app = CommandApp(no_args_is_help=True, help="Directional steering: build a direction, measure its effect.")
test_app = CommandApp(no_args_is_help=True, help="ds4's quality gates: prove a model still works after a change.")
app.add_typer(bench_app, name="bench")
app.add_typer(steer_app, name="steer", rich_help_panel=TOOLS)
app.add_typer(test_app, name="test", rich_help_panel=TOOLS)


_given: ContextVar[frozenset[str]] = ContextVar("given", default=frozenset())


def given(name: str) -> bool:
    """Whether the user set the flag `name` of the running command (on the command line, in the
    environment or in --config), as opposed to leaving it at its default."""
    return name in _given.get()


def is_group(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def with_flags(func: Callable) -> Callable:
    """`func` as Typer should see it: each flag-group parameter replaced by the group's options (and
    `--config` added), bool flags shown without a type. The command still receives the groups."""
    if getattr(func, "expanded_flags", False):  # registered under two names
        return func
    hints = typing.get_type_hints(func, include_extras=True)
    params, groups = [], {}
    for param in inspect.signature(func).parameters.values():
        hint = hints.get(param.name, param.annotation)
        if is_group(hint):
            groups[param.name] = hint
            params += _options(hint)
        else:
            params.append(_keyword(param.name, hint, param.default))
    if groups:
        params.append(_keyword("config", ConfigOption, None))
    context_name = next((p.name for p in params if p.annotation is typer.Context), None)
    if context_name is None:  # Typer passes the context to a parameter of this type; it is not an option
        context_name = "typer_context"
        params.append(_keyword(context_name, typer.Context, None))
    own_context = context_name in inspect.signature(func).parameters
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise TypeError(f"{func.__qualname__}: two options named {sorted({n for n in names if names.count(n) > 1})}")

    @functools.wraps(func)
    def command(**values: Any) -> Any:
        context = values[context_name] if own_context else values.pop(context_name)
        values.pop("config", None)
        for name, group in groups.items():
            values[name] = _built(group, values)
        sources = {name: context.get_parameter_source(name) for name in context.params}
        set_by_user = frozenset(name for name, source in sources.items() if source and source.name != "DEFAULT")
        token = _given.set(set_by_user)
        try:
            return func(**values)
        finally:
            _given.reset(token)

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.expanded_flags = True
    return command


@functools.cache
def _hints(group: type) -> dict[str, Any]:
    return typing.get_type_hints(group, include_extras=True)


def _options(group: type) -> list[inspect.Parameter]:
    """A group's options, those of the groups it holds included."""
    hints = _hints(group)
    options = []
    for field in dataclasses.fields(group):
        hint = hints[field.name]
        options += _options(hint) if is_group(hint) else [_keyword(field.name, hint, field.default)]
    return options


def _built(group: type, values: dict[str, Any]) -> Any:
    """The group from its options' values (taken out of `values`)."""
    hints = _hints(group)
    fields = dataclasses.fields(group)
    return group(
        **{f.name: _built(hints[f.name], values) if is_group(hints[f.name]) else values.pop(f.name) for f in fields}
    )


def _keyword(name: str, hint: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=_shown(hint))


def _shown(hint: Any) -> Any:
    """A bool option's hint with an empty metavar, so the help shows the flag without `<bool>`."""
    if typing.get_origin(hint) is not Annotated:
        return hint
    base, *extras = typing.get_args(hint)
    if base is not bool:
        return hint
    shown = []
    for extra in extras:
        if isinstance(extra, OptionInfo) and extra.metavar is None:
            extra = copy.copy(extra)
            extra.metavar = ""
        shown.append(extra)
    return Annotated[(base, *shown)]


# -- --config FILE -------------------------------------------------------------------------------------------
def read_config(ctx: typer.Context, value: Path | None) -> Path | None:
    """Set the command's defaults from a TOML file; unknown keys and wrong types are errors."""
    if value is None:
        return None
    import tomllib

    try:
        data = tomllib.loads(value.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DwarfStarError(f"cannot read {value}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise DwarfStarError(f"{value} is not TOML: {exc}") from None
    options = {p.name: p for p in ctx.command.params if is_option(p) and p.name != "config"}
    defaults = {}
    for key, item in data.items():
        param = options.get(key.replace("-", "_"))
        if param is None:
            raise DwarfStarError(f"{value}: unknown key {key!r}: `{ctx.command_path}` has no --{key.replace('_', '-')}")
        defaults[param.name] = _checked(value, key, param, item)
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        metavar="FILE",
        is_eager=True,
        callback=read_config,
        help="TOML file setting any of these flags by name (ctx = 65536); the command line wins.",
    ),
]


def _checked(path: Path, key: str, param: Any, item: Any) -> Any:
    """`item` if it is what the option takes: its type, a list of it for a repeatable option, its range."""
    kind = _python_type(param)
    if param.is_flag or kind is bool:
        what, fits = "true or false", lambda v: isinstance(v, bool)
    elif kind is int:
        what, fits = "an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)
    elif kind is float:
        what, fits = "a number", lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    else:
        what, fits = "a string", lambda v: isinstance(v, str)
    values = item if param.multiple and isinstance(item, list) else [item]
    if param.multiple:
        what = f"a list of {what.split(' ', 1)[1]}s" if " " in what else what
    if (param.multiple and not isinstance(item, list)) or not all(fits(v) for v in values):
        raise DwarfStarError(f"{path}: {key} must be {what}, got {item!r}")
    low, high = (getattr(param, b) if hasattr(param, b) else getattr(param.type, b, None) for b in ("min", "max"))
    if any((low is not None and v < low) or (high is not None and v > high) for v in values):
        bounds = f"at least {low}" if high is None else f"at most {high}" if low is None else f"{low}..{high}"
        raise DwarfStarError(f"{path}: {key} must be {bounds}, got {item!r}")
    return item


def _python_type(param: Any) -> type:
    """The Python type an option converts to: Typer 0.29's own descriptor, or click's type name."""
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is not None:
        return descriptor.annotation
    names = {"boolean": bool, "integer": int, "integer range": int, "float": float, "float range": float}
    return names.get(param.type.name, str)
