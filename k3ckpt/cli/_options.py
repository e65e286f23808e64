"""What several commands share: click settings, the error handlers (library errors in a command,
usage errors; both print one line, and the JSON error object under ``--json``), and option
declarations (``--json``, ``--jobs``, sizes, the topology selection) written once, so that the
same option means and checks the same thing everywhere."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import click

from ..errors import EXIT_CANNOT_RUN, K3ckptError
from ..utils import parse_rate, parse_size
from ._output import emit_json

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


#: ``ctx.meta`` key: whether the running command was given ``--json`` (set by :func:`handle_errors`
#: before the command runs; :func:`fail_usage` reads it for usage errors the command raises)
JSON_META = "k3ckpt.json"
#: ``ctx.meta`` key: the root's argument list, for usage errors raised while options are parsed
ARGV_META = "k3ckpt.argv"
#: the JSON error object's ``kind`` for errors that are not :class:`K3ckptError`
USAGE_KIND = "usage"
OS_KIND = "os"


#: The status a shell reports for a process SIGPIPE killed (``cat big | head``: 128 + 13).
EXIT_BROKEN_PIPE = 141


def exit_broken_pipe() -> NoReturn:
    """The reader of stdout went away (``k3ckpt inspect ... | head``): end as ``cat`` does, with
    no message and no JSON error object (the reader asked for no more) and the status of a
    SIGPIPE death, which no k3ckpt result uses. Stdout is pointed at /dev/null first, so the
    interpreter's last flush of what is still buffered does not fail again on its way out.
    (Not by restoring SIGPIPE's default action: a fetch whose progress reader went away would
    die between two writes instead of leaving through its handlers.)"""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except OSError:
        pass  # no stdout to quiet: nothing will be flushed into it
    sys.exit(EXIT_BROKEN_PIPE)


def fail(message: str, *, kind: str, path: str | None, exit_code: int, as_json: bool) -> NoReturn:
    """Exit ``exit_code`` after one ``k3ckpt: error: MESSAGE`` line on stderr and, with ``--json``,
    the JSON error object ``{"error": {"kind", "path", "message"}}`` on stdout (docs/errors.md)."""
    if as_json:
        try:
            emit_json({"error": {"kind": kind, "path": path, "message": message}})
        except OSError:  # stdout is gone (a closed pipe) or full: the line and the exit code still
            # tell; and the interpreter's last flush of stdout must not fail on it again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    click.echo(f"k3ckpt: error: {message}", err=True)
    sys.exit(exit_code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors into one line on stderr (and, with ``--json``, a JSON error object on
    stdout) and the right exit code; ``--debug`` prints the traceback first and changes nothing
    else (the exit code is the one a script branches on, with or without it)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        debug = bool(ctx.find_root().params.get("debug"))
        as_json = bool(kwargs.get("as_json"))
        ctx.meta[JSON_META] = as_json
        try:
            return fn(*args, **kwargs)
        except K3ckptError as e:
            if debug:
                show_traceback()
            fail(str(e), kind=e.kind, path=e.path, exit_code=e.exit_code, as_json=as_json)
        except KeyboardInterrupt:
            click.echo("k3ckpt: interrupted", err=True)
            sys.exit(130)
        except OSError as e:
            if isinstance(e, BrokenPipeError) and e.filename is None:  # (a named file is the command's own)
                exit_broken_pipe()
            if debug:
                show_traceback()
            where = f"{e.filename}: " if e.filename else ""
            fail(f"{where}{e.strerror or e}", kind=OS_KIND, path=None if e.filename is None else os.fsdecode(e.filename),
                 exit_code=EXIT_CANNOT_RUN, as_json=as_json)

    return wrapper


def show_traceback() -> None:
    """The traceback of the error being handled, on stderr (``--debug``)."""
    click.echo(traceback.format_exc().rstrip(), err=True)


def fail_usage(e: click.UsageError, ctx: click.Context) -> NoReturn:
    """A usage error (bad or missing option, raised while parsing or by a command) as every other
    error: one line naming the help to read, the JSON error object (kind ``usage``) when the
    command was given ``--json``, exit ``e.exit_code`` (2). ``ctx`` is the root's context."""
    argv: list[str] = ctx.meta.get(ARGV_META, [])
    argv = argv[:argv.index("--")] if "--" in argv else argv
    command, path = _command_of(ctx, argv)
    if JSON_META in ctx.meta:  # the command's callback ran: it knew
        as_json = bool(ctx.meta[JSON_META])
    else:  # parsing failed first (perhaps before --json was processed): the arguments tell
        as_json = "--json" in argv and any(isinstance(p, JsonOption) for p in command.params)
    fail(f"{e.format_message()} (see '{path} --help')", kind=USAGE_KIND, path=None, exit_code=e.exit_code,
         as_json=as_json)


