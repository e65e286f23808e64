"""``verify --manifest FILE`` hashes before the manifest is parsed (``manifest_path``): each
hashing thread scans by its own file's header, the manifest then says which files and tensors the
run wants. Whatever the timing - the manifest parsed before the first chunk, during a file, or
after every file was hashed - the report is exactly the one a caller-loaded manifest gives.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckpt_edit import set_byte as patch
from helpers import run, shard_of
from k3ckpt.errors import CheckpointNotFoundError, ManifestError
from k3ckpt.format.checkpoint import SharedHeaders, open_checkpoint
from k3ckpt.format.header import read_header
from k3ckpt.integrity.hashing import Span, StreamHasher, hash_file
from k3ckpt.integrity.manifest import Manifest
from k3ckpt.integrity.verify import VerifyReport, verify_checkpoint

L1E3 = "language_model.model.layers.1.block_sparse_moe.experts.3."
PACKED = L1E3 + "w1.weight_packed"
SCALE = L1E3 + "w2.weight_scale"
L3_SCALE = "language_model.model.layers.3.block_sparse_moe.experts.5.w3.weight_scale"


def _range(root: Path, tensor: str) -> tuple[str, int, int]:
    f = shard_of(root, tensor)
    return (f, *read_header(root / f).absolute_range(tensor))


def _flip(root: Path) -> None:
    f, start, _ = _range(root, PACKED)
    b = bytearray((root / f).read_bytes())
    b[start + 100] ^= 0x10
    (root / f).write_bytes(bytes(b))


def _nan(root: Path) -> None:
    f, start, _ = _range(root, SCALE)
    patch(root / f, start + 77, 0xFF)


def _stray_copy_of_the_largest_shard(root: Path) -> None:
    """The largest file, not in the manifest: hashed first, before the manifest says it is extra."""
    big = max((p for p in root.iterdir() if p.suffix == ".safetensors"), key=lambda p: p.stat().st_size)
    shutil.copyfile(big, root / "zz-stray.bin")
    (root / "zz-stray.bin").write_bytes((root / "zz-stray.bin").read_bytes() + b"x")


def _truncate(root: Path) -> None:
    f = shard_of(root, PACKED)
    os.truncate(root / f, (root / f).stat().st_size - 1000)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "clean": lambda root: None, "flipped": _flip, "nan": _nan, "stray": _stray_copy_of_the_largest_shard,
    "truncated": _truncate,
}


class _Timing:
    """Holds back the manifest's parse until the hashing threads got as far as ``when`` says:
    ``before`` (no wait), ``mid-file`` (a few small chunks hashed: the tensor spans arrive inside
    a file) or ``after`` (every byte hashed: the tensor digests need a second read)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path, when: str) -> None:
        self.when, self.hashed, self.cond = when, 0, threading.Condition()
        self.total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        real = Manifest.load.__func__  # type: ignore[attr-defined]

        def load(cls: type[Manifest], path: Any) -> Manifest:
            goal = {"before": 0, "mid-file": 5000, "after": self.total}[self.when]
            with self.cond:
                assert self.cond.wait_for(lambda: self.hashed >= goal, timeout=30), (self.hashed, goal)
            return real(cls, path)

        monkeypatch.setattr(Manifest, "load", classmethod(load))
        if when == "mid-file":
            monkeypatch.setenv("K3CKPT_HASH_BUFFER", "997")  # many chunks per file

    def progress(self, n: int) -> None:
        with self.cond:
            self.hashed += n
            self.cond.notify_all()


def _comparable(rep: VerifyReport) -> dict[str, Any]:
    d = rep.to_json()
    del d["seconds"]
    return d


