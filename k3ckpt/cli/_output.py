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
    """A tqdm bar for bytes (rate, ETA) - or, with ``unit``, for counted items such as shards -
    on an interactive stderr; silent otherwise or with --json.

    Callable from several hashing threads at once."""

    def __init__(self, enabled: bool, desc: str, unit: str = "B") -> None:
        import threading

        self._bar: tqdm[Any] | None = None
        self._lock = threading.Lock()
        self._enabled = enabled and sys.stderr.isatty()
        self._desc = desc
        self._unit = unit

    def plan(self, total: int) -> None:
        if self._enabled and total:
            from tqdm import tqdm

            scaled = self._unit == "B"  # 1.2GB/s; items are counted as they are
            self._bar = tqdm(total=total, unit=self._unit, unit_scale=scaled, unit_divisor=1000,
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