def _command_of(ctx: click.Context, argv: list[str]) -> tuple[click.Command, str]:
    """The command ``argv`` names below the root (a usage error does not always carry its
    context: click's parser raises some without) and its command path, ``k3ckpt manifest build``."""
    command, path = ctx.command, ctx.command_path
    for token in argv:
        if not isinstance(command, click.Group):
            break
        if token.startswith("-"):  # a group's own option (--debug)
            continue
        sub = command.get_command(ctx, token)
        if sub is None:
            break
        command, path = sub, f"{path} {token}"
    return command, path


class ByteSize(click.ParamType):
    """Sizes like ``64MiB``, ``5GiB``, ``20GB`` or plain bytes (read by :func:`k3ckpt.utils.parse_size`)."""

    name = "size"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        try:
            n = parse_size(str(value))
        except ValueError:
            self.fail(f"{value!r} is not a size (examples: 64MiB, 5GiB, 20GB, 1048576)", param, ctx)
        if n <= 0:
            self.fail(f"{value!r} must be positive", param, ctx)
        return n


class ByteRate(click.ParamType):
    """Rates like ``25Gbit/s`` (bits) or ``7GB/s`` (bytes), in bytes per second (read by
    :func:`k3ckpt.utils.parse_rate`, which refuses what could be either)."""

    name = "rate"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        if isinstance(value, float):
            return value
        try:
            return parse_rate(str(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


class AliasedOption(click.Option):
    """An option with other accepted names (``aliases``, also among its declarations) that its
    help line and error hints leave out: one name per concept in ``--help``, while the hub
    clients' spellings and the names of earlier releases keep working."""

    def __init__(self, *args: Any, aliases: tuple[str, ...] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aliases = aliases

    def _shown(self) -> list[str]:
        return [o for o in self.opts if o not in self.aliases]

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        opts, self.opts = self.opts, self._shown()
        try:
            return super().get_help_record(ctx)
        finally:
            self.opts = opts

    def get_error_hint(self, ctx: click.Context | None) -> str:
        return " / ".join(f"'{o}'" for o in self._shown())


class AliasedChoice(click.Choice):
    """A ``click.Choice`` with other accepted spellings (``aliases``) that ``--help``, the error
    hint and shell completion leave out, as :class:`AliasedOption` does for option names: an
    alias is passed on as given (the library reads it: ``hf-node``, ``floor``)."""

    def __init__(self, choices: list[str], aliases: tuple[str, ...]) -> None:
        super().__init__(choices)
        self.aliases = aliases

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and value in self.aliases:
            return value
        return super().convert(value, param, ctx)


def aliased_option(*decls: str, aliases: tuple[str, ...] = (), **kwargs: Any) -> Decorator:
    """``click.option(*decls, *aliases)``: the aliases are accepted and not shown."""
    return click.option(*decls[:1], *aliases, *decls[1:], cls=AliasedOption, aliases=aliases, **kwargs)


class JsonOption(click.Option):
    """The class of every ``--json`` option: a test checks that no command declares its own."""


def json_option(help: str = "Machine-readable output.") -> Decorator:
    """``--json`` (parameter ``as_json``): print the result as JSON instead of text."""
    return click.option("--json", "as_json", is_flag=True, help=help, cls=JsonOption)


#: Parallelism is ``--jobs N`` in every command; ``--max-workers`` (``hf download``'s and
#: ``modelscope download``'s name) and ``--workers`` (``fetch``'s name in 0.1, kept for a
#: release) are the same option.
JOBS_ALIASES = ("--max-workers", "--workers")


def jobs_option(help: str, default: int | None = None, *, show_max_workers: bool = False) -> Decorator:
    """``--jobs N`` (at least 1; also ``--max-workers``/``--workers``: :data:`JOBS_ALIASES`);
    ``help`` says what runs in parallel and the default. ``show_max_workers``: the help line
    names ``--max-workers`` too (fetch, where ``hf download`` users look for it)."""
    extra: dict[str, Any] = {"show_default": True} if default is not None else {}
    hidden = tuple(a for a in JOBS_ALIASES if not (show_max_workers and a == "--max-workers"))
    return click.option("--jobs", *JOBS_ALIASES, "jobs", cls=AliasedOption, aliases=hidden, type=click.IntRange(1),
                        default=default, help=help, **extra)


def size_option(*decls: str, default: str, help: str, aliases: tuple[str, ...] = ()) -> Decorator:
    """A size option (:class:`ByteSize`: ``64MiB``, ``5GiB``, ``20GB`` or bytes), default shown."""
    return aliased_option(*decls, aliases=aliases, type=ByteSize(), default=default, show_default=True, help=help)


def max_shard_size_option(help: str) -> Decorator:
    """``--max-shard-size`` (transformers' ``save_pretrained(max_shard_size=)``; parameter
    ``max_shard_size``): every command that writes files of bounded size takes it under this
    name, ``--max-file-size`` (reshard's and fetch's name in 0.1) being the same option."""
    return size_option("--max-shard-size", "max_shard_size", default="5GiB", help=help, aliases=("--max-file-size",))


#: The hubs ``--source`` / ``--against`` name, with the branch each resolves when no
#: ``--revision`` is given (huggingface_hub's ``DEFAULT_REVISION``; ModelScope's clients use
#: ``master``).
DEFAULT_REVISIONS = {"hf": "main", "modelscope": "master"}


def revision_option(what: str, *, decl: str = "--revision") -> Decorator:
    """``--revision R``: ``what`` says what the command does with it (after the default)."""
    defaults = ", ".join(f"{rev} for {hub}" for hub, rev in DEFAULT_REVISIONS.items())
    return click.option(decl, "revision", help=f"Branch, tag or commit [default: {defaults}]; {what}.")


def token_option() -> Decorator:
    """``--token T`` (as ``hf download --token``): the hub token, instead of what the client
    finds itself (HF_TOKEN or the saved login; MODELSCOPE_API_TOKEN or the saved cookie)."""
    return click.option("--token", metavar="TOKEN",
                        help="Hub access token [default: HF_TOKEN or `hf auth login`'s; MODELSCOPE_API_TOKEN "
                             "or `modelscope login`'s].")


def _topology_options() -> dict[str, tuple[str, click.ParamType]]:
    """parameter -> (option, type); the parameter names are RankSelection's fields. Ranks are
    selected by --ranks in every command (one rank or a list, 0-3,8); --rank is the same option.
    (Built when a command declares them: the topology math is imported by the commands that
    use it, not by every command.)"""
    from ..format.topology import PLACEMENTS

    return {
        "ep": ("--ep", click.IntRange(1)),
        "tp": ("--tp", click.IntRange(1)),
        "dp": ("--dp", click.IntRange(1)),
        "world_size": ("--world-size", click.IntRange(1)),
        "placement": ("--placement", click.Choice(list(PLACEMENTS))),
        "ranks": ("--ranks", click.STRING),
        "node": ("--node", click.IntRange(0)),
        "gpus_per_node": ("--gpus-per-node", click.IntRange(1)),
    }


# what plan and reshard show as defaults (the others leave "not given" apart from the default)
_SHOWN_DEFAULTS: dict[str, Any] = {"ep": 1, "tp": 1, "placement": "linear"}


def topology_options(*, show_defaults: bool = False, **helps: str) -> Decorator:
    """The topology selection options, in the order given, each with its help text: any of
    ``ep, tp, dp, world_size, placement, ranks, node, gpus_per_node``. The command receives
    one ``selection`` (:class:`RankSelection`) instead of them; ``--ranks`` is also ``--rank``.

    ``show_defaults``: ``--ep``/``--tp`` default to 1 and ``--placement`` to linear, shown in the
    help (plan, reshard); otherwise an option not given stays ``None`` ("not given").
    """
    from ..format.topology import RankSelection

    options = _topology_options()
    unknown = set(helps) - set(options)
    if unknown:
        raise TypeError(f"no topology option {sorted(unknown)}")

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in helps}
            return fn(*args, selection=RankSelection(**given), **kwargs)

        decorated: Callable[..., Any] = wrapper
        for name, help in reversed(helps.items()):  # click lists the last-applied option first
            flag, kind = options[name]
            default = _SHOWN_DEFAULTS.get(name) if show_defaults else None
            extra: dict[str, Any] = {"default": default, "show_default": True} if default is not None else {}
            aliases = ("--rank",) if name == "ranks" else ()
            decorated = aliased_option(flag, name, aliases=aliases, type=kind, help=help, **extra)(decorated)
        return decorated

    return decorate


def repo_id_of(positional: str | None, option: str | None) -> str:
    """The repo id: the REPO_ID argument, or the ``--repo`` option of k3ckpt 0.1 (both: they must
    agree); shared by ``fetch`` and ``manifest pull``."""
    if positional and option and positional != option:
        raise click.UsageError(f"REPO_ID {positional!r} and --repo {option!r} disagree: give one")
    repo = positional or option
    if not repo:
        raise click.UsageError("Missing argument 'REPO_ID'.")
    return repo
