"""The strict safetensors header reader: every kind of malformed header is refused with a
:class:`SafetensorsHeaderError` naming the file, the tensor and the precise problem; valid files
(ours and the reference implementation's) parse exactly; and no input, however hostile, makes
the reader raise anything else."""

from __future__ import annotations

import json
import math
import struct
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import k3ckpt.format.header as sh
from k3ckpt.errors import K3ckptError, SafetensorsHeaderError
from k3ckpt.format.header import (
    DTYPE_BITS,
    TensorSpec,
    build_header,
    parse_header_bytes,
    read_header,
    tensor_nbytes,
)


def entry(dtype: str, shape: list[Any], begin: Any, end: Any) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def refuse(path: Path, *substrings: str, tensor: str | None = None) -> SafetensorsHeaderError:
    """``read_header(path)`` must raise a SafetensorsHeaderError naming ``path``, ``tensor`` and
    every one of ``substrings``."""
    with pytest.raises(SafetensorsHeaderError) as ei:
        read_header(path)
    err = ei.value
    msg = str(err)
    assert isinstance(err, K3ckptError)
    assert str(path) in msg, msg
    assert err.path == str(path)
    for s in substrings:
        assert s in msg, f"{s!r} not in {msg!r}"
    if tensor is not None:
        assert err.tensor == tensor, msg
        assert f"tensor {tensor!r}" in msg, msg
    return err


# ---------------------------------------------------------------------------------------------
# The length prefix


def test_file_shorter_than_8_bytes(tmp_path: Path) -> None:
    for n in (0, 1, 7):
        p = tmp_path / f"short{n}.safetensors"
        p.write_bytes(b"\x01" * n)
        refuse(p, f"file is {n} bytes", "too short")


