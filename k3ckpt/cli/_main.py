"""The root command group: ``--version``, ``--debug``, and every command group attached."""

from __future__ import annotations

import click

from .. import __version__
from . import _deploy, _fetch, _inspect, _manifest, _mx
from ._options import CONTEXT


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, "--version", prog_name="k3ckpt")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def main(debug: bool) -> None:
    """k3ckpt: fetch, verify, inspect, reshard and preflight Kimi K3-class MoE checkpoints.

    \b
    Examples:
      k3ckpt synth work/k3-small --preset k3-small
      k3ckpt inspect work/k3-small
      k3ckpt inspect work/k3-small --layers --json
    """


for _module in (_inspect, _manifest, _fetch, _deploy, _mx):
    for _command in _module.COMMANDS:
        main.add_command(_command)
