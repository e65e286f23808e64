"""``k3ckpt fetch --node N --gpus-per-node G`` (``--format node``, the default with ``--node``)
writes the node directory ``k3ckpt reshard`` writes as ``OUT/node-0000N/``: the same file names
and the same bytes for every file (weight files, index, marker, READY, config, tokenizer,
licence), from the loopback hub serving the same checkpoint, through the real hub clients.
Only the node's bytes move; verify, inspect and preflight accept the result; SIGKILL + resume
gives the same directory; a manifest catches corruption before a file gets its final name.

The checkpoint served is k3-tiny with two expert groups (``grouped_hub``): the round_robin case
is a node directory vLLM serves only for such a model, and the only one k3ckpt writes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ckpt_edit import flip_byte, set_expert_groups
from helpers import REPO, assert_one_line_error, hub_offline, kill_at_pause, run
from k3ckpt.format.checkpoint import INDEX_NAME, iter_checkpoint_files, open_checkpoint
from k3ckpt.format.header import read_header
from k3ckpt.hub import download
from k3ckpt.integrity.manifest import Manifest, build_manifest

CHUNK = 16 * 1024  # several requests per file, and large tensors cut into several pieces

#: (topology flags, node, file size flags, the same topology in preflight's flags): one node
#: holding the whole world (default file size); node 1 of 2 x 4 GPUs with round_robin placement
#: and small files (several files per rank); the last node of an uneven split (16 experts over 6
#: ranks: ranks 0-3 hold 3 each, ranks 4-5, node 2, hold 2).
CASES = [
    (("--tp", "2", "--dp", "4"), 0, (), ("--ep", "8", "--tp", "2", "--gpus-per-node", "8")),
    (("--tp", "2", "--dp", "4", "--gpus-per-node", "4", "--placement", "round_robin"), 1,
     ("--max-file-size", "300000"), ("--ep", "8", "--tp", "2", "--gpus-per-node", "4")),
    (("--ep", "6", "--tp", "2", "--gpus-per-node", "2"), 2, ("--max-file-size", "1MiB"),
     ("--ep", "6", "--tp", "2", "--gpus-per-node", "2")),
]


def tree(d: Path) -> dict[str, str]:
    """sha256 of every file of the checkpoint directory ``d`` (hidden directories - a fetch's
    ``.cache`` working records - are not part of a checkpoint; hidden files such as a lock are)."""
    return {rel: hashlib.sha256((d / rel).read_bytes()).hexdigest() for rel in iter_checkpoint_files(d)}


def fetch_node(h: Any, dest: Path, topo: tuple[str, ...], node: int, *extra: str, source: str = "hf") -> Any:
    return run("fetch", "--source", source, "--repo", REPO, "--dest", str(dest), "--endpoint", h.url,
               "--chunk-size", str(CHUNK), "--workers", "3", *topo, "--node", str(node), *extra)


@pytest.fixture(scope="module")
def resharded(k3_tiny_grouped: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Case index -> reshard's node directory for that case (the reference)."""
    out: dict[int, Path] = {}
    for i, (topo, node, sizes, _) in enumerate(CASES):
        o = tmp_path_factory.mktemp(f"reshard-{i}")
        res = run("reshard", str(k3_tiny_grouped), "-o", str(o), *topo, *sizes, "--node", str(node))
        assert res.exit_code == 0, res.output
        out[i] = o / f"node-{node:05d}"
    return out


