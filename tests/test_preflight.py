"""``k3ckpt preflight``: every FAIL path with the command that fixes it, the PASS path, capacity
with fake ``nvidia-smi`` / ``rocm-smi`` executables (real subprocesses), and the CLI."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shlex
import shutil
from pathlib import Path

import pytest

from ckpt_edit import drop_tensors, flip_byte, set_expert_groups
from helpers import run as run_cli
from k3ckpt.deploy import preflight as pf
from k3ckpt.deploy.reshard import reshard
from k3ckpt.format.header import read_header
from k3ckpt.format.topology import RankSelection
from k3ckpt.integrity.manifest import build_manifest
from k3ckpt.integrity.verify import verify_checkpoint

#: No GPU tool on this PATH (the machine has none; tests add fake ones in front).
NO_GPU = {"PATH": "/usr/bin:/bin"}
COMMIT = "0123456789abcdef0123456789abcdef01234567"
NVIDIA_ARGS = "--query-gpu=name,memory.total,memory.used --format=csv,noheader,nounits"
ROCM_ARGS = "--showproductname --showmeminfo vram --json"


@pytest.fixture(scope="module")
def source(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-tiny as `hf download --local-dir` leaves it: its revision is recorded; and, as the
    documented flow does, verified against its pinned manifest (so what is resharded from it is
    proven: docs/trust.md)."""
    src = tmp_path_factory.mktemp("src") / "Kimi-K3"
    shutil.copytree(k3_tiny, src)
    meta = src / ".cache" / "huggingface" / "download" / "config.json.metadata"
    meta.parent.mkdir(parents=True)
    meta.write_text(f"{COMMIT}\netag\n1700000000.0\n")
    pinned = src.parent / "kimi-k3.json"
    build_manifest(src).save(pinned)
    assert verify_checkpoint(src, manifest_path=pinned).proven
    return src


@pytest.fixture(scope="module")
def pristine(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ep 4 x tp 2 (world size 4) of k3-tiny: 16 experts, 4 per rank. Read-only."""
    out = tmp_path_factory.mktemp("layout") / "k3-ep4-tp2"
    reshard(source, out, RankSelection(ep=4, tp=2), layout="rank")
    return out


@pytest.fixture
def layout(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the layout that a test may break."""
    dest = tmp_path / "layout"
    shutil.copytree(pristine, dest)
    return dest


@pytest.fixture(autouse=True)
def every_fail_has_a_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue #25: a FAIL row without a fix line (an MXFP4 split, the launcher's variables, a GPU
    too small...) leaves the operator with a reason and nothing to do. Every report the tests of
    this module produce - through the library or the CLI, which calls the same function - is
    walked: each FAIL row carries a fix."""
    real = pf.preflight

    def checked(*args, **kwargs):
        rep = real(*args, **kwargs)
        bare = [f"{c.name}: {c.reason}" for c in rep.checks if c.status == "FAIL" and not c.fix]
        assert not bare, f"FAIL rows without a fix: {bare}"
        return rep

    monkeypatch.setattr(pf, "preflight", checked)


def fake_tool(bin_dir: Path, name: str, args: str, output: str, code: int = 0) -> dict[str, str]:
    """An executable ``name`` that prints ``output`` when called with exactly ``args``; the
    environment to find it."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / name
    exe.write_text(f"""#!/bin/sh
if [ "$*" != "{args}" ]; then echo "unexpected arguments: $*" >&2; exit 64; fi
cat <<'EOF'
{output}
EOF
exit {code}
""")
    exe.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def b200s(tmp_path: Path, n: int = 2, name: str = "NVIDIA B200") -> dict[str, str]:
    return fake_tool(tmp_path / "bin", "nvidia-smi", NVIDIA_ARGS, "\n".join(f"{name}, 183359, 0" for _ in range(n)))


def rows(rep: pf.PreflightReport) -> dict[str, pf.Check]:
    return {c.name: c for c in rep.checks}


def statuses(rep: pf.PreflightReport) -> dict[str, str]:
    return {c.name: c.status for c in rep.checks}


def run_fix(fix: str) -> None:
    """Run a fix command as a user would paste it."""
    argv = shlex.split(fix)
    assert argv[0] == "k3ckpt"
    res = run_cli(*argv[1:])
    assert res.exit_code == 0, res.output


# -- the PASS path ----------------------------------------------------------------------------


def test_pass_path_node_of_a_rank_layout(pristine: Path, layout: Path, source: Path, tmp_path: Path) -> None:
    env = b200s(tmp_path)
    rep = pf.preflight(pristine, RankSelection(node=1, gpus_per_node=2, ep=4, tp=2), environ=env)
    assert rep.ok and rep.ranks == [2, 3] and rep.layout == "rank-layout"
    assert statuses(rep) == {
        "topology": "PASS", "environment": "PASS", "rank 2": "PASS", "rank 3": "PASS", "disk": "PASS",
        "host memory": "PASS", "gpu": "PASS", "mxfp4": "PASS", "quantization": "PASS", "config": "PASS",
        "tokenizer": "PASS", "license": "PASS", "source": "PASS", "proof": "PASS",
    }
    assert rep.verdict == "ready to load" and f"proven by manifest {source.parent / 'kimi-k3.json'}" in \
        rows(rep)["proof"].reason
    # a copy of it carries no proof: loadable, not "ready" (docs/trust.md); FAIL when proof is required
    copy = pf.preflight(layout, RankSelection(node=1, gpus_per_node=2, ep=4, tp=2), environ=env)
    assert copy.ok and statuses(copy)["proof"] == "WARN" and copy.verdict == "loadable, not proven"
    required = pf.preflight(layout, RankSelection(node=1, gpus_per_node=2, ep=4, tp=2), environ=env,
                            require_proof=True)
    assert not required.ok and statuses(required)["proof"] == "FAIL"
    r = rows(rep)
    assert "ep 4 x tp 2, world size 4" in r["topology"].reason and "as requested" in r["topology"].reason
    assert "natively" in r["mxfp4"].reason and "B200" in r["mxfp4"].reason
    assert "Modified MIT" in r["license"].reason and "not plain MIT" in r["license"].reason
    assert COMMIT in r["source"].reason
    assert r["quantization"].details["mxfp4_tensors"] > 0
    manifest = json.loads((layout / "rank-00002" / "rank-manifest.json").read_text())
    assert r["rank 2"].details["bytes"] == sum(f["size"] for f in manifest["files"].values())
    assert not any(c.fix for c in rep.checks)
    text = pf.render_preflight(rep)
    assert text.splitlines()[-1] == "result     0 FAIL, 0 WARN, 14 PASS: ready to load"



def test_default_ranks_are_all_and_full_hashes_every_file(layout: Path) -> None:
    rep = pf.preflight(layout, full=True, environ=NO_GPU)
    assert rep.ranks == [0, 1, 2, 3] and rep.ok
    assert "sha256 match" in rows(rep)["rank 0"].reason
    assert statuses(rep)["gpu"] == "WARN" and "nvidia-smi nor rocm-smi" in rows(rep)["gpu"].reason


# -- completeness FAILs, each with the command that fixes it -----------------------------------


def test_missing_rank_directory(layout: Path, source: Path) -> None:
    shutil.rmtree(layout / "rank-00003")
    rep = pf.preflight(layout, RankSelection(node=1, gpus_per_node=2), environ=NO_GPU)
    r = rows(rep)["rank 3"]
    assert not rep.ok and r.status == "FAIL" and r.reason == "rank-00003/ missing"
    assert r.fix == f"k3ckpt reshard {source} -o {layout} --format rank --ep 4 --tp 2 --ranks 3"
    assert statuses(rep)["rank 2"] == "PASS" and rep.fix_all is None  # one broken rank: its own fix says it
    run_fix(r.fix)
    assert pf.preflight(layout, RankSelection(node=1, gpus_per_node=2), environ=NO_GPU).ok


def test_missing_ready(layout: Path) -> None:
    (layout / "rank-00000" / "READY").unlink()
    rep = pf.preflight(layout, RankSelection(ranks=[0]), environ=NO_GPU)
    r = rows(rep)["rank 0"]
    assert r.status == "FAIL" and "READY missing" in r.reason and r.fix.endswith("--ranks 0")
    run_fix(r.fix)
    assert pf.preflight(layout, RankSelection(ranks=[0]), environ=NO_GPU).ok


