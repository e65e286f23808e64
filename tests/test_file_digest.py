"""A node file's digest from its segments (docs/layout.md, "A node file's digest"): equal to the
definition computed from the bytes alone, independent of the order tensors are given in, refused
when the tensors leave bytes uncovered, and changed by a change of any single byte of the file."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from helpers import segments_digest
from k3ckpt.errors import SafetensorsHeaderError
from k3ckpt.format.filedigest import SEGMENTS_KEY, recorded_digest, segments_sha256
from k3ckpt.integrity.hashing import HashError
from k3ckpt.integrity.segments import hash_segments

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                    derandomize=True)

#: A few tensors of a few bytes each, zero-byte ones included.
tensor_sizes = st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=6)


def _write(path: Path, sizes: list[int], seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    save_file({f"t{k}.weight": rng.integers(0, 256, n, dtype=np.uint8) for k, n in enumerate(sizes)}, str(path))
    return path.read_bytes()


@PROPERTY
@given(sizes=tensor_sizes, seed=st.integers(0, 2**16), where=st.floats(0, 1, exclude_max=True))
def test_the_digest_is_the_definition_and_any_changed_byte_changes_it(tmp_path: Path, sizes: list[int], seed: int,
                                                                      where: float) -> None:
    path = tmp_path / "f.safetensors"
    raw = _write(path, sizes, seed)
    got = hash_segments(path)
    assert got.segments_sha256 == segments_digest(raw) and got.size == len(raw)
    assert set(got.tensors) == {f"t{k}.weight" for k in range(len(sizes))}
    pos = int(where * len(raw))
    path.write_bytes(raw[:pos] + bytes([raw[pos] ^ 0x01]) + raw[pos + 1:])
    try:
        changed = hash_segments(path).segments_sha256
    except (SafetensorsHeaderError, HashError):
        return  # a byte of the header's length or JSON broke it: refused, never "equal"
    assert changed != got.segments_sha256, pos


def test_tensor_order_does_not_matter_and_uncovered_bytes_are_refused() -> None:
    prefix = b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "
    a, b = hashlib.sha256(b"a").hexdigest(), hashlib.sha256(b"bb").hexdigest()
    base = len(prefix)
    spans = [(base, base + 1, a), (base + 1, base + 3, b), (base + 3, base + 3, hashlib.sha256().hexdigest())]
    assert segments_sha256(prefix, spans) == segments_sha256(prefix, spans[::-1])
    with pytest.raises(ValueError, match="do not start where the previous segment ends"):
        segments_sha256(prefix, [(base, base + 1, a), (base + 2, base + 3, b)])  # a gap of one byte
    with pytest.raises(ValueError, match="do not start where the previous segment ends"):
        segments_sha256(prefix, [(base, base + 2, a), (base + 1, base + 3, b)])  # an overlap
    with pytest.raises(ValueError):
        segments_sha256(prefix, [(base + 1, base + 2, a)])  # the byte after the header uncovered


def test_recorded_digest_reads_both_marker_versions() -> None:
    assert recorded_digest({"size": 3, SEGMENTS_KEY: "ab"}) == (SEGMENTS_KEY, "ab")
    assert recorded_digest({"size": 3, "sha256": "cd"}) == ("sha256", "cd")
    assert recorded_digest({"size": 3}) is None and recorded_digest("x") is None and recorded_digest({"sha256": ""}) is None
