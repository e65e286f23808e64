"""The small files of a checkpoint (config, index, manifests, keys), read with one-line errors
(they are written with :func:`k3ckpt.utils.write_atomic`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import K3ckptError


def load_json(path: Path, error: type[K3ckptError]) -> tuple[Any, bytes]:
    """``(parsed, raw bytes)`` of the JSON file at ``path``.

    Raises:
        error: the file is missing, unreadable, not UTF-8 or not JSON - naming the file.
    """
    try:
        raw = path.read_bytes()
        return json.loads(raw), raw
    except FileNotFoundError:
        raise error(f"{path}: not found", path=path) from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e})", path=path) from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read ({e})", path=path) from None
    except RecursionError:  # hostile nesting ([[[[...) overflows the parser's stack
        raise error(f"{path}: not valid JSON (nested too deeply)", path=path) from None