def test_truncated_file(layout: Path) -> None:
    part = layout / "rank-00001" / "model-rank-1-part-0.safetensors"
    size = part.stat().st_size
    os.truncate(part, size - 100)
    rep = pf.preflight(layout, environ=NO_GPU)
    r = rows(rep)["rank 1"]
    assert r.status == "FAIL"
    assert r.reason == f"model-rank-1-part-0.safetensors: {size - 100:,} bytes, manifest says {size:,} (truncated)"
    assert r.fix.endswith("--ranks 1") and "--force" not in r.fix
    assert [c.name for c in rep.checks if c.status == "FAIL"] == ["rank 1"]
    run_fix(r.fix)
    assert pf.preflight(layout, environ=NO_GPU).ok


def test_missing_file_and_stray_file(layout: Path) -> None:
    (layout / "rank-00002" / "model-rank-2-part-0.safetensors").unlink()
    shutil.copy(layout / "rank-00001" / "model-rank-1-part-0.safetensors", layout / "rank-00001" / "extra.safetensors")
    r = rows(pf.preflight(layout, environ=NO_GPU))
    assert r["rank 2"].status == "FAIL" and r["rank 2"].reason == "model-rank-2-part-0.safetensors missing"
    assert r["rank 1"].status == "WARN" and "extra.safetensors" in r["rank 1"].reason


def test_corrupted_file_needs_full_and_its_fix_forces(layout: Path) -> None:
    part = layout / "rank-00002" / "model-rank-2-part-0.safetensors"
    flip_byte(part, part.stat().st_size - 10)
    last = max(read_header(part).tensors.items(), key=lambda kv: kv[1].begin)[0]
    assert pf.preflight(layout, environ=NO_GPU).ok  # sizes match: the default cannot see it
    rep = pf.preflight(layout, full=True, jobs=2, environ=NO_GPU)
    r = rows(rep)["rank 2"]
    # the file's digest is its segments' (docs/layout.md): the tensor that differs is named
    assert r.status == "FAIL" and r.reason.startswith(f"model-rank-2-part-0.safetensors: tensor {last!r}: sha256 ")
    assert r.reason.endswith("(corrupted)")
    assert r.fix.endswith("--ranks 2 --force")  # a plain re-run would skip the rank: its sizes match
    run_fix(r.fix)
    assert pf.preflight(layout, full=True, environ=NO_GPU).ok


@pytest.mark.parametrize("where", ["header padding", "header length"])
def test_full_sees_a_changed_header(layout: Path, where: str) -> None:
    """A rank file's digest covers its header: a byte of the JSON's padding changed (still valid
    safetensors, every tensor intact) and a broken header are both corrupted files."""
    part = layout / "rank-00001" / "model-rank-1-part-0.safetensors"
    raw = bytearray(part.read_bytes())
    if where == "header padding":
        end = 8 + int.from_bytes(raw[:8], "little")
        assert raw[end - 1:end] == b" "
        raw[end - 1:end] = b"\t"  # JSON whitespace too: the header still parses, to the same tensors
    else:
        raw[0] ^= 0x40
    part.write_bytes(bytes(raw))
    assert pf.preflight(layout, environ=NO_GPU).ok  # sizes match
    r = rows(pf.preflight(layout, full=True, environ=NO_GPU))["rank 1"]
    want = "the header differs" if where == "header padding" else "not a safetensors file"
    assert r.status == "FAIL" and want in r.reason and r.reason.endswith("(corrupted)"), r.reason
    assert r.fix.endswith("--ranks 1 --force")


def test_full_checks_a_manifest_that_records_the_plain_sha256(layout: Path) -> None:
    """Rank manifests written before 2026-12-06 record each file's plain sha256 (``sha256``);
    --full still checks those files by it."""
    man = layout / "rank-00003" / "rank-manifest.json"
    m = json.loads(man.read_text())
    for name, entry in m["files"].items():
        del entry["segments_sha256"]
        entry["sha256"] = hashlib.sha256((layout / "rank-00003" / name).read_bytes()).hexdigest()
    man.write_text(json.dumps(m))
    assert pf.preflight(layout, full=True, environ=NO_GPU).ok
    part = layout / "rank-00003" / "model-rank-3-part-0.safetensors"
    flip_byte(part, part.stat().st_size - 10)
    r = rows(pf.preflight(layout, full=True, environ=NO_GPU))["rank 3"]
    assert r.status == "FAIL" and r.reason.startswith("model-rank-3-part-0.safetensors: sha256 ")
    assert r.reason.endswith("(corrupted)")


def test_rank_manifest_of_another_rank_or_source(layout: Path) -> None:
    man = layout / "rank-00001" / "rank-manifest.json"
    shutil.copy(layout / "rank-00000" / "rank-manifest.json", man)
    r = rows(pf.preflight(layout, RankSelection(ranks=[1]), environ=NO_GPU))["rank 1"]
    assert r.status == "FAIL" and "rank 0 (topology says 1)" in r.reason
    m = json.loads((layout / "rank-00003" / "rank-manifest.json").read_text())
    m["source_index_sha256"] = "f" * 64
    (layout / "rank-00003" / "rank-manifest.json").write_text(json.dumps(m))
    r = rows(pf.preflight(layout, RankSelection(ranks=[3]), environ=NO_GPU))["rank 3"]
    assert r.status == "FAIL" and "another source" in r.reason


def test_rank_holding_other_experts(layout: Path) -> None:
    """A manifest whose experts are not those topology.json places on its ep_rank."""
    man = layout / "rank-00000" / "rank-manifest.json"
    m = json.loads(man.read_text())
    m["tensors"] = {n.replace(".experts.3.", ".experts.7."): t for n, t in m["tensors"].items()}
    man.write_text(json.dumps(m))
    r = rows(pf.preflight(layout, RankSelection(ranks=[0]), environ=NO_GPU))["rank 0"]
    assert r.status == "FAIL" and "lacks experts 3 and holds experts 7 of other ranks" in r.reason


# -- topology ---------------------------------------------------------------------------------


def test_topology_mismatch(layout: Path, source: Path) -> None:
    rep = pf.preflight(layout, RankSelection(ep=8, tp=2, node=0, gpus_per_node=4), environ=NO_GPU)
    r = rows(rep)["topology"]
    assert r.status == "FAIL"
    assert "requested --ep 8 (layout has 4), --world-size 8 (layout has 4)" in r.reason
    # the fix reshards this node's ranks of the requested topology into a new directory: the
    # layout here is another topology's, which other nodes may load (never --force over it)
    assert r.fix == f"k3ckpt reshard {source} -o {layout}-ep8-tp2 --format rank --ep 8 --tp 2 --ranks 0-3"
    assert not Path(f"{layout}-ep8-tp2").exists()
    r = rows(pf.preflight(layout, RankSelection(tp=1), environ=NO_GPU))["topology"]
    assert r.status == "FAIL" and "--tp 1 (layout has 2)" in r.reason
    r = rows(pf.preflight(layout, RankSelection(placement="round_robin"), environ=NO_GPU))["topology"]
    assert r.status == "FAIL" and "--placement round_robin (layout has linear)" in r.reason
    assert r.fix == f"k3ckpt reshard {source} -o {layout}-ep4-tp2-round-robin --format rank --ep 4 --tp 2 --placement round_robin"


def test_ranks_means_what_it_means_in_the_other_commands(layout: Path, tmp_path: Path) -> None:
    """Issue #25: ``--ranks`` was one rank in preflight and a list (``0-3,8``) everywhere else;
    preflight reads it with the same parser, so a node's ranks (or any) can be checked."""
    assert pf.preflight(layout, RankSelection(ranks="1"), environ=NO_GPU).ranks == [1]
    for ranks in ("0-1", [0, 1], "1,0"):
        rep = pf.preflight(layout, RankSelection(ranks=ranks), environ=NO_GPU)
        assert rep.ok and rep.ranks == [0, 1] and rep.selection == "--ranks 0-1"
        assert [c.name for c in rep.checks if c.name.startswith("rank ")] == ["rank 0", "rank 1"]
    shutil.rmtree(layout / "rank-00003")
    rep = pf.preflight(layout, RankSelection(ranks="0,2-3"), environ=NO_GPU)
    assert rep.ranks == [0, 2, 3] and statuses(rep)["rank 3"] == "FAIL" and "rank 1" not in statuses(rep)
    # the launcher's rank must be one of them
    env = {**NO_GPU, "RANK": "1"}
    assert "RANK=1 but --ranks 0,2-3" in rows(pf.preflight(layout, RankSelection(ranks="0,2-3"), environ=env))[
        "environment"].reason
    # the CLI: the same parser, the same one-line errors
    res = run_cli("preflight", str(layout), "--ranks", "2-3", "--no-env", "--json", env=NO_GPU)
    assert res.exit_code == 1 and json.loads(res.output)["ranks"] == [2, 3]
    for spec, needle in (("0-x", "'0-x': '0-x' is not a rank or a range a-b"), ("3-1", "range 3-1 is reversed"),
                         ("2-9", "rank 9 out of range 0..3")):
        res = run_cli("preflight", str(layout), "--ranks", spec, env=NO_GPU)
        lines = res.output.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.output