def planning_bytes(served: Path) -> int:
    return (sum(read_header(p).data_start for p in served.glob("*.safetensors"))
            + (served / INDEX_NAME).stat().st_size + (served / "config.json").stat().st_size)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fetch_node_equals_reshard_node(case: int, grouped_hub: Any, resharded: dict[int, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    h, served = grouped_hub
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    topo, node, sizes, pre = CASES[case]
    ref = resharded[case]
    h.reset_counters()
    dest = tmp_path / "node"
    res = fetch_node(h, dest, topo, node, *sizes)
    assert res.exit_code == 0, res.output
    # no --manifest: the node files are checked for structure and sizes only, and said so (#25)
    assert res.output.startswith("not proven: ") and f"node {node} (" in res.output
    want = tree(ref)
    assert any(f.startswith("model-rank-") for f in want) and "READY" in want and "LICENSE" in want
    assert tree(dest) == want  # same names, same bytes: weight files, index, marker, READY, config...
    # only the node's bytes moved: planning, each of its tensors once, the other files once
    tensors = sum(t.nbytes for t in open_checkpoint(ref).tensors.values())
    others = sum((served / f).stat().st_size for f in want if not f.endswith(".safetensors")
                 and f not in (INDEX_NAME, "k3ckpt-node.json", "READY"))
    assert h.total_bytes_sent() == planning_bytes(served) + tensors + others
    # what reads a reshard node directory reads this one the same way
    assert run("verify", str(dest)).exit_code == 0
    # (inspect also names the hub revision a fetch recorded, which a local reshard cannot know)
    fetched = [x for x in run("inspect", str(dest)).output.splitlines() if not x.startswith("source ")]
    assert fetched == run("inspect", str(ref)).output.replace(str(ref), str(dest)).splitlines()
    a = run("preflight", str(dest), "--node", str(node), *pre)
    b = run("preflight", str(ref), "--node", str(node), *pre)
    # (preflight reads the launch - placement included - from k3ckpt-node.json: both are ready;
    # round_robin too, the model having expert groups)
    assert a.exit_code == b.exit_code == 0, a.output
    # every check says the same, except that the fetched node knows its hub revision (PASS, not
    # WARN; and a fix names it)

    # (fixes that name where the bytes came from: a fetch's hub, or nothing for a local reshard)
    FETCH_OR_PROOF_FIXES = ("fix: k3ckpt fetch", "fix: k3ckpt reshard", "fix: k3ckpt verify", "fix: verify the")

    def checks(out: str, d: Path) -> list[str]:
        # (and free disk changes between runs; the proof row names what proved which files: the
        # fetch's other files the hub's sha256, the reshard's nothing - its source was not verified)
        machine = (["source"], ["disk"], ["host", "memory"], ["gpu"], ["proof"])
        return [x for x in out.replace(str(d), "DIR").splitlines() if not any(x.split()[1:1 + len(m)] == m
                                                                             for m in machine)
                and not x.startswith("result") and not x.lstrip().startswith(FETCH_OR_PROOF_FIXES)]

    assert checks(a.output, dest) == checks(b.output, ref)
    assert {"structure", "experts"} <= {x.split()[1] for x in checks(a.output, dest) if x[:4] in ("PASS", "FAIL")}
    assert "PASS  source        from moonshotai/Kimi-K3@" in a.output
    # neither node's weight files are proven (no --manifest; an unverified source): never "ready"
    for out in (a.output, b.output):
        assert "WARN  proof         not proven: " in out and "loadable, not proven" in out
        assert not [x for x in out.splitlines() if x.startswith("FAIL")], out
    # a second run moves nothing (digests come from the fetch's records) and changes nothing
    h.reset_counters()
    again = fetch_node(h, dest, topo, node, *sizes, "--json")
    data = json.loads(again.output)
    assert again.exit_code == 0 and data["written"] == [] and data["bytes_downloaded"] == 0
    assert len(data["skipped"]) == sum(f.endswith(".safetensors") for f in want)
    assert tree(dest) == want


def test_modelscope_writes_the_same_node(grouped_hub: Any, resharded: dict[int, Path], tmp_path: Path) -> None:
    h, _ = grouped_hub
    topo, node, sizes, _ = CASES[1]
    res = fetch_node(h, tmp_path / "ms", topo, node, *sizes, "--json", source="modelscope")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["hub"] == "modelscope"
    assert tree(tmp_path / "ms") == tree(resharded[1])


def test_manifest_checks_every_tensor_and_a_bad_one_never_gets_a_final_name(
        grouped_hub: Any, k3_tiny_grouped: Path, resharded: dict[int, Path], tmp_path: Path) -> None:
    h, served = grouped_hub
    manifest = tmp_path / "m.json"
    build_manifest(k3_tiny_grouped, tensor_hashes=True).save(manifest)
    topo, node, sizes, _ = CASES[1]
    res = fetch_node(h, tmp_path / "ok", topo, node, *sizes, "--manifest", str(manifest), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["verification"] == "tensor-sha256" and "note" not in data
    assert data["tensors_verified"] == len(open_checkpoint(resharded[1]).tensors)
    assert tree(tmp_path / "ok") == tree(resharded[1])
    # a byte of a rank 5 expert corrupted on every response: that file fails, named, never final
    shard = "model-00003-of-000008.safetensors"
    hdr = read_header(served / shard)
    expert = next(n for n in hdr.tensors if ".experts.5.w2.weight_packed" in n)
    h.inject("corrupt_byte", shard, times=None, offset=hdr.absolute_range(expert)[0] + 1)
    dest = tmp_path / "bad"
    res = fetch_node(h, dest, topo, node, *sizes, "--manifest", str(manifest))
    assert res.exit_code == 1 and res.output.startswith("FAILED: ")
    line = next(x for x in res.output.splitlines() if x.startswith("  could not fetch model-rank-00005-experts-"))
    assert f"tensor {expert!r}: sha256" in line
    bad = line.split()[3].rstrip(":")
    assert not (dest / bad).exists()
    assert not any((dest / f).exists() for f in (INDEX_NAME, "k3ckpt-node.json", "READY"))


def _count_reads_back(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[str]]:
    """(tensor bytes read from a ``.part`` being written, node files ``hash_file`` read) during a
    fetch: the two ways a digest could come from reading written bytes back. (The header, at
    offset 0, is read back by the check before the rename: a few KB a file, not counted.)"""
    import os

    import k3ckpt.hub.nodefetch as nodefetch_mod

    reread: list[int] = []
    files: list[str] = []

    def counted(real: Any) -> Any:
        def read(fd: int, what: Any, offset: int) -> Any:
            got = real(fd, what, offset)
            if offset and os.readlink(f"/proc/self/fd/{fd}").endswith(".part"):
                reread.append(got if isinstance(got, int) else len(got))
            return got
        return read

    monkeypatch.setattr(os, "pread", counted(os.pread))
    monkeypatch.setattr(os, "preadv", counted(os.preadv))
    real_hash = nodefetch_mod.hash_file
    monkeypatch.setattr(nodefetch_mod, "hash_file", lambda path, **kw: (files.append(str(path)), real_hash(path, **kw))[1])
    return reread, files


def test_node_files_are_hashed_as_they_arrive_and_never_read_back(grouped_hub: Any, resharded: dict[int, Path],
                                                                  tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker's file and tensor digests come from the bytes as they are written (#28): no
    finished file is read, and no byte is read back from a ``.part`` - with one worker and with
    several, whose idle ones join the last files (a file's digest is built from its tensors',
    each hashed by the worker receiving it). The node is reshard's, marker and all."""
    h, _ = grouped_hub
    reread, files = _count_reads_back(monkeypatch)
    topo, node, sizes, _ = CASES[1]
    for workers in ("1", "3"):  # case 1 has 30 node files
        reread.clear()
        dest = tmp_path / workers
        res = fetch_node(h, dest, topo, node, *sizes, "--workers", workers)
        assert res.exit_code == 0, res.output
        assert tree(dest) == tree(resharded[1]) and files == []
        node_bytes = sum(p.stat().st_size for p in dest.glob("*.safetensors"))
        assert node_bytes and sum(reread) == 0, (workers, sum(reread))


@pytest.mark.parametrize("direct", ["on", "off"])
def test_node_files_are_written_with_o_direct_where_aligned(direct: str, grouped_hub: Any, resharded: dict[int, Path],
                                                            tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With K3CKPT_DIRECT_IO on (the default) on a local disk's filesystem, a node file's bytes
    go to the disk with O_DIRECT, as a whole fetch's do: a request that starts off a 4 KiB block
    (tensors lie at any offset) writes only up to the next block through the page cache, and its
    unaligned tail; off, nothing is written with O_DIRECT. The node is reshard's either way."""
    import fcntl
    import os

    if direct == "on" and download.filesystem_of(tmp_path) not in download.DIRECT_IO_FILESYSTEMS:
        pytest.skip("the temporary directory is not on a local disk's filesystem")
    monkeypatch.setenv("K3CKPT_DIRECT_IO", direct)
    writes: list[tuple[bool, int, int]] = []
    pwrite = os.pwrite

    def recording_pwrite(fd: int, data: Any, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".part") and offset >= 4096:  # (past a header)
            writes.append((bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT), offset, len(data)))
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", recording_pwrite)
    h, _ = grouped_hub
    topo, node, sizes, _ = CASES[1]
    res = fetch_node(h, tmp_path / "d", topo, node, *sizes, "--workers", "2")
    assert res.exit_code == 0, res.output
    assert tree(tmp_path / "d") == tree(resharded[1])
    direct_writes = [(o, n) for d, o, n in writes if d]
    buffered = [(o, n) for d, o, n in writes if not d]
    if direct == "off":
        assert buffered and not direct_writes
        return
    assert direct_writes and all(o % 4096 == 0 and n % 4096 == 0 for o, n in direct_writes)
    assert all(n < 4096 for _, n in buffered), [w for w in buffered if w[1] >= 4096][:3]  # only what O_DIRECT cannot take


#: One rank on one GPU with files as large as they come: two node files (dense, rank 0's experts)
#: for four workers, which so share each file from the start.
TWO_FILES = ("--tp", "1", "--dp", "1", "--max-file-size", "1GiB")


@pytest.mark.parametrize("fault", ["none", "corrupt_once"])
def test_node_digests_hold_when_requests_complete_out_of_order_or_fail(
        fault: str, grouped_hub: Any, k3_tiny_grouped: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests of one file completing out of order (four workers on two files, the first
    request of a shard stalled) need no read-back: each tensor is hashed by the worker receiving
    it; a tensor corrupted once (caught by the manifest, fetched again) gives back what it fed its
    digest, with one worker and with four. The node is reshard's,
    marker digests and all."""
    h, served = grouped_hub
    ref = tmp_path / "ref"
    assert run("reshard", str(k3_tiny_grouped), "-o", str(ref), *TWO_FILES, "--node", "0").exit_code == 0
    reread, files = _count_reads_back(monkeypatch)
    shard = "model-00003-of-000008.safetensors"
    hdr = read_header(served / shard)
    expert = next(n for n in hdr.tensors if ".experts.5.w2.weight_packed" in n)
    manifest = tmp_path / "m.json"
    build_manifest(k3_tiny_grouped, tensor_hashes=True).save(manifest)
    for workers in ("1", "4"):
        reread.clear()
        if fault == "none":
            armed = h.inject("stall", shard, times=1, after=100, seconds=0.5)
        else:
            armed = h.inject("corrupt_byte", shard, times=1, offset=hdr.absolute_range(expert)[0] + 1)
        dest = tmp_path / workers
        res = fetch_node(h, dest, TWO_FILES[:4], 0, *TWO_FILES[4:], "--workers", workers, "--manifest", str(manifest))
        assert res.exit_code == 0, res.output
        assert armed.hits == armed.times  # the fault was met
        assert tree(dest) == tree(ref / "node-00000") and files == []  # no finished file is read
        assert sum(reread) == 0, workers  # nor any byte of a .part


def test_a_response_cut_after_its_first_megabyte_gives_back_what_it_fed(tmp_path: Path) -> None:
    """A request whose first 1.5 MB were written and fed to its tensors' digests, then cut (a FIN:
    the bytes before it are read), is retried from its start; what it fed is given back, so the
    digests are of the bytes on disk. Tensors of 2 MB, requests of 8 MiB."""
    from k3ckpt.testing.hub import LoopbackHub

    src = tmp_path / "big"
    assert run("synth", str(src), "--preset", "k3-tiny", "--layers", "2", "--experts", "4", "--moe-intermediate",
               "2048", "--expert-hidden", "2048").exit_code == 0
    assert run("reshard", str(src), "-o", str(tmp_path / "o"), *TWO_FILES, "--node", "0").exit_code == 0
    big = max(src.glob("*.safetensors"), key=lambda p: p.stat().st_size).name
    args = (TWO_FILES[:4], 0, *TWO_FILES[4:], "--workers", "1", "--chunk-size", "8MiB")
    with LoopbackHub({REPO: src}, cache_dir=tmp_path / "hub-cache") as h:
        assert fetch_node(h, tmp_path / "plan", *args, "--dry-run").exit_code == 0
        planning = h.requests(big, method="GET")  # the header reads, which the run makes first too
        armed = h.inject("drop_after", big, times=2, after=1_500_000, reset=False, skip=planning)
        res = fetch_node(h, tmp_path / "d", *args)
        cut = [r for r in h.request_log if r.file == big and r.method == "GET"][2 * planning:2 * planning + 2]
    assert res.exit_code == 0, res.output
    assert armed.hits == 2 and all(r.body_bytes == 1_500_000 for r in cut), cut
    assert tree(tmp_path / "d") == tree(tmp_path / "o" / "node-00000")


@pytest.mark.parametrize("args, message", [
    (("--tp", "2", "--dp", "4", "--ranks", "0-3", "--format", "node"), "--format node writes whole nodes"),
    (("--format", "node"), "--format is for a rank-aware fetch"),
])
def test_usage_errors(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(tmp_path / "d"), *args)
    assert res.exit_code == 2 and message in res.output


def test_other_checkpoints_in_dest_are_refused(grouped_hub: Any, resharded: dict[int, Path], tmp_path: Path) -> None:
    """A node fetch never mixes its files into another checkpoint, nor a whole fetch the hub's
    shards into a node directory; a node fetch of another topology replaces the old plan's files."""
    h, _ = grouped_hub
    topo, node, sizes, _ = CASES[1]
    partial = tmp_path / "partial"
    assert run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(partial), "--endpoint", h.url, "--ep", "8",
               "--tp", "2", "--gpus-per-node", "4", "--node", str(node), "--format", "partial").exit_code == 0
    res = fetch_node(h, partial, topo, node, *sizes)
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "is not a node directory" in res.output
    dest = tmp_path / "node"
    assert fetch_node(h, dest, topo, node, *sizes).exit_code == 0
    res = run("fetch", "--source", "hf", "--repo", REPO, "--dest", str(dest), "--endpoint", h.url)
    assert res.exit_code == 2 and "is a node directory" in res.output and res.output.count("\n") == 1
    assert tree(dest) == tree(resharded[1])
    # the same directory re-fetched as node 0 of one 8-GPU node: node 1's rank files go
    assert fetch_node(h, dest, *CASES[0][:2]).exit_code == 0
    assert tree(dest) == tree(resharded[0])


def test_engine_topology_refused_in_one_line(grouped_hub: Any, tmp_path: Path) -> None:
    h, _ = grouped_hub
    res = fetch_node(h, tmp_path / "d", ("--ep", "4", "--tp", "2", "--world-size", "8", "--gpus-per-node", "4"), 0)
    assert res.exit_code == 2 and res.output.count("\n") == 1
    assert "the engine format needs --ep equal to the world size" in res.output
    assert not (tmp_path / "d").exists()


def _error_line(res: Any) -> str:
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("k3ckpt: error: "), res.output
    return lines[0].removeprefix("k3ckpt: error: ")


@pytest.mark.parametrize(("topo", "fix"), [
    (("--tp", "4", "--dp", "2", "--gpus-per-node", "3"), ("--tp", "4", "--dp", "2", "--gpus-per-node", "4")),
    (("--tp", "2", "--dp", "3", "--gpus-per-node", "4"), ("--tp", "2", "--dp", "3", "--gpus-per-node", "2")),
], ids=["tp-group-across-nodes", "partial-last-node"])
def test_nodes_the_engine_cannot_launch_are_refused_before_the_first_byte(
        grouped_hub: Any, k3_tiny_grouped: Path, tmp_path: Path, topo: tuple[str, ...], fix: tuple[str, ...]) -> None:
    """Issue #25: --tp 4 --dp 2 --gpus-per-node 3 wrote three node directories that only preflight
    then called unservable. plan, reshard and fetch --node now refuse it with one rule, in one
    line naming the command that works (the same options, GPUs per node that fit), before any
    byte (fetch: before any request); preflight's serve row says the same words."""
    h, _ = grouped_hub
    h.reset_counters()
    out, dest = tmp_path / "out", tmp_path / "new" / "node"
    lines = {_error_line(run("plan", str(k3_tiny_grouped), *topo)),
             _error_line(run("reshard", str(k3_tiny_grouped), "-o", str(out), *topo)),
             _error_line(fetch_node(h, dest, topo, 0))}
    assert len(lines) == 1, lines  # one rule, one message
    line = lines.pop()
    assert line.startswith(f"--gpus-per-node {topo[-1]} with {' '.join(topo[:4])}: ") and "vLLM" in line, line
    assert f"; use {' '.join(fix)}" in line, line
    assert not out.exists() and not dest.parent.exists() and h.request_log == []
    # the command it names runs; preflight of that node for the refused launch: the same reason
    assert run("reshard", str(k3_tiny_grouped), "-o", str(out), *fix).exit_code == 0
    pre = run("preflight", str(out / "node-00000"), "--engine", "vllm", *topo, "--node", "0", "--no-env")
    assert pre.exit_code == 1 and f"FAIL  serve         no vllm command for this launch: {line}" in pre.output


def test_a_moe_config_without_its_expert_count_is_refused_before_the_first_byte(
        grouped_hub: Any, tmp_path: Path) -> None:
    """Issue #25: a config.json without text_config.num_experts over tensors holding experts was
    copied into every output, which inspect, verify and preflight then read as a dense model.
    plan, reshard and fetch --node refuse it, naming config.json, the key and what the headers
    show, before writing anything."""
    h, served = grouped_hub
    config = json.loads((served / "config.json").read_text())
    del config["text_config"]["num_experts"]
    (served / "config.json").write_text(json.dumps(config, indent=2))
    h.rescan()
    topo = ("--tp", "2", "--dp", "2")
    out, dest = tmp_path / "out", tmp_path / "node"
    local = _error_line(run("plan", str(served), *topo))
    assert local == _error_line(run("reshard", str(served), "-o", str(out), *topo))
    want = (": text_config.num_experts is missing, but the tensors hold 16 routed experts (0-15, e.g. "
            "language_model.model.layers.1.block_sparse_moe.experts.0.")
    assert local.startswith(f"{served / 'config.json'}{want}") and local.endswith(
        "set text_config.num_experts to 16"), local
    hub = _error_line(fetch_node(h, dest, topo, 0))
    assert "config.json" in hub.split(": ")[0] and want in hub, hub
    assert not out.exists() and not dest.exists()


@pytest.mark.parametrize("groups", [None, 1], ids=["no-group-count", "one-group"])
def test_round_robin_nodes_of_a_model_with_one_expert_group_are_refused_before_the_first_byte(
        served_hub: Any, k3_tiny: Path, tmp_path: Path, groups: int | None) -> None:
    """vLLM serves a round_robin node directory of a one-group model with most of each rank's
    experts never loaded and no error (tests/test_engine_run.py pins it): plan, reshard and
    fetch --node refuse to write one, in one line naming the config's entry and the placement
    that works, before any tensor byte. The rank layout, which no engine reads, still takes it."""
    h, served = served_hub
    src = tmp_path / "src"
    shutil.copytree(k3_tiny, src)
    set_expert_groups(src, groups)
    set_expert_groups(served, groups)
    h.rescan()
    topo = ("--tp", "2", "--dp", "2", "--gpus-per-node", "2", "--placement", "round_robin")
    out, dest = tmp_path / "out", tmp_path / "new" / "node"
    local = _error_line(run("plan", str(src), *topo))
    assert local == _error_line(run("reshard", str(src), "-o", str(out), *topo))
    has = "no n_group or num_expert_group (vLLM reads 1)" if groups is None else "n_group 1"
    want = (f": round_robin placement needs a model with several expert groups, but it has {has}: vLLM would "
            f"place the experts linearly and leave all but about 1 in ep of each rank's expert slots unloaded, "
            f"with no error; use --placement linear")
    assert local == f"{src / 'config.json'}{want}", local
    h.reset_counters()
    hub = _error_line(fetch_node(h, dest, topo, 0))
    assert hub.endswith(want) and "config.json" in hub.split(": ")[0], hub
    assert h.total_bytes_sent() == planning_bytes(served)  # headers, index and config: no tensor byte
    assert not out.exists() and not dest.parent.exists()
    linear = tuple(x.replace("round_robin", "linear") for x in topo)
    assert run("reshard", str(src), "-o", str(out), *linear).exit_code == 0
    rank = run("reshard", str(src), "-o", str(tmp_path / "ranks"), "--format", "rank", "--ep", "4",
               "--placement", "round_robin")
    assert rank.exit_code == 0, rank.output


def test_dry_run_lists_node_files_and_reads_only_headers(grouped_hub: Any, resharded: dict[int, Path],
                                                         tmp_path: Path) -> None:
    h, served = grouped_hub
    topo, node, sizes, _ = CASES[1]
    h.reset_counters()
    res = fetch_node(h, tmp_path / "d", topo, node, *sizes, "--dry-run", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert sorted(data["node_files"]) == sorted(f for f in tree(resharded[1]) if f.endswith(".safetensors"))
    assert data["ranks"] == [4, 5, 6, 7] and data["format"] == "node"
    assert h.total_bytes_sent() == planning_bytes(served) and not (tmp_path / "d").exists()


_CHILD = """
import sys
from k3ckpt.format.topology import RankSelection
from k3ckpt.hub.nodefetch import plan_node_fetch, run_node_fetch
url, repo, dest, chunk = sys.argv[1:5]
sel = RankSelection(tp=2, dp=4, gpus_per_node=4, node=1, placement="round_robin")
plan = plan_node_fetch("hf", repo, dest, sel, endpoint=url, token="", chunk_size=int(chunk), max_file_size=300000)
sys.exit(0 if run_node_fetch(plan, workers=3, token="").ok else 1)
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["after_piece:5", "before_shard_rename"])
def test_sigkill_then_resume_gives_the_same_node(point: str, grouped_hub: Any, resharded: dict[int, Path],
                                                 tmp_path: Path) -> None:
    h, _ = grouped_hub
    dest = tmp_path / "d"
    kill_at_pause(_CHILD, [h.url, REPO, str(dest), str(CHUNK)], point, tmp_path)
    assert not any((dest / f).exists() for f in (INDEX_NAME, "k3ckpt-node.json", "READY"))
    parts = [p for p in dest.glob("*.safetensors.part") if Path(f"{p}.journal").exists()]
    assert parts  # interrupted files wait as .part, never under their final names
    if point == "before_shard_rename":
        assert any(json.loads(Path(f"{p}.journal").read_text())["done"] for p in parts)

    h.reset_counters()
    topo, node, sizes, _ = CASES[1]
    res = fetch_node(h, dest, topo, node, *sizes, "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    tensors = sum(t.nbytes for t in open_checkpoint(resharded[1]).tensors.values())
    fetched_whole = sum(h.files(REPO)[f].size for f in data["fetched"])
    assert data["bytes_downloaded"] - fetched_whole < tensors  # journaled pieces were not fetched again
    assert not list(dest.glob("*.part")) and not list(dest.glob("*.journal"))
    assert not (dest / download.LOCK_NAME).exists()
    assert tree(dest) == tree(resharded[1])


@pytest.mark.parametrize("family", ["k2_tiny", "gptoss_tiny"])
def test_other_families_fetch_the_reshard_node(family: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Kimi-K2 (per-expert FP8 with block scales) and gpt-oss (experts stacked in one tensor per
    projection: all in the dense files) give the same node directory both ways too."""
    from k3ckpt.testing.hub import LoopbackHub

    src: Path = request.getfixturevalue(family)
    topo = ("--tp", "1", "--dp", "4", "--gpus-per-node", "2")  # (gpt-oss-tiny has one KV head: tp 1)
    assert run("reshard", str(src), "-o", str(tmp_path / "o"), *topo, "--node", "1").exit_code == 0
    with LoopbackHub({REPO: src}, cache_dir=tmp_path / "hub-cache") as h:
        res = fetch_node(h, tmp_path / "d", topo, 1)
    assert res.exit_code == 0, res.output
    assert tree(tmp_path / "d") == tree(tmp_path / "o" / "node-00001")


def test_a_single_file_checkpoint_fetches_the_reshard_node(k3_tiny_grouped: Path, tmp_path: Path) -> None:
    """Without an index the marker's ``source_index_sha256`` is the sha256 of the file's header,
    for both producers."""
    from k3ckpt.format.header import TensorSpec, build_header
    from k3ckpt.testing.hub import LoopbackHub

    src = tmp_path / "single"
    src.mkdir()
    specs, data = [], []
    for f in sorted(k3_tiny_grouped.glob("*.safetensors")):
        hdr, raw = read_header(f), f.read_bytes()
        for t in sorted(hdr.tensors.values(), key=lambda t: t.begin):
            specs.append(TensorSpec(t.name, t.dtype, t.shape))
            data.append(raw[hdr.data_start + t.begin:hdr.data_start + t.end])
    prefix, _ = build_header(specs, {"format": "pt"})
    (src / "model.safetensors").write_bytes(prefix + b"".join(data))
    assert open_checkpoint(src).tensors.keys() == open_checkpoint(k3_tiny_grouped).tensors.keys()
    for f in k3_tiny_grouped.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != INDEX_NAME:
            shutil.copy(f, src / f.name)
    topo = ("--tp", "2", "--dp", "4", "--gpus-per-node", "4")
    assert run("reshard", str(src), "-o", str(tmp_path / "o"), *topo, "--node", "0").exit_code == 0
    with LoopbackHub({REPO: src}, cache_dir=tmp_path / "hub-cache") as h:
        res = fetch_node(h, tmp_path / "d", topo, 0)
    assert res.exit_code == 0, res.output
    ref = tmp_path / "o" / "node-00000"
    assert tree(tmp_path / "d") == tree(ref)
    header = read_header(src / "model.safetensors").data_start
    digest = hashlib.sha256((src / "model.safetensors").read_bytes()[:header]).hexdigest()
    assert json.loads((ref / "k3ckpt-node.json").read_text())["source_index_sha256"] == digest


def test_a_shard_the_index_names_in_a_subfolder_is_read_once_the_index_is_in(k3_tiny_grouped: Path, tmp_path: Path) -> None:
    """Planning asks for the top-level shards' headers while the index arrives; a shard the index
    names in a subfolder is not among them, and its header is read once the index is in."""
    from k3ckpt.format.topology import RankSelection
    from k3ckpt.hub.nodefetch import plan_node_fetch
    from k3ckpt.testing.hub import LoopbackHub

    src = tmp_path / "served"
    shutil.copytree(k3_tiny_grouped, src)
    moved = "model-00003-of-000008.safetensors"
    (src / "sub").mkdir()
    (src / moved).rename(src / "sub" / moved)
    index = json.loads((src / INDEX_NAME).read_text())
    index["weight_map"] = {t: f"sub/{f}" if f == moved else f for t, f in index["weight_map"].items()}
    (src / INDEX_NAME).write_text(json.dumps(index))
    with LoopbackHub({REPO: src}, cache_dir=tmp_path / "hub-cache") as h:
        h.inject("stall", INDEX_NAME, times=1, after=64, seconds=1.0)
        plan = plan_node_fetch("hf", REPO, tmp_path / "d", RankSelection(tp=2, dp=4, gpus_per_node=4, node=0),
                               endpoint=h.url, token="")
        log = list(h.request_log)
    index_asked = min(r.started for r in log if r.file == INDEX_NAME)
    asked = [r.started for r in log if r.file == f"sub/{moved}" and r.range == "bytes=0-7"]
    assert len(asked) == 1 and asked[0] > index_asked + 0.9, (index_asked, asked)
    planned = {t.name for f in plan.nd.files for t in f.tensors}
    assert set(read_header(k3_tiny_grouped / moved).tensors) & planned


# ----------------------------------------------------------------------------------------------
# HF_HUB_OFFLINE=1: a restarted air-gapped pod re-runs the same fetch (examples/node-init.sh)
# ----------------------------------------------------------------------------------------------


def test_offline_rerun_checks_the_node_without_the_hub(grouped_hub: Any, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The node-init re-run under HF_HUB_OFFLINE=1: exit 0 for the complete, unchanged node
    (without --manifest: node files trusted by their stat-cache entry, else hashed against the
    marker - not proven, as online; the other files hashed against the recorded listing), not
    one request - the hub is even stopped; a changed node file or a missing file: exit 1 naming
    each; another node: one line, exit 2."""
    h, _ = grouped_hub
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    topo, node, sizes, _ = CASES[1]
    dest = tmp_path / "node"
    assert fetch_node(h, dest, topo, node, *sizes, "--revision", "main").exit_code == 0
    want = tree(dest)
    node_files = sorted(f for f in want if f.endswith(".safetensors"))
    hub_offline(monkeypatch)
    h.reset_counters()
    res = fetch_node(h, dest, topo, node, *sizes, "--revision", "main")
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("not proven (offline, HF_HUB_OFFLINE is set): ") and "hub was not contacted" in res.stdout
    assert f"node {node} (ranks 4-7 of ep 8 = tp 2 x dp 4, round_robin placement)" in res.stdout
    assert res.stdout.splitlines()[-1].startswith("not proven: no --manifest: ")
    assert h.request_log == []
    gone = SimpleNamespace(url=h.url)
    h.stop()  # nothing to ask now: a request would fail the run
    doc = json.loads(fetch_node(gone, dest, topo, node, *sizes, "--json").stdout)
    assert doc["ok"] and not doc["proven"] and doc["offline"] and doc["format"] == "node" and doc["failed"] == {}
    assert doc["trusted"] == node_files  # not read again: their stat is the one recorded when written
    assert sorted(doc["verified"]) == sorted(f for f in want if f not in ("READY", "k3ckpt-node.json", INDEX_NAME))
    assert tree(dest) == want  # an offline check writes nothing

    # a copy's files have other stats: hashed, and still ok
    shutil.copytree(dest, tmp_path / "copy")
    doc = json.loads(fetch_node(gone, tmp_path / "copy", topo, node, *sizes, "--json").stdout)
    assert doc["ok"] and doc["trusted"] == []
    # a copy that verify hashed (by its segments) is trusted from what verify recorded
    shutil.copytree(dest, tmp_path / "copy2")
    assert run("verify", str(tmp_path / "copy2")).exit_code == 0
    doc = json.loads(fetch_node(gone, tmp_path / "copy2", topo, node, *sizes, "--json").stdout)
    assert doc["ok"] and doc["trusted"] == node_files

    victim = node_files[-1]
    flip_byte(dest / victim, (dest / victim).stat().st_size - 3)
    (dest / "tiktoken.model").unlink()
    res = fetch_node(gone, dest, topo, node, *sizes)
    assert res.exit_code == 1, res.output
    lines = res.stdout.splitlines()
    assert lines[0].startswith("FAILED (offline") and "2 missing or damaged" in lines[0]
    assert f"  {victim}: tensor '" in res.stdout and "k3ckpt-node.json records " in res.stdout
    assert "  tiktoken.model: missing" in res.stdout
    assert lines[-1].startswith("  fix: unset HF_HUB_OFFLINE")

    res = fetch_node(gone, dest, topo, 0, *sizes)
    assert_one_line_error(res, 2, "HF_HUB_OFFLINE is set", "is for node 1 (", "not node 0 (")
    # a whole fetch's offline check is not a node's: it says which options fetched the directory
    res = run("fetch", REPO, "--local-dir", str(dest), "--endpoint", gone.url)
    assert_one_line_error(res, 2, "holds a node fetch (--node")


def test_offline_rerun_with_a_manifest_proves_the_node(served_hub: Any, k3_tiny_manifests: dict[str, Path],
                                                       tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --manifest every tensor is hashed against it, as a re-run online does: ok, proven,
    and recorded as such in the stat cache - so the preflight after it, in a restarted pod whose
    stat cache is gone, finds the node proven. A flipped byte, or a marker whose digests are not
    its files': exit 1 naming the file; a manifest without tensor hashes: exit 2, as online."""
    h, _ = served_hub
    topo, node, sizes, _ = CASES[0]
    dest = tmp_path / "node"
    manifest = k3_tiny_manifests["tensors"]
    assert fetch_node(h, dest, topo, node, "--manifest", str(manifest)).exit_code == 0
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "restarted"))  # a fresh container: no stat cache
    assert not json.loads(run("verify", str(dest), "--quick", "--json").stdout)["proven"]
    hub_offline(monkeypatch)
    res = fetch_node(h, dest, topo, node, "--manifest", str(manifest))
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("ok (offline") and "every tensor hashed against the manifest" in res.stdout
    assert json.loads(run("verify", str(dest), "--quick", "--json").stdout)["proven"]
    assert_one_line_error(fetch_node(h, dest, topo, node, "--manifest", str(k3_tiny_manifests["files"])), 2,
                          "no tensor hashes")

    marker = json.loads((dest / "k3ckpt-node.json").read_text())
    name, t = sorted(marker["tensors"].items())[0]
    right, t["sha256"] = t["sha256"], "0" * 64
    (dest / "k3ckpt-node.json").write_text(json.dumps(marker))
    res = fetch_node(h, dest, topo, node, "--manifest", str(manifest), "--json")
    assert res.exit_code == 1
    assert json.loads(res.stdout)["failed"] == {
        t["file"]: f"tensor {name!r}: sha256 {right}, k3ckpt-node.json records {'0' * 64}"}
    assert Manifest.load(manifest).tensors[name].sha256 == right


def test_offline_check_of_an_interrupted_node_fetch(grouped_hub: Any, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A node fetch that did not finish (no READY) recorded its listing first: the offline check
    says what is wrong (exit 1), not that there is nothing to check."""
    h, _ = grouped_hub
    topo, node, sizes, _ = CASES[0]
    dest = tmp_path / "node"
    h.inject("corrupt_byte", "LICENSE", times=None, offset=3)
    assert fetch_node(h, dest, topo, node).exit_code == 1
    hub_offline(monkeypatch)
    res = fetch_node(h, dest, topo, node, "--json")
    assert res.exit_code == 1, res.output
    failed = json.loads(res.stdout)["failed"]
    assert sorted(failed) == ["LICENSE", "READY"] and failed["LICENSE"] == "missing", failed