@pytest.mark.parametrize("when", ["before", "mid-file", "after"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("kind", ["tensors", "files"])
def test_manifest_path_reports_exactly_what_a_loaded_manifest_does(
        k3_tiny: Path, clone_checkpoint, tmp_path: Path, k3_tiny_manifests, monkeypatch, when: str, damage: str,
        kind: str) -> None:
    root = clone_checkpoint(k3_tiny)
    DAMAGE[damage](root)
    path = k3_tiny_manifests[kind]
    loaded = verify_checkpoint(root, manifest=Manifest.load(path), manifest_label=str(path), use_cache=False)
    assert loaded.ok == (damage in ("clean", "stray"))
    timing = _Timing(monkeypatch, root, when)
    early = verify_checkpoint(root, manifest_path=path, use_cache=False, progress=timing.progress)
    assert _comparable(early) == _comparable(loaded)


def test_tensor_spans_that_arrive_mid_file_and_after_it_give_the_tensor_digests(
        k3_tiny: Path, clone_checkpoint, tmp_path: Path, k3_tiny_manifests, monkeypatch) -> None:
    """Both late paths are taken: spans added inside a file (its hashed bytes re-read, only
    those), and a second read of a file hashed to its end before the manifest was parsed."""
    import k3ckpt.integrity.verify as verify_mod

    root = clone_checkpoint(k3_tiny)
    _flip(root)
    added: list[int] = []
    real_add = StreamHasher.add_spans

    def add_spans(self: StreamHasher, spans: Any, prefix: Any) -> None:
        added.append(self.pos)
        real_add(self, spans, prefix)

    monkeypatch.setattr(StreamHasher, "add_spans", add_spans)
    second: list[list[str]] = []
    real_hash_files = verify_mod.hash_files
    monkeypatch.setattr(verify_mod, "hash_files", lambda root, files, **kw: (second.append(list(files)),
                                                                           real_hash_files(root, files, **kw))[1])
    for when in ("mid-file", "after"):
        added.clear()
        second.clear()
        timing = _Timing(monkeypatch, root, when)
        rep = verify_checkpoint(root, manifest_path=k3_tiny_manifests["tensors"], use_cache=False,
                                progress=timing.progress)
        assert [(i.kind, i.tensor) for i in rep.issues] == [("sha256", None), ("tensor-sha256", PACKED)]
        if when == "mid-file":
            assert any(pos > 0 for pos in added) and second == []
        else:
            assert added == [] and second and shard_of(root, PACKED) in second[0]


def test_a_header_that_disagrees_with_the_manifest_is_scanned_by_the_header(
        ckpt_copy: Path, tmp_path: Path, k3_tiny_manifests) -> None:
    """The hashing threads scan by each file's own header from the start; a manifest that puts
    a scale elsewhere is a layout issue, and the NaN is named where the header says it is."""
    m = Manifest.load(k3_tiny_manifests["tensors"])
    twin = L3_SCALE.replace("experts.5.", "experts.6.")
    doc = json.loads(k3_tiny_manifests["tensors"].read_text())
    doc["tensors"][L3_SCALE]["offsets"], doc["tensors"][twin]["offsets"] = (
        list(m.tensors[twin].offsets), list(m.tensors[L3_SCALE].offsets))
    swapped = tmp_path / "swapped.json"
    swapped.write_text(json.dumps(doc))
    f, start, _ = _range(ckpt_copy, L3_SCALE)
    patch(ckpt_copy / f, start + 3, 0xFF)
    rep = verify_checkpoint(ckpt_copy, manifest_path=swapped, use_cache=False)
    assert [(i.kind, i.file, i.tensor) for i in rep.issues if i.kind == "nan-scale"] == [("nan-scale", f, L3_SCALE)]
    assert {i.tensor for i in rep.issues if i.kind == "tensor-layout"} == {L3_SCALE, twin}
    assert {i.tensor for i in rep.issues if i.kind == "tensor-sha256"} == {L3_SCALE, twin}
    loaded = verify_checkpoint(ckpt_copy, manifest=Manifest.load(swapped), manifest_label=str(swapped),
                               use_cache=False)
    assert _comparable(rep) == _comparable(loaded)


@pytest.fixture
def ckpt_copy(k3_tiny: Path, clone_checkpoint) -> Path:
    return clone_checkpoint(k3_tiny)


def test_a_bad_manifest_stops_the_hashing_that_started_before_it(ckpt_copy: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "k3ckpt-manifest", "version": 1, "files": {}, "tensors": {"t": {}}}')
    with pytest.raises(ManifestError, match="malformed"):
        verify_checkpoint(ckpt_copy, manifest_path=bad, use_cache=False)
    assert not [t for t in threading.enumerate() if t.name.startswith(("ThreadPoolExecutor", "k3ckpt-hash")) and t.is_alive()]
    res = run("verify", str(ckpt_copy), "--manifest", str(bad), "--no-cache")
    assert res.exit_code == 2 and "malformed" in res.output and "Traceback" not in res.output


def test_a_bad_manifest_is_named_before_a_missing_checkpoint(tmp_path: Path) -> None:
    """As when the CLI loaded the manifest first."""
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ManifestError):
        verify_checkpoint(tmp_path / "nowhere", manifest_path=bad)
    good = tmp_path / "m.json"
    Manifest({}, {}).save(good)
    with pytest.raises(CheckpointNotFoundError):
        verify_checkpoint(tmp_path / "nowhere", manifest_path=good)


def test_shared_headers_parse_each_header_once_for_every_thread(k3_tiny: Path, monkeypatch) -> None:
    import k3ckpt.format.checkpoint as checkpoint_mod

    calls: list[str] = []
    real = checkpoint_mod.read_header

    def counting(path: Any, file: str | None = None) -> Any:
        calls.append(str(file))
        return real(path, file=file)

    monkeypatch.setattr(checkpoint_mod, "read_header", counting)
    shared = SharedHeaders(k3_tiny)
    files = sorted(p.name for p in k3_tiny.glob("*.safetensors"))
    got: dict[str, list[Any]] = {f: [] for f in files}

    def ask() -> None:
        for f in files:
            got[f].append(shared.get(f))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == files  # once each
    assert all(len({id(h) for h in hs}) == 1 for hs in got.values())
    ckpt = open_checkpoint(k3_tiny, strict=False, headers=shared)
    assert all(ckpt.shards[f] is got[f][0] for f in files) and sorted(calls) == files


def test_shared_headers_give_the_parse_error_to_every_caller(tmp_path: Path) -> None:
    (tmp_path / "x.safetensors").write_bytes(b"\x01")
    shared = SharedHeaders(tmp_path)
    for _ in range(2):
        with pytest.raises(Exception, match="too short"):
            shared.get("x.safetensors")


@pytest.mark.parametrize("split", [0, 1, 996, 997, 2500, 4000])
def test_spans_added_late_hash_what_spans_given_first_hash(split: int) -> None:
    data = bytes(range(256)) * 16  # 4096 bytes
    spans = [Span("a", 10, 1000), Span("b", 1000, 1003), Span("c", 2000, 4096), Span("empty", 3000, 3000)]
    first = StreamHasher(spans)
    first.feed(data)
    late = StreamHasher()
    late.feed(data[:split])
    asked: list[tuple[int, int]] = []

    def prefix(lo: int, hi: int) -> list[bytes]:
        asked.append((lo, hi))
        return [data[lo:hi]]

    late.add_spans(spans, prefix)
    late.feed(data[split:])
    assert late.digest("f") == first.digest("f")
    assert all(hi <= split for _, hi in asked)  # only bytes already fed are read again


def test_hash_file_takes_spans_that_become_known_between_chunks(tmp_path: Path) -> None:
    p = tmp_path / "f"
    data = os.urandom(10_000)
    p.write_bytes(data)
    spans = [Span("x", 5, 3333), Span("y", 3333, 9999)]
    asked = iter([None, None, None, spans])
    late = hash_file(p, late_spans=lambda: next(asked, spans), chunk_bytes=1000)
    assert late == hash_file(p, spans=spans, chunk_bytes=1000)
    never = hash_file(p, late_spans=lambda: None, chunk_bytes=1000)
    assert never.spans is None and never.sha256 == late.sha256


@pytest.mark.parametrize("known_after", [0, 1, 3, 9, None])  # chunks read before the spans are known; None: at the end
def test_hash_file_searches_scan_spans_that_become_known_late(tmp_path: Path, known_after: int | None) -> None:
    p = tmp_path / "f"
    data = bytearray(10_000)
    for at in (150, 2999, 3000, 7777):  # NaNs in the first chunk, across a boundary's two sides, late
        data[at] = 0xFF
    p.write_bytes(bytes(data))
    scan = [Span("a", 100, 200), Span("b", 2500, 3000), Span("c", 3000, 3500), Span("d", 5000, 7000),
            Span("e", 7000, 8000)]
    asked: list[bool] = []

    def late(now: bool) -> list[Span] | None:
        asked.append(now)
        return scan if now or (known_after is not None and len(asked) > known_after) else None

    got = hash_file(p, late_scan=late, chunk_bytes=1000)
    assert got == hash_file(p, scan=scan, chunk_bytes=1000)
    assert got.flagged == ["a", "b", "c", "e"]
    assert asked[-1] is (known_after is None)  # asked to answer now only when the read ended first
    assert hash_file(p, late_scan=lambda now: [] if now else None, chunk_bytes=1000).flagged is None


def test_hashing_threads_start_before_any_header_is_parsed(ckpt_copy: Path, k3_tiny_manifests, monkeypatch) -> None:
    """A thread does not parse its file's header before hashing it (a parse holds the GIL, and
    waited on the main thread's parse of the manifest): each shard is being hashed before its
    header is parsed, and each header is still parsed once."""
    import k3ckpt.format.checkpoint as checkpoint_mod
    import k3ckpt.integrity.hashing as hashing_mod

    parsed: list[str] = []
    real_read = checkpoint_mod.read_header
    monkeypatch.setattr(checkpoint_mod, "read_header", lambda path, file=None: (parsed.append(str(file)),
                                                                               real_read(path, file=file))[1])
    shards = sorted(p.name for p in ckpt_copy.glob("*.safetensors"))
    parsed_before: dict[str, bool] = {}
    all_started = threading.Event()
    real_hash = hashing_mod.hash_file

    def hash_file(path: Any, **kw: Any) -> Any:
        parsed_before[kw["rel"]] = kw["rel"] in parsed
        if parsed_before.keys() >= set(shards):
            all_started.set()
        return real_hash(path, **kw)

    real_load = Manifest.load.__func__  # type: ignore[attr-defined]

    def load(cls: type[Manifest], path: Any) -> Manifest:
        all_started.wait(30)  # so the main thread's structure check cannot parse a header first
        return real_load(cls, path)

    monkeypatch.setattr(hashing_mod, "hash_file", hash_file)
    monkeypatch.setattr(Manifest, "load", classmethod(load))
    rep = verify_checkpoint(ckpt_copy, manifest_path=k3_tiny_manifests["files"], use_cache=False)
    assert rep.ok and {f: parsed_before[f] for f in shards} == dict.fromkeys(shards, False)
    assert sorted(parsed) == shards


def test_progress_after_the_plan_counts_only_the_planned_files(k3_tiny: Path, clone_checkpoint, k3_tiny_manifests,
                                                               monkeypatch) -> None:
    """A file begun before the manifest said it is not wanted (a stray, hashed first as the
    largest) adds nothing to the progress once the planned total is announced."""
    root = clone_checkpoint(k3_tiny)
    _stray_copy_of_the_largest_shard(root)
    timing = _Timing(monkeypatch, root, "mid-file")
    planned: list[int] = []
    after_plan: list[int] = []

    def progress(n: int) -> None:
        timing.progress(n)
        if planned:
            after_plan.append(n)

    def on_plan(total: int) -> None:
        planned.append(total)
        time.sleep(0.05)  # the stray's thread goes on meanwhile: its chunks must not count from here

    rep = verify_checkpoint(root, manifest_path=k3_tiny_manifests["files"], use_cache=False, progress=progress,
                            on_plan=on_plan, jobs=1)
    assert rep.ok and planned == [rep.bytes_hashed]
    assert 0 < sum(after_plan) <= planned[0]


def test_a_file_the_manifest_does_not_want_stops_being_hashed_when_it_says_so(
        k3_tiny: Path, clone_checkpoint, k3_tiny_manifests, monkeypatch) -> None:
    import k3ckpt.integrity.hashing as hashing_mod
    from k3ckpt.errors import HashError

    root = clone_checkpoint(k3_tiny)
    _stray_copy_of_the_largest_shard(root)  # the largest: begun first, before the manifest is parsed
    outcome: dict[str, str] = {}
    real_hash = hashing_mod.hash_file

    def hash_file(path: Any, **kw: Any) -> Any:
        try:
            d = real_hash(path, **kw)
        except HashError as e:
            outcome[kw["rel"]] = str(e.strerror)
            raise
        outcome[kw["rel"]] = "hashed"
        return d

    monkeypatch.setattr(hashing_mod, "hash_file", hash_file)
    timing = _Timing(monkeypatch, root, "mid-file")
    rep = verify_checkpoint(root, manifest_path=k3_tiny_manifests["files"], use_cache=False, progress=timing.progress,
                            jobs=1)
    assert outcome["zz-stray.bin"] == "cancelled"
    assert rep.ok and [i.file for i in rep.issues] == ["zz-stray.bin"]  # an extra-file warning, not unreadable
    assert {f for f, o in outcome.items() if o == "hashed"} == {f for f in os.listdir(root) if f != "zz-stray.bin"}


def test_the_gil_changes_hands_more_often_while_hashing_and_as_before_after(
        ckpt_copy: Path, tmp_path: Path, k3_tiny_manifests, monkeypatch) -> None:
    import sys

    import k3ckpt.integrity.hashing as hashing_mod

    seen: list[float] = []
    real_hash = hashing_mod.hash_file
    monkeypatch.setattr(hashing_mod, "hash_file", lambda path, **kw: (seen.append(sys.getswitchinterval()),
                                                                      real_hash(path, **kw))[1])
    before = sys.getswitchinterval()
    assert verify_checkpoint(ckpt_copy, manifest_path=k3_tiny_manifests["files"], use_cache=False).ok
    assert seen and set(seen) == {min(before, 0.0005)} and sys.getswitchinterval() == before
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ManifestError):
        verify_checkpoint(ckpt_copy, manifest_path=bad, use_cache=False)
    assert sys.getswitchinterval() == before


