"""scripts/benchlib.py, the method every benchmark shares, and bench_cost.py's arithmetic: rounds
interleaved, medians, the row and report writers, the cache control, the timed run. No timing
is asserted (benchmarks live in BENCHMARKS.md); the runs here are ``true``/``false``/``cat``."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_cost  # noqa: E402
import benchlib as bl  # noqa: E402


def test_each_round_starts_one_contender_further_on() -> None:
    assert [bl.round_order(3, r) for r in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert bl.round_order(0, 5) == []


def test_interleave_runs_every_contender_once_per_round(tmp_path: Path) -> None:
    log = tmp_path / "log"
    cs = [bl.Contender(name, f"echo {name} >> '{log}'", nbytes=10) for name in ("a", "b", "c")]
    runs = bl.interleave(cs, 2, bl.CacheControl("warm"), quiet=True)
    assert log.read_text().split() == ["a", "b", "c", "b", "c", "a"]
    assert {k: len(v) for k, v in runs.items()} == {"a": 2, "b": 2, "c": 2}
    assert all(r.nbytes == 10 and r.wall_s > 0 for v in runs.values() for r in v)


def test_interleave_refuses_two_contenders_of_one_label() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        bl.interleave([bl.Contender("a", "true"), bl.Contender("a", "true")], 1, bl.CacheControl("warm"))


def test_a_writer_is_measured_by_what_it_wrote_and_its_output_removed(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_bytes(b"x" * 99)  # an earlier run's leftovers must not count
    c = bl.Contender("w", f"mkdir -p '{out}/.cache' && head -c 1000 /dev/zero > '{out}/f' && "
                          f"head -c 5 /dev/zero > '{out}/.cache/rec'", out=out, sync=True)
    run = bl.run_one(c, bl.CacheControl("warm"))
    assert run.nbytes == 1000  # the hidden .cache records of a fetch are not output
    assert not out.exists()


def test_a_count_from_stdout_wins_and_falls_back_when_absent(tmp_path: Path) -> None:
    def count(text: str) -> int | None:
        return bl.json_value(text, "bytes_downloaded") if text.strip() else None

    found = bl.Contender("j", """echo '{"result": {"bytes_downloaded": 1234}}'""", nbytes=7, count=count)
    assert bl.run_one(found, bl.CacheControl("warm")).nbytes == 1234
    absent = bl.Contender("k", "true", nbytes=7, count=count)
    assert bl.run_one(absent, bl.CacheControl("warm")).nbytes == 7


def test_run_timed_counts_the_child_trees_cpu_and_pins_cores() -> None:
    t = bl.run_timed([sys.executable, "-c", "import os; print(len(os.sched_getaffinity(0)))"], cores=1, capture=True)
    assert t.stdout.strip() == "1"
    assert t.cpu_s > 0 and t.peak_rss > 0
    busy = bl.run_timed("sh -c 'i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done'")  # a grandchild's CPU
    assert busy.cpu_s > 0


def test_a_failing_command_stops_the_benchmark_with_its_stderr() -> None:
    with pytest.raises(SystemExit, match=r"failed \(3\).*boom"):
        bl.run_timed("echo boom >&2; exit 3")
    assert bl.run_timed("exit 1", ok_codes=(0, 1)).wall_s > 0


def test_summaries_are_medians_and_the_largest_peak() -> None:
    runs = [bl.Run(3.0, 1.0, 10, 2_000_000_000), bl.Run(1.0, 3.0, 30, 2_000_000_000), bl.Run(2.0, 2.0, 20, 2_000_000_000)]
    s = bl.summarize("x", runs)
    assert (s.wall_s, s.cpu_s, s.peak_rss, s.walls) == (2.0, 2.0, 30, (3.0, 1.0, 2.0))
    assert s.gb_per_s == 1.0 and s.cpu_s_per_gb == 1.0
    with pytest.raises(ValueError):
        bl.summarize("x", [])


def test_a_row_against_its_peer_reads_faster_and_cheaper_above_one() -> None:
    ours = bl.summarize("ours", [bl.Run(1.0, 1.0, 0, 10**9)])
    peer = bl.summarize("peer", [bl.Run(2.0, 3.0, 0, 10**9)])
    r = bl.row(ours, peer, shape="s")
    assert (r["vs_wall"], r["vs_cpu"], r["peer"], r["shape"]) == (2.0, 3.0, "peer", "s")
    assert "vs_wall" not in bl.row(peer, peer)  # the peer's own row compares with nothing


def test_a_row_says_how_far_its_ratio_moved_from_round_to_round() -> None:
    ours = bl.summarize("ours", [bl.Run(1.0, 1.0, 0, 10**9), bl.Run(2.0, 1.0, 0, 10**9), bl.Run(1.0, 1.0, 0, 10**9)])
    peer = bl.summarize("peer", [bl.Run(2.0, 1.0, 0, 10**9), bl.Run(1.0, 1.0, 0, 10**9), bl.Run(1.0, 1.0, 0, 10**9)])
    r = bl.row(ours, peer)
    assert r["vs_wall_rounds"] == [0.5, 2.0] and r["vs_wall"] == 1.0  # medians hide rounds 1 and 2
    cells = bl.Table("T", bl.COLUMNS, [r]).markdown().splitlines()[-1].split(" | ")
    assert "0.50-2.00x" in cells and "1.00x" in cells
    unpaired = bl.summarize("peer", [bl.Run(2.0, 1.0, 0, 10**9)])
    assert bl.row(ours, unpaired)["vs_wall_rounds"] is None  # no round to pair with


def test_table_markdown_formats_cells_and_leaves_missing_ones_empty() -> None:
    t = bl.Table("T", [("command", "label", "`{}`"), ("bytes", "bytes", "{:,}"), ("vs", "vs_wall", "{:.2f}x")],
                 [{"label": "a", "bytes": 1234567, "vs_wall": 0.5}, {"label": "b", "bytes": 1, "vs_wall": None}])
    assert t.markdown().splitlines() == ["T", "", "| command | bytes | vs |", "|---|---:|---:|",
                                         "| `a` | 1,234,567 | 0.50x |", "| `b` | 1 |  |"]


def test_the_report_is_written_as_markdown_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = {"cpu": "CPU", "nproc": 2, "ram_gib": 4.0, "kernel": "k", "python": "3", "filesystem": "ext4 on /dev/x",
         "openssl_sha256_gb_per_s_per_core": 1.5, "load_avg_1min": 0.1, "date": "D", "git_rev": "abc"}
    args = argparse.Namespace(report=tmp_path / "r", runs=3)
    setup = bl.Setup("bench_x", args, tmp_path, ["s"], bl.CacheControl("warm"), m)
    rows = [{"label": "a", "wall_s": 1.23456}]
    md, js = bl.write_report(setup, [bl.Table("T", [("c", "label", "{}"), ("w", "wall_s", "{:.2f}")], rows)],
                             {"cost": {"verify": 1}})
    assert md == tmp_path / "r" / "bench_x.md" and "| a | 1.23 |" in md.read_text()
    assert "nproc 2" in md.read_text() and "1.50 GB/s per core" in md.read_text()
    doc = json.loads(js.read_text())
    assert doc["tables"][0]["rows"] == rows and doc["cost"] == {"verify": 1} and doc["machine"] == m
    assert "| a | 1.23 |" in capsys.readouterr().out


def test_the_cache_control_says_how_it_dropped(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 10000)
    warm = bl.CacheControl("warm")
    warm.prepare([tmp_path])
    assert "warm" in warm.describe()
    cold = bl.CacheControl("cold", drop="fadvise")
    cold.prepare([f])
    assert "POSIX_FADV_DONTNEED" in cold.describe()
    auto = bl.CacheControl("cold")
    assert auto.method == ("proc" if os.access("/proc/sys/vm/drop_caches", os.W_OK) else "fadvise")
    with pytest.raises(ValueError):
        bl.CacheControl("tepid")


def test_a_warm_cache_is_filled_from_disk_each_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each input is evicted and then read: the cache then holds it as the readahead put it, not
    # as its writer left it (page sizes, and with them the cost of a mapped read, differ).
    files = [tmp_path / "a", tmp_path / "d" / "b"]
    for f in files:
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"x" * 10000)
    evicted: list[int] = []
    real = os.posix_fadvise

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # before the read
            evicted.append(os.fstat(fd).st_ino)
        real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    bl.CacheControl("warm").prepare([tmp_path])
    assert sorted(evicted) == sorted(f.stat().st_ino for f in files)


def test_shapes_are_reused_from_a_data_directory(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "k3-tiny").mkdir(parents=True)
    (data / "k3-tiny" / bl.INDEX).write_text("{}")
    (data / "k3-tiny" / "a.safetensors").write_bytes(b"x" * 5)
    (data / "k3-tiny.manifest.json").write_text("{}")
    shape = bl.build_shape("k3-tiny", tmp_path / "work", data, manifest=True)
    assert shape.path == data / "k3-tiny" and shape.manifest == data / "k3-tiny.manifest.json"
    assert shape.nbytes == 7 and [f.name for f in shape.files] == ["a.safetensors", bl.INDEX]
    with pytest.raises(SystemExit, match="unknown shape"):
        bl.build_shape("k3-huge", tmp_path)


def _cost_row(work: str, workers: int, cpu_s: float, nbytes: int, wall_s: float = 1.0) -> dict[str, object]:
    return {"work": work, "workers": workers, "cpu_s": cpu_s, "bytes": nbytes, "wall_s": wall_s, "shape": "s",
            "floor_cpu_s_per_gb": 1.0, "cpu_s_per_gb": cpu_s / (nbytes / 1e9)}


def test_cost_rows_take_the_floor_and_the_scaling_of_each_work() -> None:
    runs = {"verify x1": [bl.Run(2.0, 2.0, 0, 10**9)], "verify x2": [bl.Run(1.0, 2.2, 0, 10**9)],
            "read_copy": [bl.Run(0.1, 0.2, 0, 10**9)]}
    cs = [bl.Contender("verify x1", "true", meta={"work": "verify", "workers": 1, "shape": "s", "shown": "v1"}),
          bl.Contender("verify x2", "true", meta={"work": "verify", "workers": 2, "shape": "s", "shown": "v2"}),
          bl.Contender("read_copy", "true", meta={"work": "read_copy", "workers": 2, "shape": "s"})]
    rows = bench_cost.cost_rows(cs, bl.summarize_all(runs), sha=0.6)
    v1, v2, copy = rows
    assert v1["floor_cpu_s_per_gb"] == pytest.approx(0.8) and v1["x_floor"] == pytest.approx(2.5)
    assert "scaling" not in v1 and v2["scaling"] == 2.0
    assert copy["label"] == "cat FILES > /dev/null" and copy["basis"] == "read"


def test_the_marginal_cost_leaves_the_fixed_cost_out() -> None:
    rows = [_cost_row("verify", 2, 1.3, 1_100_000_000)]
    bench_cost.add_marginal(rows, [_cost_row("verify", 2, 0.3, 100_000_000)])
    assert rows[0]["fixed_cpu_s"] == 0.3 and rows[0]["marginal_cpu_s_per_gb"] == pytest.approx(1.0)
    cost = bench_cost.cost_summary(rows, sha=0.6, sha_speed=1.6e9)
    assert cost["verify"]["marginal_cpu_s_per_gb"] == pytest.approx(1.0)
    assert cost["floor"]["sha256_cpu_s_per_gb"] == 0.6 and "fetch" not in cost


def test_the_hub_process_serves_the_shapes_and_reports_its_cpu(k3_tiny: Path, tmp_path: Path) -> None:
    import urllib.request

    with bl.Hub({"bench/k3-tiny": k3_tiny}, tmp_path) as hub:
        assert hub.url.startswith("http://127.0.0.1:") and len(hub.commits["bench/k3-tiny"]) == 40
        url = hub.resolve_url("bench/k3-tiny", "config.json")
        assert hub.commits["bench/k3-tiny"] in url
        with urllib.request.urlopen(url) as resp:
            assert resp.read() == (k3_tiny / "config.json").read_bytes()
        assert hub.cpu_s() > 0 and hub.env()["HF_ENDPOINT"] == hub.url
    assert hub.cpu_s() == 0.0  # stopped


def test_bench_mx_memory_refuses_a_layer_smaller_than_a_tokens_route(tmp_path: Path) -> None:
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_mx_memory.py"
    p = subprocess.run([sys.executable, str(script), "--experts", "8", "--work", str(tmp_path / "w")],
                       capture_output=True, text=True, check=False)
    assert p.returncode == 2
    assert "--experts: 8 is fewer than the 16 experts" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "w").exists()  # refused before anything was built


def test_the_hub_can_be_pinned_apart_from_the_client(k3_tiny: Path, tmp_path: Path) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    with bl.Hub({"bench/k3-tiny": k3_tiny}, tmp_path, cpus=cpus[-1:]) as hub:
        assert hub.pid is not None and os.sched_getaffinity(hub.pid) == set(cpus[-1:])


def test_bench_scales_manifest_of_holes_is_the_one_hashing_them_builds(tmp_path: Path) -> None:
    """bench_scale gives k3-full's tensors the digest of their length in zero bytes instead of
    streaming 1.56 TB: on a headers-only checkpoint that is exactly what hashing them gives."""
    import subprocess

    import bench_scale

    from k3ckpt.integrity import Manifest

    src = tmp_path / "holes"
    subprocess.run([*bl.K3, "synth", str(src), "--headers-only"], check=True, cwd=bl.ROOT, stdout=subprocess.DEVNULL)
    built = bench_scale.built_manifest(src, tmp_path / "built.json")
    with bl.Hub({"bench/holes": src}, tmp_path) as hub:
        ours = bench_scale.zero_run_manifest("bench/holes", hub, tmp_path / "ours.json")
    a, b = Manifest.load(built), Manifest.load(ours)
    assert a.tensor_hashes and b.tensor_hashes and len(a.tensors) > 100
    assert a.tensors == b.tensors
    assert {f: e.sha256 for f, e in a.files.items()} == {f: e.sha256 for f, e in b.files.items()}
    assert bench_scale.zeros_sha256((1 << 24) + 5) == hashlib.sha256(bytes((1 << 24) + 5)).hexdigest()


# -- bench_start's trace reader ------------------------------------------------------------------

def _trace(*lines: str) -> str:
    return "\n".join(f"4242 {1000 + i * 0.01:.6f} {line}" for i, line in enumerate(lines))


def test_the_first_tensor_byte_is_the_first_access_past_a_header() -> None:
    import bench_start

    starts = {"model-00001-of-00002.safetensors": 4096}
    trace = _trace('openat(AT_FDCWD, "/x/config.json", O_RDONLY|O_CLOEXEC) = 3',
                   'read(3, ""..., 8192) = 900',
                   'openat(AT_FDCWD, "/x/model-00001-of-00002.safetensors", O_RDONLY|O_CLOEXEC) = 4',
                   'read(4, ""..., 8) = 8',  # the header's length, then the header itself
                   'pread64(4, ""..., 4088, 8) = 4088',
                   'read(3, ""..., 8192) = 8192',  # another file: no tensor byte
                   'pread64(4, ""..., 1048576, 4096) = 1048576')
    assert bench_start.first_tensor_read(trace, 1000.0, starts) == pytest.approx(0.06)
    sequential = _trace('openat(AT_FDCWD, "/x/model-00001-of-00002.safetensors", O_RDONLY) = 5',
                        'read(5, ""..., 4096) = 4096', 'read(5, ""..., 65536) = 65536')
    assert bench_start.first_tensor_read(sequential, 1000.0, starts) == pytest.approx(0.02)
    copied = _trace('openat(AT_FDCWD, "/x/model-00001-of-00002.safetensors", O_RDONLY) = 6',
                    'copy_file_range(6, [4096], 7, [0], 1048576, 0) = 1048576')
    assert bench_start.first_tensor_read(copied, 999.0, starts) == pytest.approx(1.01)
    mapped = _trace('openat(AT_FDCWD, "/x/model-00001-of-00002.safetensors", O_RDONLY) = 6',
                    'mmap(NULL, 6291456, PROT_READ, MAP_SHARED, 6, 0) = 0x7f0000000000')
    assert bench_start.first_tensor_read(mapped, 1000.0, starts) == pytest.approx(0.01)


def test_a_reused_descriptor_or_a_header_only_read_is_no_tensor_byte() -> None:
    import bench_start

    starts = {"model-00001-of-00002.safetensors": 4096}
    trace = _trace('openat(AT_FDCWD, "/x/model-00001-of-00002.safetensors", O_RDONLY) = 4',
                   'pread64(4, ""..., 4088, 8) = 4088',  # ends at the header's end
                   'openat(AT_FDCWD, "/x/tokenizer.json", O_RDONLY) = 4',  # the number is another file's now
                   'read(4, ""..., 65536) = 65536',
                   'pread64(9, ""..., 65536, 8192) = -1 EBADF (Bad file descriptor)')
    assert bench_start.first_tensor_read(trace, 1000.0, starts) is None


# -- bench_ready: a run compared again with the estimate as it is now ---------------------------

def test_bench_ready_compares_a_saved_run_with_the_current_estimate(k3_tiny: Path, tmp_path: Path) -> None:
    import bench_ready

    step = {"wall_s": 1.0, "cpu_s": 0.5, "flush_s": 0.1, "hub_cpu_s": 0.0}
    runs = {route: [{"steps": {s: dict(step) for s in steps}, "on_disk_bytes": 10}]
            for route, steps in bench_ready.ROUTES.items()}
    runs["naive: hf download, verify"][0]["steps"]["hf download"]["wall_s"] = 4.0
    measured = [{"shape": "k3-tiny", "path": str(k3_tiny), "cores": 1, "hub_cpus": [1],
                 "links": [1e9], "disks": [1e9], "runs": runs}]
    limits, steps, ready = bench_ready.compare(measured)
    assert limits.rows[0]["link_gb_s"] == 1.0
    by_step = {(r["route"], r["step"]): r for r in steps.rows}
    fetch = by_step[("fetch --node", "fetch --node")]
    assert fetch["predicted_s"] > 0 and fetch["ratio"] == pytest.approx(1.0 / fetch["predicted_s"])
    assert fetch["within"] == ("yes" if abs(fetch["ratio"] - 1) <= 0.25 else "no")
    assert by_step[("fetch --node", "manifest pull")]["predicted_s"] is None  # not in the estimate
    walls = {r["route"]: r for r in ready.rows}
    assert walls["fetch --node"]["wall_s"] == 4.0 and walls["naive: hf download, verify"]["wall_s"] == 6.0
    assert walls["fetch --node"]["vs_naive"] == pytest.approx(1.5)


def test_bench_ready_serves_the_hub_from_memory_for_every_step_that_downloads() -> None:
    """The steps named as reading from the hub are steps of the routes (a misspelt one would
    leave its hub reading from this node's disk), and every step that talks to the hub is one."""
    import bench_ready

    steps = {s for route in bench_ready.ROUTES.values() for s in route}
    assert bench_ready.DOWNLOADS <= steps
    assert {s for s in steps if "fetch" in s or "pull" in s or "download" in s} == bench_ready.DOWNLOADS


def test_bench_node_judges_the_rate_beyond_each_fetchs_fixed_cost() -> None:
    """Per round, a fetch's run less its dry run; the node fetch against the whole one round by
    round; a round whose run was no longer than its dry run counts for neither."""
    import bench_node

    gb = bl.GB
    whole = ([bl.Run(2.5, 3.0, 0, 2 * gb), bl.Run(2.5, 3.0, 0, 2 * gb), bl.Run(0.4, 0.3, 0, 2 * gb)],
             [bl.Run(0.5, 0.4, 0, 0)] * 3)
    node = ([bl.Run(1.6, 1.9, 0, gb), bl.Run(1.1, 1.7, 0, gb), bl.Run(1.6, 1.9, 0, gb)],
            [bl.Run(0.6, 0.5, 0, 0)] * 3)
    table = bench_node.beyond_fixed_cost("s", {"whole": whole, "node": node}, "whole", "node")
    rows = {r["label"]: r for r in table.rows}
    assert rows["whole"]["gb_per_s"] == pytest.approx(1.0) and rows["whole"]["fixed_wall_s"] == pytest.approx(0.5)
    assert rows["whole"]["cpu_s_per_gb"] == pytest.approx(1.3)
    # node: rounds 1-3 move 1 GB in 1.0, 0.5, 1.0 s beyond 0.6 s; round 3 of the whole fetch is void
    assert rows["node"]["gb_per_s"] == pytest.approx(1.0)
    assert rows["node"]["vs_wall_rounds"] == pytest.approx([1.0, 2.0]) and rows["node"]["vs_wall"] == pytest.approx(1.5)
    assert rows["node"]["vs_cpu"] == pytest.approx((1.2 / 1.3 + 1.4 / 1.3) / 2)
    assert "vs_wall" not in rows["whole"]


def test_free_page_reporting_is_paused_for_a_run_and_put_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    param = tmp_path / "page_reporting_order"
    param.write_text("9\n")
    monkeypatch.setattr(bl, "PAGE_REPORTING_ORDER", param)
    backed: list[bool] = []
    monkeypatch.setattr(bl, "back_free_memory", lambda: (backed.append(True), (12.5, 3.0))[1])
    memory = bl.GuestMemory()
    memory.pause()
    assert param.read_text().strip() == str(bl.NO_REPORTING_ORDER) and backed == [True]
    assert "page_reporting_order 9 -> 11" in memory.describe() and "12.5 GiB" in memory.describe()
    memory.restore()
    assert param.read_text().strip() == "9"
    memory.restore()  # twice is harmless: nothing is written over the restored value
    assert param.read_text().strip() == "9"


def test_without_page_reporting_the_memory_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bl, "PAGE_REPORTING_ORDER", tmp_path / "absent")
    monkeypatch.setattr(bl, "back_free_memory", lambda: pytest.fail("nothing to back without reporting"))
    memory = bl.GuestMemory()
    memory.pause()
    assert memory.describe() == "free page reporting: none"
    memory.restore()
    assert not (tmp_path / "absent").exists()