def test_header_length_over_the_limit(tmp_path: Path, write_raw, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K3CKPT_MAX_HEADER_BYTES", "64")
    hdr = {"__metadata__": {"pad": "x" * 80}}
    p = write_raw(tmp_path / "big.safetensors", hdr)
    n = len(json.dumps(hdr).encode())
    refuse(p, f"header length {n}", "exceeds the 64-byte limit")
    # Exactly at the limit is fine.
    monkeypatch.setenv("K3CKPT_MAX_HEADER_BYTES", str(n))
    assert read_header(p).metadata == {"pad": "x" * 80}


def test_header_length_2_pow_63_does_not_allocate(tmp_path: Path, write_raw, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write_raw(tmp_path / "huge.safetensors", b"{}", length=2**63)
    refuse(p, f"header length {2**63}", "exceeds the", "-byte limit")
    # Even with the limit lifted, the file size is checked before anything is read or allocated.
    monkeypatch.setenv("K3CKPT_MAX_HEADER_BYTES", str(2**64))
    tracemalloc.start()
    try:
        refuse(p, f"header length {2**63}", "runs past the end", "truncated")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_header_length_past_end_of_file(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "trunc.safetensors", b'{"a":1}', length=1000)
    size = p.stat().st_size
    refuse(p, "header length 1000", f"runs past the end of the {size}-byte file", "truncated")


# ---------------------------------------------------------------------------------------------
# The JSON text

U8_1 = entry("U8", [1], 0, 1)


def test_header_not_utf8(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "latin1.safetensors", b'{"caf\xe9": 1}')
    refuse(p, "not valid UTF-8", "byte 5")


@pytest.mark.parametrize("raw", [b" {}", b"[]", b'"{}"', b"1", b"\xef\xbb\xbf{}", b""])
def test_header_not_starting_with_brace(tmp_path: Path, write_raw, raw: bytes) -> None:
    p = write_raw(tmp_path / "nobrace.safetensors", raw)
    refuse(p, "does not start with '{'")


@pytest.mark.parametrize("raw", [b'{"a": ', b"{'a': 1}", b'{"a": 1,}', b"{} {}", b'{"a": [1, 2}'])
def test_header_invalid_json(tmp_path: Path, write_raw, raw: bytes) -> None:
    p = write_raw(tmp_path / "badjson.safetensors", raw)
    refuse(p, "header is not valid JSON")


def test_header_json_not_an_object(tmp_path: Path, write_raw) -> None:
    # A header that starts with '{' and is valid JSON is necessarily an object, so every
    # non-object is already refused by the '{' check, with a message saying so.
    for i, value in enumerate(([], [1, 2], "x", 3, None, True)):
        p = write_raw(tmp_path / f"notobj{i}.safetensors", value)
        refuse(p, "does not start with '{'")


def test_header_deeply_nested_json(tmp_path: Path, write_raw) -> None:
    depth = 100_000
    p = write_raw(tmp_path / "deep.safetensors", b'{"t":' + b"[" * depth + b"]" * depth + b"}")
    refuse(p, "header is not valid JSON")


def test_duplicate_tensor_key(tmp_path: Path, write_raw) -> None:
    e = json.dumps(U8_1)
    p = write_raw(tmp_path / "dup.safetensors", f'{{"t":{e},"t":{e}}}'.encode(), b"x")
    refuse(p, "duplicate key", tensor="t")


def test_duplicate_key_inside_an_entry(tmp_path: Path, write_raw) -> None:
    raw = b'{"t":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    p = write_raw(tmp_path / "dupkey.safetensors", raw, b"x")
    refuse(p, "duplicate key", "dtype")


def test_duplicate_key_inside_an_entry_names_the_tensor(tmp_path: Path, write_raw) -> None:
    raw = b'{"t":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    p = write_raw(tmp_path / "dupkey.safetensors", raw, b"x")
    refuse(p, "duplicate key", "dtype", tensor="t")


def test_duplicate_tensor_key_first_occurrence_empty(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "dup2.safetensors", f'{{"t":{{}},"t":{json.dumps(U8_1)}}}'.encode(), b"x")
    refuse(p, "duplicate key")


@pytest.mark.parametrize("raw", [
    b'{"__metadata__":{"a":"1","a":"2"},"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    b'{"__metadata__":{"a":"1"},"__metadata__":{"b":"2"},"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
])
def test_duplicate_metadata_key(tmp_path: Path, write_raw, raw: bytes) -> None:
    p = write_raw(tmp_path / "dupmeta.safetensors", raw, b"x")
    refuse(p, "duplicate key")


@pytest.mark.parametrize("meta", [{"a": 1}, {"a": None}, {"a": ["x"]}, ["a", "b"], "format=pt", 5])
def test_metadata_not_str_to_str(tmp_path: Path, write_raw, meta: Any) -> None:
    p = write_raw(tmp_path / "meta.safetensors", {"__metadata__": meta, "t": U8_1}, b"x")
    refuse(p, "__metadata__ must map strings to strings")


def test_metadata_null_and_absent_are_empty(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "m1.safetensors", {"__metadata__": None, "t": U8_1}, b"x")
    assert read_header(p).metadata == {}
    p = write_raw(tmp_path / "m2.safetensors", {"t": U8_1}, b"x")
    assert read_header(p).metadata == {}
    p = write_raw(tmp_path / "m3.safetensors", {"__metadata__": {"format": "pt"}, "t": U8_1}, b"x")
    assert read_header(p).metadata == {"format": "pt"}


# ---------------------------------------------------------------------------------------------
# Entries


@pytest.mark.parametrize("value", [[1], "U8", 3, None, True])
def test_entry_not_an_object(tmp_path: Path, write_raw, value: Any) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"ok": U8_1, "bad": value}, b"x")
    refuse(p, "entry is not an object", tensor="bad")


@pytest.mark.parametrize("drop, expected", [
    ("data_offsets", "missing ['data_offsets']"),
    ("shape", "missing ['shape']"),
    ("dtype", "missing ['dtype']"),
])
def test_entry_missing_key(tmp_path: Path, write_raw, drop: str, expected: str) -> None:
    bad = {k: v for k, v in U8_1.items() if k != drop}
    p = write_raw(tmp_path / "e.safetensors", {"w": bad}, b"x")
    refuse(p, expected, tensor="w")


def test_entry_missing_all_keys(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"w": {}}, b"")
    refuse(p, "missing ['data_offsets', 'dtype', 'shape']", tensor="w")


