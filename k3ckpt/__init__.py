"""k3ckpt: checkpoint tooling and integrity pipeline for self-hosting Kimi K3 and models like it."""

__version__ = "0.1.0"