@pytest.mark.parametrize("edit, needle", [
    (lambda tj: "{not json", "not valid JSON"),
    (lambda tj: json.dumps({**tj, "format": "other"}), "not a k3ckpt-rank-layout"),
    (lambda tj: json.dumps({**tj, "ep": 3}), "does not divide world size"),
    (lambda tj: json.dumps({**tj, "experts_by_rank": tj["experts_by_rank"][::-1]}), "experts_by_rank is not"),
])
def test_broken_topology_json(layout: Path, source: Path, edit, needle: str) -> None:
    p = layout / "topology.json"
    p.write_text(edit(json.loads(p.read_text())))
    rep = pf.preflight(layout, environ=NO_GPU)
    r = rows(rep)["topology"]
    assert r.status == "FAIL" and needle in r.reason and not rep.ok
    # rewritten into a new directory: --force here would delete ranks that are not ours to judge
    out = Path(shlex.split(r.fix)[shlex.split(r.fix).index("-o") + 1])
    assert r.fix.startswith("k3ckpt reshard ") and "--force" not in r.fix
    assert out.parent == layout.parent and out.name.startswith("layout-") and not out.exists()


def test_missing_topology_json_with_rank_dirs(layout: Path) -> None:
    (layout / "topology.json").unlink()
    rep = pf.preflight(layout, environ=NO_GPU)
    r = rows(rep)["topology"]
    assert r.status == "FAIL" and "topology.json: not found" in r.reason
    # the source is not recorded anywhere; a new directory, not --force over the rank dirs here
    assert r.fix == f"k3ckpt reshard SRC -o {layout}-resharded --format rank --ep E --tp T"


def test_unrecorded_source_path_is_a_placeholder(layout: Path) -> None:
    p = layout / "topology.json"
    tj = json.loads(p.read_text())
    del tj["source"]["path"], tj["source"]["revision"]
    p.write_text(json.dumps(tj))
    shutil.rmtree(layout / "rank-00001")
    rep = pf.preflight(layout, environ=NO_GPU)
    assert rows(rep)["rank 1"].fix == f"k3ckpt reshard SRC -o {layout} --format rank --ep 4 --tp 2 --ranks 1"
    assert rows(rep)["source"].status == "WARN"


# -- the launcher's environment -----------------------------------------------------------------


@pytest.mark.parametrize("env, kwargs, needle", [
    ({"WORLD_SIZE": "8"}, {}, "WORLD_SIZE=8 but the topology has world size 4"),
    ({"RANK": "3"}, {"ranks": [2]}, "RANK=3 but --ranks 2"),
    ({"SLURM_NTASKS": "2"}, {}, "SLURM_NTASKS=2 but the topology has world size 4"),
    ({"RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, {}, "LOCAL_RANK=0 but RANK=1 is local rank 1"),
    ({"SLURM_NODEID": "0"}, {"node": 1, "gpus_per_node": 2}, "SLURM_NODEID=0 but --node 1"),
    ({"RANK": "0"}, {"node": 1, "gpus_per_node": 2}, "RANK=0 is not one of this node's ranks 2-3"),
    ({"LOCAL_WORLD_SIZE": "8"}, {"node": 0, "gpus_per_node": 2}, "LOCAL_WORLD_SIZE=8 but --gpus-per-node 2"),
    ({"RANK": "x"}, {}, "RANK='x' is not a non-negative integer"),
    ({"JOB_COMPLETION_INDEX": "5"}, {"gpus_per_node": 2}, None),  # node 5 of a 2-node world
])
def test_environment_mismatch(pristine: Path, env: dict[str, str], kwargs: dict, needle: str | None) -> None:
    rep = pf.preflight(pristine, RankSelection(**kwargs), environ={**NO_GPU, **env})
    r = rows(rep)["environment"]
    assert r.status == "FAIL" and not rep.ok, r
    if needle:
        assert needle in r.reason
    # --no-env: the same directory and options pass
    assert pf.preflight(pristine, RankSelection(**kwargs), environ={**NO_GPU, **env}, use_env=False).ok


@pytest.mark.parametrize("env, kwargs, ranks, variable", [
    ({"JOB_COMPLETION_INDEX": "1"}, {"gpus_per_node": 2}, [2, 3], "JOB_COMPLETION_INDEX"),
    ({"SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NTASKS": "4"}, {}, [2, 3], "SLURM_NODEID"),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}, {}, [2, 3],
     "GROUP_RANK"),
    ({"RANK": "2", "WORLD_SIZE": "4"}, {}, [2], "RANK"),
])
def test_ranks_from_the_environment(pristine: Path, env: dict[str, str], kwargs: dict, ranks: list[int],
                                    variable: str) -> None:
    rep = pf.preflight(pristine, RankSelection(**kwargs), environ={**NO_GPU, **env})
    assert rep.ranks == ranks and variable in rep.selection
    assert rows(rep)["environment"].status == "PASS" and rep.ok


# -- capacity ---------------------------------------------------------------------------------


def test_not_enough_disk(layout: Path) -> None:
    """Loading writes nothing into the directory: free space below --min-free-disk is a WARN;
    a FAIL only when ranks still to be written there (their fix rewrites them) do not fit."""
    rep = pf.preflight(layout, environ={**NO_GPU, pf.FREE_BYTES_HOOK: "1000"})
    r = rows(rep)["disk"]
    assert r.status == "WARN" and rep.ok and "1.00 KB free (K3CKPT_PREFLIGHT_FREE_BYTES)" in r.reason
    assert "loading writes nothing here" in r.reason
    # the real statvfs number against a limit no disk meets
    r = rows(pf.preflight(layout, min_free_disk=10**18, environ=NO_GPU))["disk"]
    assert r.status == "WARN" and r.details["need_bytes"] == 10**18 and "(K3CKPT" not in r.reason
    # a rank still to be written counts: exactly enough for the limit alone is not enough then
    shutil.rmtree(layout / "rank-00000")
    limit = 10**6
    r = rows(pf.preflight(layout, min_free_disk=limit, environ={**NO_GPU, pf.FREE_BYTES_HOOK: str(limit)}))["disk"]
    assert r.status == "FAIL" and "for ranks still to be written" in r.reason and r.fix.startswith("free ")


@pytest.fixture
def read_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """``make(src) -> path``: ``src`` seen through a read-only mount - a real read-only bind
    mount where this process may mount (root), else a filesystem whose statvfs says ST_RDONLY."""
    import subprocess

    mounted: list[Path] = []

    def make(src: Path) -> Path:
        view = tmp_path / f"ro-{len(mounted)}"
        view.mkdir()
        binds = [["mount", "--bind", str(src), str(view)], ["mount", "-o", "remount,ro,bind", str(view)]]
        if os.geteuid() == 0 and subprocess.run(binds[0], capture_output=True).returncode == 0:
            mounted.append(view)
            assert subprocess.run(binds[1], capture_output=True).returncode == 0
            with pytest.raises(OSError):
                (view / "probe").write_text("x")
            return view
        view.rmdir()
        real = os.statvfs

        def statvfs(path):
            st = real(path)
            if not Path(path).resolve().is_relative_to(src.resolve()):
                return st
            fields = list(st)
            fields[8] |= os.ST_RDONLY  # f_flag
            return os.statvfs_result(fields)

        monkeypatch.setattr(os, "statvfs", statvfs)
        return src

    yield make
    for view in mounted:
        subprocess.run(["umount", str(view)], check=True)


