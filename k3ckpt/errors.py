"""Typed errors. Every user-facing failure is one of these, so the CLI can print one line and
pick the exit code without a traceback (cf. ``huggingface_hub.errors``)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_CANNOT_RUN = 2


class K3ckptError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with when this reaches it."""

    exit_code: int = EXIT_CANNOT_RUN


class CheckpointNotFoundError(K3ckptError):
    """The path is missing, or holds no index and no single ``model.safetensors``."""


class SafetensorsHeaderError(K3ckptError):
    """A shard's header is malformed. The message names the file and, where known, the tensor."""

    def __init__(self, path: str, problem: str, tensor: str | None = None) -> None:
        self.path = path
        self.problem = problem
        self.tensor = tensor
        where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
        super().__init__(where + problem)

    def __reduce__(self) -> tuple:  # so it crosses process boundaries intact
        return (type(self), (self.path, self.problem, self.tensor))


class IndexError_(K3ckptError):
    """``model.safetensors.index.json`` is unreadable or names shards that are not there."""


class ConfigError(K3ckptError):
    """``config.json`` is unreadable or lacks what is needed."""


class SynthError(K3ckptError):
    """A synthetic checkpoint cannot be made with the requested options."""
