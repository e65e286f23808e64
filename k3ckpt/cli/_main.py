"""The root command group: ``--version``, ``--debug``, and every command group attached."""

from __future__ import annotations

import importlib
from typing import Any

import click

from .. import __version__
from ._options import ARGV_META, CONTEXT, exit_broken_pipe, fail_usage

# click >= 8.2 raises this (a UsageError) to show a group's help when it is given no command
_NO_ARGS_IS_HELP: tuple[type[click.UsageError], ...] = tuple(
    c for c in (getattr(click.exceptions, "NoArgsIsHelpError", None),) if c is not None)


class RootGroup(click.Group):
    """The root group: usage errors of any command (bad option values, missing arguments,
    refusals a command raises as ``click.UsageError``) are reported like every other error
    (:func:`~k3ckpt.cli._options.fail_usage`), not as click's usage block."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = debug_first(args)
        ctx.meta[ARGV_META] = list(args)  # for --json in a command whose own parsing fails
        try:
            return super().parse_args(ctx, args)
        except BrokenPipeError:  # --help or --version into a reader that went away
            exit_broken_pipe()

    # Commands load lazily, as click's docs show ("Lazily Loading Subcommands"): ``k3ckpt verify``
    # imports the verify command's module and the library it uses, not the topology math, the
    # hub clients or numpy; ``k3ckpt --version`` imports none; ``--help`` imports them all.
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMAND_MODULES.keys() | self.commands.keys())

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMAND_MODULES:
            self._load(COMMAND_MODULES[cmd_name])
        return self.commands.get(cmd_name)

    def _load(self, home: str) -> None:
        module = importlib.import_module(f"{__package__}.{home}")
        defined = {command.name or "": command for command in module.COMMANDS}
        listed = {n for n, m in COMMAND_MODULES.items() if m == home}
        if defined.keys() != listed:  # a command added to a module but not to the table, or gone
            raise LookupError(f"{module.__name__} defines {sorted(defined)}; COMMAND_MODULES lists {sorted(listed)}")
        for command in defined.values():
            self.add_command(command)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except _NO_ARGS_IS_HELP:
            raise  # a group given no command: click shows its help, which is what was asked
        except click.UsageError as e:
            fail_usage(e, ctx)
        except BrokenPipeError:  # a command's --help, or output outside its error handler
            exit_broken_pipe()


def debug_first(args: list[str]) -> list[str]:
    """``args`` with every ``--debug`` (before a ``--``) moved to the front, where the root
    group reads it: ``k3ckpt inspect X --debug`` means what ``k3ckpt --debug inspect X`` does."""
    end = args.index("--") if "--" in args else len(args)
    head = [a for a in args[:end] if a != "--debug"]
    if len(head) == end:
        return args
    return ["--debug", *head, *args[end:]]


@click.group(cls=RootGroup, context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="k3ckpt")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors (also after the command).")
def main(debug: bool) -> None:
    """k3ckpt: fetch, verify, inspect, reshard and preflight Kimi K3-class MoE checkpoints.

    \b
    Examples:
      k3ckpt synth work/k3-small --preset k3-small
      k3ckpt inspect work/k3-small
      k3ckpt inspect work/k3-small --layers --json
    """


#: command -> the module of this package that defines it (in its ``COMMANDS``).
COMMAND_MODULES: dict[str, str] = {
    "inspect": "_inspect", "synth": "_inspect",
    "manifest": "_manifest", "verify": "_manifest",
    "fetch": "_fetch",
    "plan": "_deploy", "reshard": "_deploy", "unshard": "_deploy", "preflight": "_deploy", "serve-command": "_deploy",
    "mx": "_mx",
}