def test_weights_on_a_read_only_mount_pass_the_disk_check(layout: Path, nodes_pristine: Path, source: Path,
                                                           read_only) -> None:
    """Issue #25: weights on a read-only mount FAILed disk - free space on a filesystem neither
    preflight nor the engine writes. Loading needs none: the row passes and says why; only ranks
    still to be written there cannot be, and that FAILs with the way out."""
    for d, sel in ((read_only(layout), RankSelection()), (read_only(nodes_pristine / "node-00000"), launch(0)),
                   (read_only(source), RankSelection(tp=2, dp=2))):
        rep = pf.preflight(d, sel, environ={**NO_GPU, pf.FREE_BYTES_HOOK: "0"})
        r = rows(rep)["disk"]
        assert r.status == "PASS" and "read-only mount" in r.reason and r.details["read_only"], r
        assert rep.ok, pf.render_preflight(rep)
    shutil.rmtree(layout / "rank-00001")
    r = rows(pf.preflight(read_only(layout), environ=NO_GPU))["disk"]
    assert r.status == "FAIL" and "read-only mount" in r.reason and "remount" in (r.fix or "")


def test_host_memory_is_a_warning(layout: Path) -> None:
    rep = pf.preflight(layout, environ={**NO_GPU, pf.MEM_BYTES_HOOK: "1024"})
    assert rows(rep)["host memory"].status == "WARN" and rep.ok


def test_gpu_too_small_and_too_few(layout: Path, tmp_path: Path) -> None:
    env = fake_tool(tmp_path / "bin", "nvidia-smi", NVIDIA_ARGS, "Tesla T4, 15360, 0\nTesla T4, 15360, 200")
    rep = pf.preflight(layout, RankSelection(node=0, gpus_per_node=2), environ=env)  # 20 GiB KV > 15 GiB
    r = rows(rep)["gpu"]
    assert r.status == "FAIL" and "rank 0 needs" in r.reason and "GPU 0 (Tesla T4)" in r.reason
    assert len(r.details["problems"]) == 2 and not rep.ok
    assert rows(rep)["mxfp4"].status == "WARN"
    assert pf.preflight(layout, RankSelection(node=0, gpus_per_node=2), kv_budget=10**9, environ=env).ok
    rep = pf.preflight(layout, RankSelection(node=0, gpus_per_node=4), environ=b200s(tmp_path / "few", n=1))
    assert rows(rep)["gpu"].status == "FAIL" and "needs device 1 but nvidia-smi shows 1" in rows(rep)["gpu"].reason


def test_gpu_visible_devices_and_hopper(layout: Path, tmp_path: Path) -> None:
    env = fake_tool(tmp_path / "bin", "nvidia-smi", NVIDIA_ARGS,
                    "NVIDIA H100 80GB HBM3, 81559, 81000\nNVIDIA H100 80GB HBM3, 81559, 0\n"
                    "NVIDIA H100 80GB HBM3, 81559, 0")
    # GPU 0 is busy
    assert rows(pf.preflight(layout, RankSelection(node=0, gpus_per_node=2), environ=env))["gpu"].status == "FAIL"
    rep = pf.preflight(layout, RankSelection(node=0, gpus_per_node=2),
                       environ={**env, "CUDA_VISIBLE_DEVICES": "1,2"})
    assert statuses(rep)["gpu"] == "PASS" and rep.ok
    assert "weight-only" in rows(rep)["mxfp4"].reason and "W4A16" in rows(rep)["mxfp4"].reason


def test_rocm_smi(layout: Path, tmp_path: Path) -> None:
    card = {"Card Series": "AMD Instinct MI355X", "VRAM Total Memory (B)": str(288 * 10**9),
            "VRAM Total Used Memory (B)": "0"}
    env = fake_tool(tmp_path / "bin", "rocm-smi", ROCM_ARGS, json.dumps({"card0": card, "card1": card}))
    rep = pf.preflight(layout, RankSelection(node=0, gpus_per_node=2), environ=env)
    assert statuses(rep)["gpu"] == "PASS" and "MI355X" in rows(rep)["mxfp4"].reason
    assert "natively" in rows(rep)["mxfp4"].reason


def test_gpu_tool_failing_is_a_warning(layout: Path, tmp_path: Path) -> None:
    env = fake_tool(tmp_path / "bin", "nvidia-smi", NVIDIA_ARGS, "NVIDIA-SMI has failed: driver not loaded", code=9)
    rep = pf.preflight(layout, environ=env)
    r = rows(rep)["gpu"]
    assert r.status == "WARN" and "nvidia-smi exited 9" in r.reason and rep.ok


# -- provenance -------------------------------------------------------------------------------


@pytest.mark.parametrize("text, kind, status", [
    ("Modified MIT License\n\nCopyright (c) 2026 Moonshot AI", "Modified MIT", "PASS"),
    ("MIT License\n\nPermission is hereby granted, free of charge, to any person", "MIT", "PASS"),
    ("Apache License\n  Version 2.0, January 2004", "Apache-2.0", "PASS"),
    ("LLAMA 3 COMMUNITY LICENSE AGREEMENT", "unrecognized", "WARN"),
])
def test_license_kind(text: str, kind: str, status: str) -> None:
    got, st = pf.license_kind(text)
    assert got.startswith(kind) and st == status


def test_missing_license_and_quantization_mismatch(layout: Path, source: Path) -> None:
    (layout / "LICENSE").unlink()
    cfg = json.loads((layout / "config.json").read_text())
    cfg.pop("quantization_config")
    (layout / "config.json").write_text(json.dumps(cfg))
    rep = pf.preflight(layout, environ=NO_GPU)
    r = rows(rep)
    assert r["license"].status == "FAIL" and r["license"].reason.startswith(f"{layout / 'LICENSE'}: not found")
    # reshard copied the licence from its source: copying it back is the fix (-n: replaces nothing)
    assert r["license"].fix == f"cp -n {source}/LICENSE {layout}/"
    assert r["quantization"].status == "FAIL"
    assert "says no quantization_config but the tensors have" in r["quantization"].reason
    assert "MXFP4 weights" in r["quantization"].reason


# -- plain checkpoints and hf-node copies -------------------------------------------------------


def _keep_experts(ckpt: Path, keep: set[int]) -> None:
    """Drop every routed expert not in ``keep``, as an hf-node copy for those experts would."""
    from k3ckpt.format.checkpoint import open_checkpoint

    c = open_checkpoint(ckpt)
    by_file: dict[str, set[str]] = {}
    for name, role in c.roles.items():
        if role.expert is not None and role.expert not in keep:
            by_file.setdefault(c.tensors[name].file, set()).add(name)
    for names in by_file.values():
        drop_tensors(ckpt, names)


def test_plain_checkpoint_pass(source: Path, tmp_path: Path) -> None:
    rep = pf.preflight(source, RankSelection(ep=4, tp=2, node=1, gpus_per_node=2), environ=b200s(tmp_path))
    assert rep.layout == "checkpoint" and rep.ranks == [2, 3]
    assert {c.name: c.status for c in rep.checks if c.status != "PASS"} == {}
    assert "8 experts ranks 2-3 needs" in rows(rep)["experts"].reason
    rep = pf.preflight(source, full=True, environ=NO_GPU)  # no topology: every expert is needed
    assert rep.ok and "scanned for NaN" in rows(rep)["structure"].reason
    assert "not compared" not in rows(rep)["gpu"].reason  # no GPU tool: not checked at all
    assert rows(rep)["gpu"].status == "WARN"


def test_hf_node_copy_covers_its_node_only(source: Path, clone_checkpoint) -> None:
    node1 = clone_checkpoint(source)
    _keep_experts(node1, set(range(8, 16)))
    rep = pf.preflight(node1, RankSelection(ep=4, tp=2, node=1, gpus_per_node=2), environ=NO_GPU)
    assert rows(rep)["experts"].status == "PASS" and rows(rep)["structure"].status == "PASS"
    rep = pf.preflight(node1, RankSelection(ep=4, tp=2, node=0, gpus_per_node=2), environ=NO_GPU)
    r = rows(rep)["experts"]
    assert r.status == "FAIL" and "lacks 8 expert(s) that ranks 0-1 needs: 0-7" in r.reason
    # not a rank-aware fetch's directory (and not k3ckpt's to write into): the fix fetches the
    # checkpoint beside it
    assert r.fix == f"k3ckpt fetch REPO --revision {COMMIT} --local-dir {node1}-fetched"
    assert rows(pf.preflight(node1, environ=NO_GPU))["experts"].status == "FAIL"
    # a rank-aware fetch's directory: the fix fetches exactly the share of the ranks asked for
    (node1 / "k3ckpt-partial.json").write_text(json.dumps({"experts": list(range(8, 16))}))
    r = rows(pf.preflight(node1, RankSelection(ep=4, tp=2, node=0, gpus_per_node=2), environ=NO_GPU))["experts"]
    assert r.status == "FAIL" and r.fix == f"k3ckpt fetch REPO --revision {COMMIT} --local-dir {node1} --ep 4 --tp 2 --ranks 0-1"


