"""``python -m k3ckpt``."""

from .cli import main

main(prog_name="k3ckpt")