def test_entry_extra_key(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"w": {**U8_1, "stride": [1], "align": 8}}, b"x")
    refuse(p, "unexpected keys ['align', 'stride']", tensor="w")


@pytest.mark.parametrize("dtype", ["F128", "float32", "u8", "", None, 8, ["U8"]])
def test_unknown_dtype(tmp_path: Path, write_raw, dtype: Any) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"w": {**U8_1, "dtype": dtype}}, b"x")
    refuse(p, f"unknown dtype {dtype!r}", tensor="w")


@pytest.mark.parametrize("shape, shown", [
    (3, "shape 3"),
    ("[1]", "shape '[1]'"),
    ({"0": 1}, "shape {'0': 1}"),
    (None, "shape None"),
    ([-1], "shape [-1]"),
    ([2, -3], "shape [2, -3]"),
    ([True], "shape [True]"),
    ([False], "shape [False]"),
    ([2.0], "shape [2.0]"),
    ([1, 0.5], "shape [1, 0.5]"),
    (["1"], "shape ['1']"),
    ([[1]], "shape [[1]]"),
    ([None], "shape [None]"),
])
def test_bad_shape(tmp_path: Path, write_raw, shape: Any, shown: str) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"w": {**U8_1, "shape": shape}}, b"x")
    refuse(p, shown, "is not a list of non-negative integers", tensor="w")


@pytest.mark.parametrize("offsets, shown", [
    ([0], "data_offsets [0]"),
    ([], "data_offsets []"),
    ([0, 1, 2], "data_offsets [0, 1, 2]"),
    ([-1, 0], "data_offsets [-1, 0]"),
    ([0, -1], "data_offsets [0, -1]"),
    ([False, True], "data_offsets [False, True]"),
    ([0, True], "data_offsets [0, True]"),
    ([0.0, 1.0], "data_offsets [0.0, 1.0]"),
    (["0", "1"], "data_offsets ['0', '1']"),
    ({"begin": 0, "end": 1}, "data_offsets {'begin': 0, 'end': 1}"),
    (1, "data_offsets 1"),
])
def test_bad_data_offsets(tmp_path: Path, write_raw, offsets: Any, shown: str) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"w": {**U8_1, "data_offsets": offsets}}, b"x")
    refuse(p, shown, "is not [begin, end]", tensor="w")


def test_data_offsets_end_before_begin(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"w": entry("U8", [0], 4, 0)}, b"xxxx")
    refuse(p, "data_offsets [4, 0] end before begin", tensor="w")


@pytest.mark.parametrize("dtype, shape, span, needs", [
    ("U8", [2], 1, "U8 [2] needs 2 bytes but data_offsets span 1"),
    ("F32", [2, 3], 12, "F32 [2, 3] needs 24 bytes but data_offsets span 12"),
    ("BF16", [4], 16, "BF16 [4] needs 8 bytes but data_offsets span 16"),
    ("F16", [], 4, "F16 [] needs 2 bytes but data_offsets span 4"),
    ("I64", [0], 8, "I64 [0] needs 0 bytes but data_offsets span 8"),
    ("F4", [3], 2, "F4 [3] needs 1.5 bytes but data_offsets span 2"),
    ("F4", [3], 1, "F4 [3] needs 1.5 bytes but data_offsets span 1"),
    ("F6_E2M3", [3], 3, "F6_E2M3 [3] needs 2.25 bytes but data_offsets span 3"),
])
def test_byte_length_differs_from_dtype_times_shape(tmp_path: Path, write_raw, dtype: str, shape: list[int],
                                                    span: int, needs: str) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"w": entry(dtype, shape, 0, span)}, b"\0" * span)
    refuse(p, needs, tensor="w")