def test_importing_the_role_rules_compiles_no_rule_pattern() -> None:
    """The rule table's 21 patterns are compiled when a name is first classified, not at import
    (~5 ms of every command's start, before verify's first hashed byte)."""
    import subprocess
    import sys

    code = ("import re, sys; seen = []; compile_ = re.compile\n"
            "re.compile = lambda p, *a, **k: (seen.append(p), compile_(p, *a, **k))[1]\n"
            "from k3ckpt.format.roles import RULES, classify\n"
            "rules = {r.pattern for r in RULES}; print(len(rules & set(seen)))\n"
            "classify('language_model.model.layers.3.self_attn.o_proj.weight'); print(len(rules & set(seen)) > 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "True"]


@pytest.mark.parametrize("source", ["manifest", "manifest_path"])
def test_verify_runs_with_the_cyclic_gc_paused_and_resumes_it(ckpt_copy: Path, k3_tiny_manifests, monkeypatch,
                                                             source: str) -> None:
    """The collections that walked the freshly parsed manifest and headers again and again took
    25-50 ms of a 1 GB verify's CPU; the GC is back on (or still off, if it was) afterwards."""
    import gc

    import k3ckpt.integrity.verify as verify_mod

    seen: list[bool] = []
    real = verify_mod.structure_issues
    monkeypatch.setattr(verify_mod, "structure_issues", lambda *a, **kw: (seen.append(gc.isenabled()), real(*a, **kw))[1])
    arg = {"manifest": Manifest.load(k3_tiny_manifests["files"])} if source == "manifest" else {
        "manifest_path": k3_tiny_manifests["files"]}
    assert gc.isenabled()
    assert verify_checkpoint(ckpt_copy, use_cache=False, **arg).ok
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        assert verify_checkpoint(ckpt_copy, use_cache=False, **arg).ok and not gc.isenabled()
    finally:
        gc.enable()


def test_verify_with_a_manifest_does_not_import_concurrent_futures(k3_tiny: Path, k3_tiny_manifests) -> None:
    """Plain threads hash: concurrent.futures (and the logging it imports) is ~6 ms of start-up
    before the first hashed byte, for nothing."""
    import subprocess
    import sys

    code = ("import sys\n"
            f"sys.argv = ['k3ckpt', 'verify', {str(k3_tiny)!r}, '--manifest', {str(k3_tiny_manifests['files'])!r}, "
            "'--no-cache']\n"
            "from k3ckpt.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print(sorted(m for m in ('concurrent.futures', 'logging') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "[]"


@pytest.mark.parametrize("quick", [False, True])
def test_no_header_worker_is_forked_while_threads_hash(k3_tiny: Path, k3_tiny_manifests, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, quick: bool) -> None:
    """A full run hashes in threads while the headers are parsed: they are parsed in this
    process (a fork beside running threads can hand the child a lock one of them held, and the
    cores are busy hashing). A quick run hashes nothing: its headers still go to workers."""
    import concurrent.futures

    import k3ckpt.format.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "PARALLEL_HEADER_MIN_FILES", 2)  # k3-tiny's 8 shards would fork
    pools = []
    real = concurrent.futures.ProcessPoolExecutor

    def spy(*args: Any, **kwargs: Any) -> Any:
        pools.append(kwargs.get("max_workers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", spy)
    for manifest in ("files", "tensors"):
        rep = verify_checkpoint(k3_tiny, manifest_path=k3_tiny_manifests[manifest], quick=quick, jobs=2,
                                cache_directory=tmp_path / "cache")
        assert rep.ok, rep.issues
    assert (len(pools) > 0) == quick