def test_plain_checkpoint_missing_shard(source: Path, clone_checkpoint) -> None:
    c = clone_checkpoint(source)
    (c / "model-00003-of-000008.safetensors").unlink()
    rep = pf.preflight(c, environ=NO_GPU)
    r = rows(rep)["structure"]
    assert r.status == "FAIL" and "model-00003-of-000008.safetensors" in r.reason
    # hf download's directory (a copy of one): k3ckpt never writes into it, the client adds the file
    assert r.fix == f"hf download REPO model-00003-of-000008.safetensors --revision {COMMIT} --local-dir {c}"


def test_plain_stacked_experts(gptoss_tiny: Path) -> None:
    rep = pf.preflight(gptoss_tiny, RankSelection(ep=2), environ=NO_GPU)
    assert statuses(rep)["experts"] == "PASS" and statuses(rep)["structure"] == "PASS"
    assert statuses(rep)["license"] == "PASS" and "Apache" in rows(rep)["license"].reason


def test_tp_and_dp_mean_vllms_expert_parallel_without_engine(source: Path) -> None:
    """Issue #25: ``preflight DIR --tp 4 --dp 2 --node 0 --gpus-per-node 4`` without ``--engine``
    read the flags as ep 1 (experts cut 8 ways) and FAILed on an MXFP4 split with no fix line.
    --tp/--dp mean what they mean in plan and reshard: ep = tp x dp."""
    args = ["--tp", "4", "--dp", "2", "--node", "0", "--gpus-per-node", "4", "--no-env"]
    res = run_cli("preflight", str(source), *args, "--json", env=NO_GPU)
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert (data["topology"]["ep"], data["topology"]["tp"], data["topology"]["world_size"]) == (8, 4, 8)
    assert data["ranks"] == [0, 1, 2, 3]
    # an --ep given is taken as given: the cut that cannot be made FAILs, and its fix is the check
    # of vLLM's launch, which passes
    rep = pf.preflight(source, RankSelection(ep=1, tp=4, dp=2, node=0, gpus_per_node=4), environ=NO_GPU)
    r = rows(rep)["topology"]
    assert r.status == "FAIL" and "does not split 8 ways" in r.reason and "ep = tp x dp" in r.reason
    assert r.fix == f"k3ckpt preflight {source} --tp 4 --dp 2 --node 0 --gpus-per-node 4"
    assert run_cli(*shlex.split(r.fix)[1:], "--no-env", env=NO_GPU).exit_code == 0


def test_plain_checkpoint_needs_topology_for_a_rank(source: Path) -> None:
    with pytest.raises(pf.PreflightError, match="need --ep/--tp"):
        pf.preflight(source, RankSelection(ranks=[0]), environ=NO_GPU)


# -- read speed -------------------------------------------------------------------------------


def test_io_test_reads_the_node_files(layout: Path) -> None:
    rep = pf.preflight(layout, RankSelection(node=1, gpus_per_node=2), io_test=60, environ=NO_GPU)
    node_files = [p for r in (2, 3) for p in (layout / f"rank-{r:05d}").glob("*.safetensors")]
    node_bytes = sum(p.stat().st_size for p in node_files)
    rs = rep.read_speed
    assert rs is not None and rs.files == len(node_files) == 4 and rs.readers == 2  # dense + experts part each
    assert rs.bytes_read == node_bytes == rep.node_bytes  # tiny files: read to the end
    r = rows(rep)["read speed"]
    assert r.details["predicted_load_seconds"] is not None and r.details["bytes_per_second"] > 0
    assert rs.direct and r.status == "PASS" and "O_DIRECT" in r.reason