def test_sub_byte_dtypes_filling_whole_bytes_are_fine(tmp_path: Path, write_raw) -> None:
    hdr = {"f4": entry("F4", [2, 3], 0, 3), "f6": entry("F6_E3M2", [4], 3, 6)}
    h = read_header(write_raw(tmp_path / "f4.safetensors", hdr, b"\0" * 6))
    assert (h.tensors["f4"].dtype, h.tensors["f4"].shape, h.tensors["f4"].nbytes) == ("F4", (2, 3), 3)
    assert h.tensors["f6"].nbytes == 3
    with pytest.raises(ValueError, match="whole bytes"):
        tensor_nbytes("F4", (3,))


def test_offset_past_the_data_buffer(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"a": entry("U8", [4], 0, 4), "w": entry("U8", [8], 4, 12)},
                  b"\0" * 8)
    refuse(p, "data_offsets end 12 is past the data buffer (8 bytes)", tensor="w")


def test_offset_past_empty_data_buffer(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"w": U8_1})
    refuse(p, "data_offsets end 1 is past the data buffer (0 bytes)", tensor="w")


def test_overlapping_tensors(tmp_path: Path, write_raw) -> None:
    hdr = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 2, 6)}
    p = write_raw(tmp_path / "e.safetensors", hdr, b"\0" * 6)
    refuse(p, "overlaps the previous tensor (begins at 2, previous ends at 4)", tensor="b")


def test_identical_spans_overlap(tmp_path: Path, write_raw) -> None:
    hdr = {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 0, 4)}
    p = write_raw(tmp_path / "e.safetensors", hdr, b"\0" * 4)
    refuse(p, "overlaps the previous tensor (begins at 0, previous ends at 4)")


def test_gap_between_tensors(tmp_path: Path, write_raw) -> None:
    hdr = {"a": entry("U8", [4], 0, 4), "b": entry("U8", [4], 6, 10)}
    p = write_raw(tmp_path / "e.safetensors", hdr, b"\0" * 10)
    refuse(p, "gap of 2 bytes before this tensor (at 4)", tensor="b")


def test_gap_before_first_tensor(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"a": entry("U8", [4], 3, 7)}, b"\0" * 7)
    refuse(p, "gap of 3 bytes before this tensor (at 0)", tensor="a")


def test_trailing_bytes_not_covered(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "e.safetensors", {"a": entry("U8", [4], 0, 4)}, b"\0" * 6)
    refuse(p, "tensors cover 4 bytes but the data buffer is 6 bytes")
    p = write_raw(tmp_path / "e2.safetensors", {}, b"abc")
    refuse(p, "tensors cover 0 bytes but the data buffer is 3 bytes")


def test_errors_name_the_file_and_the_tensor_through_the_fast_path(tmp_path: Path, write_raw) -> None:
    """Many well-formed entries and one bad one: the fast columnar validator gives up and the exact
    one names the culprit."""
    hdr = {f"t{i}": entry("U8", [1], i, i + 1) for i in range(200)}
    hdr["t137"] = entry("U8", [2], 137, 138)
    p = write_raw(tmp_path / "many.safetensors", hdr, b"\0" * 200)
    refuse(p, "U8 [2] needs 2 bytes but data_offsets span 1", tensor="t137")


def test_not_a_file(tmp_path: Path) -> None:
    refuse(tmp_path / "missing.safetensors", "file not found")
    (tmp_path / "dir.safetensors").mkdir()
    refuse(tmp_path / "dir.safetensors", "is a directory")


# ---------------------------------------------------------------------------------------------
# Library bugs: hostile headers that escape as other exceptions


def test_integer_too_long_to_parse(tmp_path: Path, write_raw) -> None:
    raw = ('{"w":{"dtype":"U8","shape":[%s],"data_offsets":[0,1]}}' % ("1" * 5000)).encode()
    p = write_raw(tmp_path / "e.safetensors", raw, b"x")
    refuse(p, "header is not valid JSON", "4300 digits")


def test_huge_shape_size_mismatch(tmp_path: Path, write_raw) -> None:
    raw = ('{"w":{"dtype":"U8","shape":[1%s],"data_offsets":[0,1]}}' % ("0" * 400)).encode()
    p = write_raw(tmp_path / "e.safetensors", raw, b"x")
    refuse(p, "data_offsets span 1", tensor="w")


