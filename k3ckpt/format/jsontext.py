"""JSON text written from columns, byte for byte what ``json.dumps`` writes (ASCII), for the
files k3ckpt writes with an entry per tensor: safetensors headers, node markers and rank
manifests. A K3 inventory has ~497k tensors; building one dict per entry for the encoder cost
~2-9 us each, these C-level ``map``/``join`` passes ~1 us."""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Sequence
from itertools import chain, repeat

#: json's own string escaper (its C version when available): what ``json.dumps`` (ASCII) uses for a str.
json_str = json.encoder.encode_basestring_ascii


class JsonStr(dict[str, str]):
    """str -> ``json.dumps(str)``, once per distinct string (dtypes, file names)."""

    def __missing__(self, key: str) -> str:
        v = self[key] = json_str(key)
        return v


class ShapeJson(dict[tuple[int, ...], str]):
    """shape -> ``json.dumps(list(shape))`` (``compact``: with ``separators=(",", ":")``),
    once per distinct shape (through ``map``, hits stay in C)."""

    def __init__(self, *, compact: bool = False) -> None:
        super().__init__()
        self._separators = (",", ":") if compact else None

    def __missing__(self, key: tuple[int, ...]) -> str:
        v = self[key] = json.dumps(list(key), separators=self._separators)
        return v


def plain(text: str) -> bool:
    """Is ``json.dumps(text)`` just ``text`` in quotes? (printable ASCII, no quote or backslash;
    of a join of strings: of each of them)"""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def json_strings(values: list[str]) -> list[str]:
    """``[json.dumps(v) for v in values]``: when every value is :func:`plain` (tensor names,
    hex digests), each is itself in quotes."""
    if plain("".join(values)):
        return list(map(operator.add, map(operator.add, repeat('"'), values), repeat('"')))
    return list(map(json_str, values))


def json_records(keys: Sequence[str], fields: Sequence[tuple[str, Iterable[str]]]) -> str:
    """``json.dumps({k: {name: value, ...} for k in keys})``'s text (default separators,
    ASCII), from columns: ``fields`` is ``(name, values)`` pairs, each value already its JSON
    text, one per key."""
    if not keys:
        return "{}"
    # one flat run of pieces (", ", key, ': {"file": ', value, ', "dtype": ', ..., "}" per key)
    # joined once: no formatting or concatenation per key
    columns: list[Iterable[str]] = [repeat(", "), json_strings(list(keys))]
    for k, (name, values) in enumerate(fields):
        columns += [repeat((": {" if k == 0 else ", ") + json.dumps(name) + ": "), values]
    columns.append(repeat("}"))
    return "{" + "".join(chain.from_iterable(zip(*columns)))[2:] + "}"