def test_io_test_without_o_direct(layout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # This kernel's tmpfs accepts O_DIRECT (Linux >= 6.6); older tmpfs and some FUSE filesystems
    # refuse it with EINVAL, injected here.
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", no_direct)
    rep = pf.preflight(layout, RankSelection(ranks=[0]), io_test=60, environ=NO_GPU)
    rs = rep.read_speed
    assert rs is not None and not rs.direct and rs.bytes_read == rep.node_bytes
    r = rows(rep)["read speed"]
    assert r.status == "WARN" and "buffered" in r.reason and "POSIX_FADV_DONTNEED" in r.reason


def test_io_test_read_error_is_a_fail(layout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def eio(*a):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", eio)  # a failing disk cannot be made on demand
    r = rows(pf.preflight(layout, RankSelection(ranks=[0]), io_test=5, environ=NO_GPU))["read speed"]
    assert r.status == "FAIL" and "Input/output error" in r.reason


# -- CLI --------------------------------------------------------------------------------------


def test_cli_text_json_and_exit_codes(layout: Path, tmp_path: Path) -> None:
    env = {**b200s(tmp_path, n=4), "RANK": "", "WORLD_SIZE": "", "LOCAL_RANK": ""}
    res = run_cli("preflight", str(layout), "--node", "0", "--gpus-per-node", "2", "--ep", "4", "--tp", "2", env=env)
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[-1].startswith("result     0 FAIL")
    res = run_cli("preflight", str(layout), "--node", "0", "--gpus-per-node", "2", "--json", env=env)
    data = json.loads(res.output)
    assert res.exit_code == 0 and data["ok"] and data["ranks"] == [0, 1]
    assert {c["name"] for c in data["checks"]} >= {"topology", "rank 0", "rank 1", "disk", "gpu", "license"}
    (layout / "rank-00001" / "READY").unlink()
    res = run_cli("preflight", str(layout), "--node", "0", "--gpus-per-node", "2", env=env)
    assert res.exit_code == 1
    fail = [line for line in res.output.splitlines() if line.startswith("FAIL")]
    assert len(fail) == 1 and "rank 1" in fail[0]
    assert "fix: k3ckpt reshard" in res.output
    res = run_cli("preflight", str(layout), "--json", env=env)
    data = json.loads(res.output)
    assert res.exit_code == 1 and not data["ok"] and data["counts"]["FAIL"] == 1
    assert next(c for c in data["checks"] if c["name"] == "rank 1")["fix"].endswith("--ranks 1")
    # several broken ranks: one command for all of them, forced when any content is wrong
    shutil.rmtree(layout / "rank-00003")
    part = layout / "rank-00002" / "model-rank-2-part-0.safetensors"
    flip_byte(part, part.stat().st_size - 1)
    res = run_cli("preflight", str(layout), "--full", "--json", env=env)
    data = json.loads(res.output)
    assert data["counts"]["FAIL"] == 3 and data["fix_all"].endswith("--ranks 1-3 --force")
    run_fix(data["fix_all"])
    assert run_cli("preflight", str(layout), "--full", env=env).exit_code == 0


@pytest.mark.parametrize("args, needle", [
    (["--rank", "0", "--node", "0", "--gpus-per-node", "2"], "give --ranks or --node, not both"),
    (["--node", "0"], "--node needs --gpus-per-node"),
    (["--rank", "9"], "--ranks '9': rank 9 out of range 0..3"),
    (["--node", "5", "--gpus-per-node", "2"], "--node 5 out of range"),
])
def test_cli_cannot_run(pristine: Path, args: list[str], needle: str) -> None:
    res = run_cli("preflight", str(pristine), *args, env=NO_GPU)
    lines = res.output.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("k3ckpt: error:") and needle in lines[0]


def test_cli_not_a_layout_nor_a_checkpoint(tmp_path: Path) -> None:
    res = run_cli("preflight", str(tmp_path / "nope"))
    assert res.exit_code == 2 and "no such directory" in res.output
    res = run_cli("preflight", str(tmp_path))
    assert res.exit_code == 2 and "neither a rank layout" in res.output and len(res.output.strip().splitlines()) == 1


def test_bad_hook_value(pristine: Path) -> None:
    res = run_cli("preflight", str(pristine), env={**NO_GPU, pf.FREE_BYTES_HOOK: "lots"})
    assert res.exit_code == 2 and "K3CKPT_PREFLIGHT_FREE_BYTES='lots' is not a byte count" in res.output


# -- node directories and the engine's launch (--engine) -------------------------------------------

LEADER = "kimi-k3-0.kimi-k3.default"


@pytest.fixture(scope="module")
def nodes_pristine(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-tiny (16 experts) as 2 node directories of vLLM TP 2 x DP 2 (EP 4), 2 GPUs per node:
    node 0 holds experts 0-7 (ranks 0-1), node 1 experts 8-15. Read-only."""
    out = tmp_path_factory.mktemp("nodes") / "k3-tp2-dp2"
    reshard(source, out, RankSelection(tp=2, dp=2, gpus_per_node=2))
    return out


@pytest.fixture
def nodes(nodes_pristine: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "k3-tp2-dp2"
    shutil.copytree(nodes_pristine, dest)
    return dest


def launch(node: int, *, tp: int = 2, dp: int = 2, **kw) -> RankSelection:
    return RankSelection(tp=tp, dp=dp, node=node, gpus_per_node=2, **kw)


def index_of_dir(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def drop_file(d: Path, name: str) -> None:
    """Delete one file of a node directory and its index entries (the index stays consistent)."""
    (d / name).unlink()
    index = index_of_dir(d)
    index["weight_map"] = {t: f for t, f in index["weight_map"].items() if f != name}
    (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


@pytest.mark.parametrize("node", [0, 1])
def test_engine_pass_on_each_node_and_its_serve_line(nodes_pristine: Path, source: Path, node: int) -> None:
    d = nodes_pristine / f"node-0000{node}"
    rep = pf.preflight(d, launch(node), engine="vllm", leader_address=LEADER, environ=NO_GPU)
    assert rep.ok and rep.layout == "node-dir" and rep.engine == "vllm" and rep.ranks == [2 * node, 2 * node + 1]
    st = statuses(rep)
    assert {k: st[k] for k in ("launch", "structure", "dense", "experts", "exact")} == dict.fromkeys(
        ("launch", "structure", "dense", "experts", "exact"), "PASS")
    assert f"experts {'0-7' if node == 0 else '8-15'}" not in rows(rep)["exact"].reason
    dp_flags = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", LEADER,
                "--data-parallel-rpc-port", "13345"]
    head = ["vllm", "serve", str(d), "--trust-remote-code", "--tensor-parallel-size", "2", "--enable-expert-parallel",
            "--enable-ep-weight-filter", "--expert-placement-strategy", "linear"]
    worker = ["--headless", "--data-parallel-start-rank", "1"] if node else []
    assert rep.serve == head + dp_flags + worker
    assert pf.render_preflight(rep).splitlines()[-1] == "serve      " + shlex.join(rep.serve)
    # the library function is the one home of the line
    assert rep.serve == pf.serve_command(d, tp=2, dp=2, node=node, gpus_per_node=2, leader_address=LEADER)


def test_an_hf_cache_repo_folder_is_served_from_its_snapshot(nodes_pristine: Path, tmp_path: Path) -> None:
    """Issue #25: preflight of ``models--org--name`` said "ready" with a serve line naming that
    folder, which holds no config.json; it now checks and serves the snapshot refs/main names."""
    commit = "c" * 40
    repo_dir = tmp_path / "models--org--name"
    snap = repo_dir / "snapshots" / commit
    shutil.copytree(nodes_pristine / "node-00000", snap)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    rep = pf.preflight(repo_dir, launch(0), engine="vllm", leader_address=LEADER, environ=NO_GPU)
    assert rep.ok and rep.serve is not None
    assert rep.serve[:3] == ["vllm", "serve", str(snap)] and (Path(rep.serve[2]) / "config.json").is_file()


def test_full_checks_the_marker_digests_and_a_flipped_byte_fails(nodes: Path) -> None:
    """Issue #25: ``preflight --full`` of a node directory with one expert byte flipped said
    "ready to load" (the marker's digests were not checked). A flip that keeps the file's mtime
    passes the stat checks, so only --full sees it: the proof row FAILs, naming the tensor."""
    d = nodes / "node-00001"
    f = d / "model-rank-00003-experts-00001-of-00001.safetensors"
    st = f.stat()
    flip_byte(f, f.stat().st_size - 100)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    rep = pf.preflight(d, launch(1), engine="vllm", environ=NO_GPU, full=True)
    proof = rows(rep)["proof"]
    assert not rep.ok and proof.status == "FAIL" and rep.verdict == "not ready"
    assert f.name in proof.reason and "tensor bytes differ from k3ckpt-node.json's record" in proof.reason
    assert proof.fix == f"k3ckpt verify {d.resolve()}"


def test_engine_is_the_default_for_a_node_directory_and_the_marker_gives_the_launch(nodes_pristine: Path) -> None:
    rep = pf.preflight(nodes_pristine / "node-00001", environ=NO_GPU)
    assert rep.ok and rep.engine == "vllm" and rep.ranks == [2, 3] and "k3ckpt-node.json" in rep.selection
    assert rep.serve is not None and "LEADER_ADDRESS" in rep.serve  # no leader known: the placeholder
    assert rep.topology is not None and (rep.topology["tp"], rep.topology["dp"]) == (2, 2)


@pytest.mark.parametrize("tp, dp, why", [
    (1, 4, "--tp 1 (k3ckpt-node.json has 2)"),  # the same experts, another TP: vLLM would still shard dense weights 1-way
    (2, 4, "--dp 4 (k3ckpt-node.json has 2)"),  # EP 8: node 0's ranks own experts 0-3 only
])
def test_engine_wrong_tp_or_dp_fails_with_the_reshard_that_fixes_it(nodes: Path, source: Path, tp: int, dp: int,
                                                                   why: str) -> None:
    d = nodes / "node-00000"
    rep = pf.preflight(d, launch(0, tp=tp, dp=dp), engine="vllm", environ=NO_GPU)
    r = rows(rep)
    assert not rep.ok and r["launch"].status == "FAIL" and why in r["launch"].reason
    # another topology: a new output directory (never --force over the one other nodes load)
    fix = f"k3ckpt reshard {source} -o {nodes}-tp{tp}-dp{dp} --tp {tp} --dp {dp} --gpus-per-node 2 --node 0"
    assert r["launch"].fix == fix and not Path(f"{nodes}-tp{tp}-dp{dp}").exists()
    if tp * dp == 8:
        assert r["exact"].status == "FAIL" and "experts 4-7" in r["exact"].reason
    else:
        assert r["experts"].status == r["exact"].status == "PASS"
    run_fix(fix)
    assert pf.preflight(Path(f"{nodes}-tp{tp}-dp{dp}") / "node-00000", launch(0, tp=tp, dp=dp), engine="vllm",
                        environ=NO_GPU).ok
    assert pf.preflight(d, launch(0), engine="vllm", environ=NO_GPU).ok  # the old layout is untouched


def test_engine_wrong_node(nodes_pristine: Path, source: Path) -> None:
    rep = pf.preflight(nodes_pristine / "node-00000", launch(1), engine="vllm", environ=NO_GPU)
    r = rows(rep)
    assert [c.name for c in rep.checks if c.status == "FAIL"] == ["launch", "experts", "exact"]
    assert "--node 1 (k3ckpt-node.json has 0)" in r["launch"].reason
    assert r["experts"].reason.startswith("rank 2 lacks (all or some tensors of) experts 8-11")
    assert "holds experts 0-7 that no rank of node 1 owns" in r["exact"].reason
    # the same topology's node 1 belongs beside node 0 (reshard skips it when complete): no --force
    assert r["exact"].fix == f"k3ckpt reshard {source} -o {nodes_pristine} --tp 2 --dp 2 --gpus-per-node 2 --node 1"


def test_engine_missing_expert_file(nodes: Path, source: Path) -> None:
    d = nodes / "node-00001"
    drop_file(d, "model-rank-00003-experts-00001-of-00001.safetensors")
    rep = pf.preflight(d, launch(1), engine="vllm", environ=NO_GPU)
    r = rows(rep)
    assert [c.name for c in rep.checks if c.status == "FAIL"] == ["experts"]
    assert r["experts"].reason.startswith("rank 3 lacks (all or some tensors of) experts 12-15")
    run_fix(r["experts"].fix or "")
    assert pf.preflight(d, launch(1), engine="vllm", environ=NO_GPU).ok


def test_engine_one_tensor_of_an_expert_missing(nodes: Path) -> None:
    d = nodes / "node-00000"
    gone = {n for n in index_of_dir(d)["weight_map"]
            if ".layers.2." in n and ".experts.5." in n and n.endswith("w2.weight_scale")}
    assert len(gone) == 1
    drop_tensors(d, gone)
    rep = pf.preflight(d, launch(0), engine="vllm", environ=NO_GPU)
    r = rows(rep)["experts"]
    assert r.status == "FAIL" and "rank 1 lacks" in r.reason and "expert 5 in layer 2" in r.reason


def test_engine_extra_expert(nodes: Path) -> None:
    """Another node's rank file added to node 0, index and all: vLLM would load, but the directory
    is not node 0's."""
    d0, d1 = nodes / "node-00000", nodes / "node-00001"
    name = "model-rank-00002-experts-00001-of-00001.safetensors"
    shutil.copy(d1 / name, d0 / name)
    index = index_of_dir(d0)
    index["weight_map"].update({t: f for t, f in index_of_dir(d1)["weight_map"].items() if f == name})
    (d0 / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    rep = pf.preflight(d0, launch(0), engine="vllm", environ=NO_GPU)
    # verify's structure check says it too, from the marker's expert list
    assert [c.name for c in rep.checks if c.status == "FAIL"] == ["structure", "exact"]
    assert "experts not in this node's share: 8, 9, 10, 11" in rows(rep)["structure"].reason
    assert "holds experts 8-11 that no rank of node 0 owns" in rows(rep)["exact"].reason


def test_engine_on_a_full_checkpoint_warns_of_extra_experts(source: Path) -> None:
    rep = pf.preflight(source, launch(1), engine="vllm", environ=NO_GPU)
    assert rep.ok and statuses(rep)["launch"] == "WARN" and statuses(rep)["exact"] == "WARN"
    assert statuses(rep)["experts"] == "PASS"


def test_engine_sglang_refuses_round_robin_and_says_its_flags(grouped_source: Path, nodes_pristine: Path,
                                                              tmp_path: Path) -> None:
    rr = tmp_path / "rr"
    reshard(grouped_source, rr, RankSelection(tp=2, dp=2, gpus_per_node=2, placement="round_robin"))
    # (vLLM loads round_robin for a model with expert groups: no FAIL there)
    vllm = pf.preflight(rr / "node-00000", launch(0), engine="vllm", environ=NO_GPU)
    assert [c.name for c in vllm.checks if c.status == "FAIL"] == []
    rep = pf.preflight(rr / "node-00000", launch(0), engine="sglang", environ=NO_GPU)
    r = rows(rep)["sglang"]
    assert r.status == "FAIL" and "round_robin placement" in r.reason and not rep.ok
    assert r.fix == f"k3ckpt reshard {grouped_source} -o {rr}-tp2-dp2 --tp 2 --dp 2 --gpus-per-node 2 --node 0"
    ok = pf.preflight(nodes_pristine / "node-00001", launch(1), engine="sglang", leader_address="10.0.0.1",
                      environ=NO_GPU)
    assert ok.ok and rows(ok)["sglang"].status == "PASS"
    assert ok.serve == ["python", "-m", "sglang.launch_server", "--model-path", str(nodes_pristine / "node-00001"),
                        "--trust-remote-code", "--tp-size", "4", "--ep-size", "4", "--enable-dp-attention",
                        "--dp-size", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000"]


def test_sglang_refuses_uneven_experts(k3_tiny: Path, tmp_path: Path) -> None:
    """16 experts over EP 6 (TP 2 x DP 3) divide unevenly: vLLM places them, SGLang asserts."""
    out = tmp_path / "uneven"
    reshard(k3_tiny, out, RankSelection(tp=2, dp=3, gpus_per_node=2))
    sel = RankSelection(tp=2, dp=3, node=2, gpus_per_node=2)
    assert pf.preflight(out / "node-00002", sel, engine="vllm", environ=NO_GPU).ok
    rep = pf.preflight(out / "node-00002", sel, engine="sglang", environ=NO_GPU)
    assert "16 experts do not divide by ep 6" in rows(rep)["sglang"].reason
    # no linear layout of 16 experts over 6 ranks for SGLang: the fix is the check of vLLM's launch
    fix = rows(rep)["sglang"].fix or ""
    assert fix == f"k3ckpt preflight {out / 'node-00002'} --engine vllm --tp 2 --dp 3 --node 2 --gpus-per-node 2"
    assert run_cli(*shlex.split(fix)[1:], "--no-env", env=NO_GPU).exit_code == 0


def test_engine_launcher_disagreeing_with_the_node_fails(nodes_pristine: Path) -> None:
    env = {**NO_GPU, "LWS_WORKER_INDEX": "0", "LWS_GROUP_SIZE": "2"}
    rep = pf.preflight(nodes_pristine / "node-00001", launch(1), environ=env)
    r = rows(rep)["environment"]
    assert r.status == "FAIL" and "LWS_WORKER_INDEX=0 but --node 1" in r.reason


@pytest.mark.parametrize("env, node, variable", [
    # srun --ntasks-per-node=1: SLURM_PROCID / SLURM_NTASKS count nodes, not GPU ranks
    ({"SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_LOCALID": "0",
      "SLURM_NTASKS_PER_NODE": "1"}, 1, "SLURM_NODEID"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "2"}, 1, "SLURM_PROCID"),
    ({"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2", "LWS_LEADER_ADDRESS": LEADER}, 1, "LWS_WORKER_INDEX"),
])
def test_one_process_per_node_launchers(nodes_pristine: Path, pristine: Path, env: dict[str, str], node: int,
                                        variable: str) -> None:
    rep = pf.preflight(nodes_pristine / f"node-0000{node}", RankSelection(tp=2, dp=2, gpus_per_node=2),
                       environ={**NO_GPU, **env})
    assert rep.ok, pf.render_preflight(rep)
    assert rows(rep)["environment"].status == "PASS" and variable in rep.selection and rep.ranks == [2, 3]
    assert rep.serve is not None and "--headless" in rep.serve
    if "LWS_LEADER_ADDRESS" in env:
        assert rep.serve[rep.serve.index("--data-parallel-address") + 1] == LEADER
    # a rank layout reads the same launch the same way
    lay = pf.preflight(pristine, RankSelection(gpus_per_node=2), environ={**NO_GPU, **env})
    assert lay.ok and lay.ranks == [2, 3]


def test_engine_cli_json_text_and_exit_codes(nodes_pristine: Path, pristine: Path) -> None:
    d = nodes_pristine / "node-00001"
    res = run_cli("preflight", str(d), "--engine", "vllm", "--tp", "2", "--dp", "2", "--node", "1",
                  "--gpus-per-node", "2", "--leader-address", "gpu01", "--no-env", "--json", env=NO_GPU)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["engine"] == "vllm" and out["serve"][:3] == ["vllm", "serve", str(d)]
    assert out["serve"][out["serve"].index("--data-parallel-address") + 1] == "gpu01"
    res = run_cli("preflight", str(d), "--tp", "2", "--dp", "2", "--node", "0", "--gpus-per-node", "2", "--no-env",
                  env=NO_GPU)
    assert res.exit_code == 1 and "fix: k3ckpt reshard" in res.output
    assert res.output.splitlines()[-1].startswith("serve      vllm serve ")
    res = run_cli("preflight", str(pristine), "--engine", "vllm", "--no-env", env=NO_GPU)
    assert res.exit_code == 2 and "rank layout" in res.output and len(res.output.strip().splitlines()) == 1
    res = run_cli("serve-command", str(d), "--tp", "2", "--dp", "2", "--node", "1", "--gpus-per-node", "2",
                  "--leader-address", "gpu01")
    assert res.exit_code == 0 and res.stdout.strip() == shlex.join(out["serve"])


@pytest.mark.parametrize("variable", ["MASTER_ADDR", "LWS_LEADER_ADDRESS"])
def test_serve_command_and_preflight_read_the_leader_alike(nodes_pristine: Path, variable: str) -> None:
    """Issue #25: with MASTER_ADDR set, serve-command printed the LEADER_ADDRESS placeholder while
    preflight used the address; both take it from the launcher's variables (else the placeholder),
    so both print the same line."""
    d = nodes_pristine / "node-00001"
    args = ["--tp", "2", "--dp", "2", "--node", "1", "--gpus-per-node", "2"]
    for env in ({**NO_GPU, variable: "gpu07"}, NO_GPU):
        served = run_cli("serve-command", str(d), *args, env=env)
        checked = run_cli("preflight", str(d), *args, env=env)
        assert served.exit_code == 0 and checked.exit_code == 0, checked.output
        assert served.stdout.strip() == checked.output.splitlines()[-1].removeprefix("serve").strip()
        assert ("--data-parallel-address gpu07" in served.output) == (variable in env)
        assert ("LEADER_ADDRESS " in served.output) == (variable not in env)
    # --leader-address wins over the variable, in both
    served = run_cli("serve-command", str(d), *args, "--leader-address", "gpu01", env={**NO_GPU, variable: "gpu07"})
    assert "--data-parallel-address gpu01" in served.output


@pytest.mark.parametrize("with_manifest", [False, True])
def test_engine_rank_aware_fetch_is_fixed_by_fetching_the_launchs_share(served_hub, k3_tiny_manifests, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch,
                                                                         with_manifest: bool) -> None:
    """A `fetch --node` copy checked for another node: the fix is the rank-aware fetch of that
    node (from the hub its fetch recorded) into a new directory - never over node 0's share -
    in today's words (REPO_ID, --local-dir, --tp/--dp) and, when the first fetch verified its
    tensors against a manifest, against that manifest too (issue #25: it was dropped); that
    directory is exactly node 1's."""
    h, _ = served_hub
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    manifest = tmp_path / "kimi-k3.tensors.json"
    shutil.copy(k3_tiny_manifests["tensors"], manifest)
    dest = tmp_path / "node"
    given = ["--manifest", manifest.name] if with_manifest else []  # relative, as typed
    res = run_cli("fetch", "moonshotai/Kimi-K3", "--local-dir", str(dest), "--endpoint", h.url,
                  "--tp", "2", "--dp", "2", "--node", "0", "--gpus-per-node", "2", *given)
    assert res.exit_code == 0, res.output
    assert pf.preflight(dest, launch(0), engine="vllm", environ=NO_GPU).ok
    rep = pf.preflight(dest, launch(1), engine="vllm", environ=NO_GPU)
    r = rows(rep)
    assert "--node 1 (k3ckpt-node.json has 0)" in r["launch"].reason
    fix = r["launch"].fix or ""
    assert fix.startswith("k3ckpt fetch moonshotai/Kimi-K3 --revision ")
    tail = f"--local-dir {dest}-node1-tp2-dp2 --tp 2 --dp 2 --node 1 --gpus-per-node 2"
    assert fix.endswith(tail + (f" --manifest {manifest}" if with_manifest else "")), fix
    res = run_cli(*shlex.split(fix)[1:], "--endpoint", h.url, "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["verification"] == ("tensor-sha256" if with_manifest else "structure-and-sizes")
    assert pf.preflight(Path(f"{dest}-node1-tp2-dp2"), launch(1), engine="vllm", environ=NO_GPU).ok
    assert pf.preflight(dest, launch(0), engine="vllm", environ=NO_GPU).ok


# -- a launch without expert parallelism (--no-expert-parallel) -----------------------------------


def test_no_expert_parallel_fails_a_node_the_same_tp_and_dp_would_load_with_ep(nodes_pristine: Path) -> None:
    """Node 0 of TP 2 x DP 2 (experts 0-7 of 16) is exactly right for the expert-parallel launch,
    and wrong for the same TP and DP without ``--enable-expert-parallel``: there every rank reads
    every expert, cut by TP. Only the launch differs, so only the experts row FAILs, and its fix
    is the launch the directory was written for (vLLM itself loads it and answers wrong, #26)."""
    d = nodes_pristine / "node-00000"
    assert pf.preflight(d, launch(0), engine="vllm", leader_address=LEADER, environ=NO_GPU).ok
    rep = pf.preflight(d, launch(0), engine="vllm", leader_address=LEADER, environ=NO_GPU, expert_parallel=False)
    assert not rep.ok and [c.name for c in rep.checks if c.status == "FAIL"] == ["experts"]
    assert statuses(rep)["launch"] == "PASS" and "without it" in rows(rep)["launch"].reason
    experts = rows(rep)["experts"]
    assert "rank 0 lacks" in experts.reason and "experts 8-15" in experts.reason
    assert "without expert parallelism every rank reads all 16 experts" in experts.reason
    assert experts.fix == shlex.join(pf.serve_command(d, tp=2, dp=2, node=0, gpus_per_node=2, leader_address=LEADER))
    assert "--enable-expert-parallel" in experts.fix
    assert rep.to_json()["topology"]["expert_parallel"] is False


def test_no_expert_parallel_passes_a_directory_holding_every_expert(source: Path, tmp_path: Path) -> None:
    """One node of TP 2 (all 16 experts) and a whole checkpoint serve a launch without expert
    parallelism: nothing FAILs."""
    reshard(source, tmp_path / "one", RankSelection(tp=2))
    for d in (tmp_path / "one" / "node-00000", source):
        rep = pf.preflight(d, RankSelection(tp=2), engine="vllm", environ=NO_GPU, expert_parallel=False)
        assert rep.ok, [(c.name, c.reason) for c in rep.checks if c.status == "FAIL"]
        assert statuses(rep)["experts"] == "PASS" and "16 experts" in rows(rep)["experts"].reason


def test_no_expert_parallel_cli(nodes_pristine: Path) -> None:
    d = nodes_pristine / "node-00000"
    res = run_cli("preflight", str(d), "--tp", "2", "--dp", "2", "--node", "0", "--gpus-per-node", "2",
                  "--no-expert-parallel", "--no-env")
    assert res.exit_code == 1 and "FAIL  experts" in res.output
    fix = res.output.split("FAIL  experts", 1)[1].splitlines()[1].strip()
    assert fix.startswith("fix: vllm serve ") and "--enable-expert-parallel" in fix
    res = run_cli("preflight", str(nodes_pristine.parent), "--no-expert-parallel")
    assert res.exit_code == 2 and "--no-expert-parallel describes an engine launch" in res.output


# -- round_robin needs expert groups in vLLM --------------------------------------------------------


@pytest.fixture(scope="module")
def grouped_source(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``source`` with two expert groups: the model round_robin node directories are written for."""
    out = tmp_path_factory.mktemp("grouped") / "Kimi-K3"
    shutil.copytree(source, out)
    return set_expert_groups(out, 2)


@pytest.fixture(scope="module")
def round_robin_nodes(grouped_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Round_robin nodes whose config then lost its expert groups (``K3's``: none), as a directory
    written before reshard refused that, or whose config was edited since, has."""
    out = tmp_path_factory.mktemp("rr") / "k3-rr"
    reshard(grouped_source, out, RankSelection(tp=2, dp=2, gpus_per_node=2, placement="round_robin"))
    for node in out.glob("node-*"):
        set_expert_groups(node, None)
    return out


def test_round_robin_without_expert_groups_fails_for_vllm(round_robin_nodes: Path, grouped_source: Path,
                                                          source: Path) -> None:
    """vLLM places round_robin only for a model with several expert groups; K3's config (here,
    as synthesized) has no ``num_expert_group``, so vLLM's layers fall back to linear while its
    filter keeps round_robin's experts - half the local experts never loaded, silently
    (tests/test_engine_run.py pins it in the running engine). A FAIL, fixed by the linear node."""
    rep = pf.preflight(round_robin_nodes / "node-00000", launch(0), engine="vllm", environ=NO_GPU)
    assert [c.name for c in rep.checks if c.status == "FAIL"] == ["placement"]
    r = rows(rep)["placement"]
    assert "no n_group or num_expert_group (vLLM reads 1)" in r.reason and "never loaded" in r.reason
    assert r.fix is not None and r.fix.startswith(f"k3ckpt reshard {grouped_source} -o ") and "round_robin" not in r.fix
    assert "--tp 2 --dp 2 --gpus-per-node 2 --node 0" in r.fix
    # linear placement, one rank, a launch without expert parallelism: no such row
    for rep in (pf.preflight(source, RankSelection(tp=1), engine="vllm", environ=NO_GPU),
                pf.preflight(round_robin_nodes / "node-00000", launch(0), engine="vllm", environ=NO_GPU,
                             expert_parallel=False)):
        assert "placement" not in rows(rep)


def test_round_robin_with_expert_groups_passes(round_robin_nodes: Path, tmp_path: Path) -> None:
    d = tmp_path / "node"
    shutil.copytree(round_robin_nodes / "node-00000", d)
    config = json.loads((d / "config.json").read_text())
    config["text_config"]["num_expert_group"] = 2  # vLLM's other spelling
    (d / "config.json").write_text(json.dumps(config, indent=2))
    rep = pf.preflight(d, launch(0), engine="vllm", environ=NO_GPU)
    r = rows(rep)["placement"]
    assert r.status == "PASS" and "2 expert groups (config.json num_expert_group)" in r.reason