def test_lone_surrogate_in_name(tmp_path: Path, write_raw) -> None:
    p = write_raw(tmp_path / "e.safetensors", b'{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x")
    refuse(p)


# ---------------------------------------------------------------------------------------------
# Valid files


def test_zero_size_tensors_are_fine(tmp_path: Path, write_raw) -> None:
    hdr = {
        "empty0": entry("F32", [0, 3], 0, 0),
        "a": entry("U8", [4], 0, 4),
        "empty_mid": entry("BF16", [5, 0], 4, 4),
        "b": entry("I16", [2], 4, 8),
        "empty_end": entry("I64", [0], 8, 8),
    }
    h = read_header(write_raw(tmp_path / "z.safetensors", hdr, b"\0" * 8))
    assert list(h.tensors) == list(hdr)
    assert h.tensors["empty_mid"].shape == (5, 0) and h.tensors["empty_mid"].nbytes == 0
    # Only zero-size tensors, and no data at all.
    h = read_header(write_raw(tmp_path / "z2.safetensors", {"e": entry("F32", [0], 0, 0)}))
    assert h.tensors["e"].numel == 0 and h.data_len == 0
    assert read_header(write_raw(tmp_path / "z3.safetensors", {})).tensors == {}


def test_header_padded_with_trailing_spaces(tmp_path: Path, write_raw) -> None:
    raw = json.dumps({"a": entry("F32", [2], 0, 8)}).encode() + b" " * 13
    h = read_header(write_raw(tmp_path / "pad.safetensors", raw, b"\0" * 8))
    assert h.header_len == len(raw)
    assert h.data_start == 8 + len(raw)
    assert h.absolute_range("a") == (8 + len(raw), 16 + len(raw))


def test_real_safetensors_file_agrees_with_safe_open(tmp_path: Path) -> None:
    import ml_dtypes
    from safetensors import safe_open
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {
        "model.layers.0.w": rng.standard_normal((3, 5)).astype(np.float32),
        "bf": rng.standard_normal((4, 2)).astype(ml_dtypes.bfloat16),
        "u8": rng.integers(0, 255, (7,), dtype=np.uint8),
        "i64": np.arange(3, dtype=np.int64),
        "f16": np.ones((2, 1, 3), np.float16),
        "empty": np.zeros((0, 4), np.float32),
        "scalar": np.array(1.5, np.float64),
        "flags": np.array([True, False, True]),
    }
    p = tmp_path / "ref.safetensors"
    save_file(tensors, str(p), metadata={"format": "np", "note": "x"})
    h = read_header(p)
    assert h.file == "ref.safetensors" and h.path == str(p)
    assert h.file_size == p.stat().st_size
    (n,) = struct.unpack("<Q", p.read_bytes()[:8])
    assert h.header_len == n
    raw_header = json.loads(p.read_bytes()[8:8 + n])
    blob = p.read_bytes()
    with safe_open(str(p), framework="numpy") as f:
        assert h.metadata == f.metadata() == {"format": "np", "note": "x"}
        assert set(h.tensors) == set(f.keys()) == set(tensors)
        for name in f.keys():
            t = h.tensors[name]
            sl = f.get_slice(name)
            assert t.dtype == sl.get_dtype()
            assert list(t.shape) == sl.get_shape()
            assert [t.begin, t.end] == raw_header[name]["data_offsets"]
            # The offsets locate exactly the bytes the reference reader returns.
            start, stop = h.absolute_range(name)
            ref = np.ascontiguousarray(f.get_tensor(name))
            assert blob[start:stop] == ref.tobytes()
            assert t.nbytes == ref.nbytes and t.numel == ref.size


def test_build_header_round_trip_and_alignment() -> None:
    specs = [
        TensorSpec("a", "BF16", (3, 5)),
        TensorSpec("b", "U8", (7,)),
        TensorSpec("c", "F32", ()),
        TensorSpec("d", "F4", (2, 3)),
        TensorSpec("e", "I64", (0,)),
        TensorSpec("名前.weight", "F8_E4M3", (2, 2)),
    ]
    for meta in (None, {"format": "pt", "k": "v"}):
        prefix, offsets = build_header(specs, meta)
        assert len(prefix) % 8 == 0  # the data buffer starts 8-aligned
        (n,) = struct.unpack("<Q", prefix[:8])
        assert n == len(prefix) - 8
        total = offsets[-1][1]
        h = parse_header_bytes(prefix[8:], file="x.safetensors", path="/x", file_size=len(prefix) + total)
        assert h.data_start == len(prefix) and h.data_start % 8 == 0
        assert h.metadata == (meta or {})
        assert [(t.name, t.dtype, t.shape, (t.begin, t.end)) for t in h.tensors.values()] == [
            (s.name, s.dtype, s.shape, o) for s, o in zip(specs, offsets)
        ]
        assert [e - b for b, e in offsets] == [s.nbytes for s in specs]
    prefix, offsets = build_header([TensorSpec("a", "U8", (3,))], align=64)
    assert len(prefix) % 64 == 0
    with pytest.raises(ValueError, match="duplicate tensor name"):
        build_header([TensorSpec("a", "U8", (1,)), TensorSpec("a", "U8", (1,))])


# ---------------------------------------------------------------------------------------------
# Properties

PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
WHOLE_BYTE_DTYPES = sorted(d for d, bits in DTYPE_BITS.items() if bits % 8 == 0)

names = st.text(min_size=1, max_size=24).filter(lambda s: s != "__metadata__")
specs_strategy = st.lists(
    st.tuples(names, st.sampled_from(WHOLE_BYTE_DTYPES), st.lists(st.integers(0, 5), max_size=4)),
    max_size=12,
    unique_by=lambda t: t[0],
)
# Names that collide with the entry keys exercise the exact (slow) validator path.
key_like_names = st.sampled_from(["dtype", "shape", "data_offsets", '"dtype"', "a\"dtype\"b", "x"])


def _tiles_exactly(h: sh.ShardHeader) -> bool:
    spans = sorted((t.begin, t.end) for t in h.tensors.values())
    pos = 0
    for b, e in spans:
        if b != pos:
            return False
        pos = e
    ok_sizes = all(t.nbytes * 8 == DTYPE_BITS[t.dtype] * math.prod(t.shape) for t in h.tensors.values())
    return pos == h.data_len and ok_sizes


@PROPERTY
@given(specs=specs_strategy, extra=st.lists(st.tuples(key_like_names, st.sampled_from(["U8", "F32"]),
                                                       st.lists(st.integers(0, 3), max_size=2)), max_size=2),
       meta=st.none() | st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
def test_property_build_header_parses_back(specs, extra, meta) -> None:
    seen = {n for n, _, _ in specs}
    all_specs = [TensorSpec(n, d, tuple(s)) for n, d, s in specs]
    all_specs += [TensorSpec(n, d, tuple(s)) for n, d, s in extra if n not in seen and not seen.add(n)]
    prefix, offsets = build_header(all_specs, meta)
    total = offsets[-1][1] if offsets else 0
    h = parse_header_bytes(prefix[8:], file="f", path="p", file_size=len(prefix) + total)
    assert len(prefix) % 8 == 0
    assert h.metadata == (meta or {})
    assert [(t.name, t.dtype, t.shape, t.begin, t.end) for t in h.tensors.values()] == [
        (s.name, s.dtype, s.shape, b, e) for s, (b, e) in zip(all_specs, offsets)
    ]


def _header_by_dumps(specs: list[TensorSpec], metadata: dict[str, str] | None, align: int
                     ) -> tuple[bytes, list[tuple[int, int]]]:
    """The header as the format's definition reads: one dict per entry through ``json.dumps``."""
    entries: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offsets, pos = [], 0
    for s in specs:
        if s.name in entries:
            raise ValueError(f"duplicate tensor name {s.name!r}")
        end = pos + s.nbytes
        entries[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [pos, end]}
        offsets.append((pos, end))
        pos = end
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * ((-(8 + len(raw))) % align)
    return struct.pack("<Q", len(raw)) + raw, offsets


@PROPERTY
@given(specs=st.lists(st.tuples(st.text(max_size=6) | st.sampled_from(["__metadata__", 'a"b', "a\\b", "\x00\x7f", "名前"]),
                                st.sampled_from(sorted(DTYPE_BITS) + ["XX"]), st.lists(st.integers(0, 9), max_size=3)),
                      max_size=8),
       meta=st.none() | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2),
       align=st.sampled_from([8, 64, 4096]))
def test_property_build_header_bytes_are_json_dumps(specs, meta, align) -> None:
    """build_header writes its JSON in C-level loops from columns (header_prefix): byte for byte
    what one dict per entry through json.dumps gives - escaped and non-ASCII names, empty shapes,
    metadata, padding - and the same error, in the same order, for a duplicate name or a dtype
    that is unknown or does not fill whole bytes."""
    all_specs = [TensorSpec(n, d, tuple(s)) for n, d, s in specs]

    def outcome(build):  # the result, or the error it raises
        try:
            return build(all_specs, meta, align)
        except (ValueError, KeyError) as e:
            return type(e), str(e)

    assert outcome(build_header) == outcome(_header_by_dumps)


def _valid_small_file() -> bytes:
    specs = [TensorSpec("a.weight", "F32", (2, 2)), TensorSpec("b", "U8", (3,)), TensorSpec("c", "BF16", (0, 2)),
             TensorSpec("d", "I16", (1,))]
    prefix, offsets = build_header(specs, {"format": "pt"})
    return prefix + bytes(range(offsets[-1][1]))


VALID_SMALL = _valid_small_file()


@pytest.fixture(scope="session")
def mutation_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mutations")


@PROPERTY
@given(
    edits=st.lists(st.tuples(st.integers(0, len(VALID_SMALL) - 1), st.integers(0, 255)), max_size=4),
    header_edits=st.lists(st.tuples(st.integers(8, len(VALID_SMALL) - 1),
                                    st.sampled_from(list(b'{}[]",:0123456789 -.etfnaU\\'))), max_size=3),
    cut=st.none() | st.integers(0, len(VALID_SMALL)),
    tail=st.binary(max_size=8),
)
def test_property_mutations_parse_or_raise_header_error(mutation_dir: Path, edits, header_edits, cut, tail) -> None:
    data = bytearray(VALID_SMALL)
    for pos, byte in edits + header_edits:
        data[pos] = byte
    if cut is not None:
        del data[cut:]
    data += tail
    p = mutation_dir / "m.safetensors"
    p.write_bytes(bytes(data))
    try:
        h = read_header(p)
    except SafetensorsHeaderError as e:
        assert str(p) in str(e)
        return
    assert _tiles_exactly(h)
    assert h.file_size == len(data)
    assert h.data_start + h.data_len == len(data)


json_scalars = (
    st.none() | st.booleans() | st.integers(-(2**64), 2**64) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=10) | st.sampled_from(sorted(DTYPE_BITS))
)
json_keys = st.text(max_size=8) | st.sampled_from(["dtype", "shape", "data_offsets", "__metadata__"])
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(json_keys, children, max_size=6),
    max_leaves=30,
)
# Header-shaped objects, with each field drawn from arbitrary JSON, so the entry checks are reached.
header_like = st.dictionaries(
    st.text(max_size=6) | st.just("__metadata__"),
    st.fixed_dictionaries({
        "dtype": st.sampled_from(sorted(DTYPE_BITS)) | json_values,
        "shape": st.lists(st.integers(-1, 4), max_size=3) | json_values,
        "data_offsets": st.lists(st.integers(-1, 16), min_size=2, max_size=2) | json_values,
    }, optional={"extra": json_values}) | json_values,
    max_size=4,
)


@PROPERTY
@given(value=json_values | header_like, data_len=st.integers(0, 32))
def test_property_arbitrary_json_only_raises_header_error(value, data_len) -> None:
    raw = json.dumps(value).encode()
    try:
        h = parse_header_bytes(raw, file="f", path="/p", file_size=8 + len(raw) + data_len)
    except SafetensorsHeaderError as e:
        assert "/p" in str(e)
        return
    assert isinstance(value, dict)
    assert _tiles_exactly(h)
