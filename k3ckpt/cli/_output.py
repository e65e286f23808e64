"""How commands write: JSON documents on stdout, progress bars on an interactive stderr."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:  # at run time tqdm is imported only when a bar is shown (in plan)
    from tqdm import tqdm


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


class ByteProgress:
    """A tqdm bar for bytes (rate, ETA) on an interactive stderr; silent otherwise or with --json.

    Callable from several hashing threads at once."""

    def __init__(self, enabled: bool, desc: str) -> None:
        import threading

        self._bar: tqdm[Any] | None = None
        self._lock = threading.Lock()
        self._enabled = enabled and sys.stderr.isatty()
        self._desc = desc

    def plan(self, total: int) -> None:
        if self._enabled and total:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000,
                             desc=self._desc, file=sys.stderr, leave=False, dynamic_ncols=True)

    def __call__(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
