"""Package namespaces whose public names load on first use (PEP 562)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for the package ``package`` whose public names each live in
    one of its modules: ``homes`` maps a name to that module, relative (``".checkpoint"``).

    Importing one module of a package runs the package's ``__init__`` first; with eager
    re-exports there, ``import k3ckpt.format.header`` would import every module of the package
    (and ``k3ckpt verify`` would pay for the topology math it never uses). With these, a name
    is imported from its module when it is first read, then kept in the package's namespace.
    """

    def getattr_(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home, package), name)
        setattr(sys.modules[package], name, value)  # later reads are plain attribute reads
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(homes))

    return getattr_, dir_
