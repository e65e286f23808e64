"""Time to ready (``k3ckpt plan --link --disk --cores``, :mod:`k3ckpt.deploy.estimate`): the
model on hand-computed cases, the bytes it counts against an independent count (and vLLM's own
filter where the wheel is present), the rate parser, and the CLI."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from pathlib import Path
from typing import Any

import click
import pytest

from engines import load_vllm, missing_reason, rank_read_bytes
from helpers import assert_one_line_error, run
from k3ckpt.deploy import MEASURED_COSTS, CostPerGB, Limits, plan_topology
from k3ckpt.deploy.estimate import (
    DIRTY_BACKGROUND_RATIO,
    DIRTY_EXPIRE_SECONDS,
    NAIVE,
    ONE_STEP,
    TWO_STEP,
    engine_read_bytes,
    format_duration,
    start_seconds,
    step_estimate,
    step_threads,
    unwritten_at_exit,
)
from k3ckpt.format import open_checkpoint
from k3ckpt.format.roles import classify
from k3ckpt.format.topology import RankSelection, Topology, index_of
from k3ckpt.utils import parse_rate

GB = 10**9
VLLM = load_vllm()

# -- the model, by hand ------------------------------------------------------------------------

# 1 GB/s link, 2 GB/s disk, 4 cores: easy to compute by hand
LIMITS = Limits(link=1 * GB, disk=2 * GB, cores=4)


def test_a_download_is_bound_by_the_link() -> None:
    s = step_estimate("fetch", LIMITS, downloads=10 * GB, writes=10 * GB, cpu_seconds=20.0)
    # link 10 s, disk 10 GB / 2 GB/s = 5 s, CPU 20 CPU-s / 4 cores = 5 s
    assert (s.link_seconds, s.disk_seconds, s.cpu_wall_seconds) == (10.0, 5.0, 5.0)
    assert s.seconds == 10.0 and s.bound == "link"


def test_reads_and_writes_share_the_disk() -> None:
    """A step that reads and writes the same bytes moves them twice through one disk rate."""
    s = step_estimate("reshard", LIMITS, reads=6 * GB, writes=6 * GB, cpu_seconds=8.0)
    assert s.disk_seconds == 6.0  # (6 + 6) GB / 2 GB/s, not 6 GB / 2 GB/s
    assert s.seconds == 6.0 and s.bound == "disk"


def test_hashing_on_few_cores_is_bound_by_the_cpu() -> None:
    s = step_estimate("verify", LIMITS, reads=4 * GB, hashes=4 * GB, cpu_seconds=4 * 1.22 * 10)
    assert s.disk_seconds == 2.0 and s.cpu_wall_seconds == pytest.approx(12.2)
    assert s.seconds == pytest.approx(12.2) and s.bound == "cpu"
    more_cores = step_estimate("verify", dataclasses.replace(LIMITS, cores=64), reads=4 * GB, hashes=4 * GB,
                               cpu_seconds=4 * 1.22 * 10)
    assert more_cores.bound == "disk" and more_cores.seconds == 2.0


def test_a_step_uses_only_the_cores_its_threads_can() -> None:
    """A tool hashing in fewer threads than the node has cores is bound by those threads:
    huggingface_hub's cache verify hashes in one, fetch in its 8 requests."""
    big = dataclasses.replace(LIMITS, cores=64)
    one = step_estimate("hf cache verify", big, reads=4 * GB, hashes=4 * GB, cpu_seconds=40.0, threads=1)
    assert one.cpu_wall_seconds == 40.0 and one.bound == "cpu"
    eight = step_estimate("fetch", big, downloads=4 * GB, cpu_seconds=40.0, threads=8)
    assert eight.cpu_wall_seconds == 5.0
    assert step_estimate("x", LIMITS, cpu_seconds=40.0, threads=8).cpu_wall_seconds == 40.0 / LIMITS.cores
    threads = step_threads(LIMITS.cores)
    assert (threads["hf download"], threads["hf cache verify"], threads["fetch"], threads["verify"]) == (1, 1, 8, None)


def test_a_step_starts_before_its_limits_count() -> None:
    """A command's start-up (the interpreter, the listing, the last syncs) comes on top of the
    longest limit: it does not overlap the bytes, and is not a limit itself."""
    s = step_estimate("fetch", LIMITS, downloads=10 * GB, writes=10 * GB, cpu_seconds=20.0, start=0.5)
    assert s.seconds == 10.5 and s.bound == "link" and s.start_seconds == 0.5
    assert s.to_json()["seconds"] == 10.5


@pytest.mark.parametrize("cores, requests", [(1, 8), (2, 8), (16, 8), (17, 8), (24, 12), (64, 32), (256, 32)])
def test_fetch_requests_follow_the_cores(cores: int, requests: int) -> None:
    """One request per two cores, at least huggingface_hub's 8, at most 32; the estimate uses the
    same count for the node it is given."""
    from k3ckpt.hub import default_requests

    assert default_requests(cores) == requests
    assert step_threads(cores)["fetch"] == step_threads(cores)["fetch --node"] == requests


def test_step_threads_are_the_commands_defaults(served_hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The threads the model gives each step are what the commands use without ``--jobs``: on a
    40-core machine a fetch runs 20 requests, a node fetch too."""
    import k3ckpt.hub.download as download_mod
    import k3ckpt.hub.nodefetch as nodefetch_mod
    from helpers import REPO
    from k3ckpt.cli import main
    from k3ckpt.hub.download import fetch_files
    from k3ckpt.hub.nodefetch import run_node_fetch

    fetch = main.get_command(click.Context(main), "fetch")
    assert fetch is not None
    jobs = next(p for p in fetch.params if p.name == "jobs")
    assert jobs.default is None  # resolved on the machine that runs it
    assert inspect.signature(fetch_files).parameters["workers"].default is None
    assert inspect.signature(run_node_fetch).parameters["workers"].default is None
    monkeypatch.setattr(os, "cpu_count", lambda: 40)  # the one os module: every default reads it
    used: list[int] = []
    real_run, real_frame = download_mod.FetchRun, nodefetch_mod.fetch_run
    monkeypatch.setattr(download_mod, "FetchRun", lambda *a, **kw: (used.append(a[3]), real_run(*a, **kw))[1])
    monkeypatch.setattr(nodefetch_mod, "fetch_run", lambda plan, workers, *a, **kw: (used.append(workers),
                                                                                   real_frame(plan, workers, *a, **kw))[1])
    h, _ = served_hub
    common = ("--source", "hf", "--repo", REPO, "--endpoint", h.url)
    assert run("fetch", *common, "--dest", str(tmp_path / "all")).exit_code == 0
    node = run("fetch", *common, "--dest", str(tmp_path / "node"), "--tp", "2", "--dp", "2", "--node", "0",
               "--gpus-per-node", "2")
    assert node.exit_code == 0, node.output
    assert set(used) == {20} == {step_threads(40)["fetch"]} and len(used) >= 2


@pytest.mark.parametrize("gbit", [25, 100])
def test_on_the_reference_node_every_step_of_the_recommended_route_waits_on_the_link_or_the_disk(
        k3_full: Path, gbit: int) -> None:
    """K3 on two 8-GPU nodes with 25 Gbit/s links, 7 GB/s NVMe and 64 cores (docs/deploy.md's
    reference node), and with 100 Gbit/s links: with the measured costs and the default thread
    counts, the fastest route's every step is bound by the link or the disk, never by the CPU
    (#28; at 100 Gbit/s 8 requests would not hash fast enough)."""
    rep = plan_topology(k3_full, RankSelection(tp=8, dp=2, gpus_per_node=8),
                        limits=Limits(link=gbit * 1e9 / 8, disk=7e9, cores=64))
    assert rep.ready is not None
    for node in rep.ready.nodes:
        best = min(node.routes, key=lambda r: r.seconds)
        assert best.name == ONE_STEP
        assert {s.name: s.bound for s in best.steps if s.bound == "cpu"} == {}


def test_a_step_left_to_the_page_cache_ends_with_its_flush() -> None:
    """``hf download`` does not sync: the step ends when what the kernel still holds dirty at
    its exit is on the disk, at the disk's rate - all of it for a short step, its last 30 s of
    writes for a long one, at most 10 % of the memory when the memory is known."""
    assert (DIRTY_EXPIRE_SECONDS, DIRTY_BACKGROUND_RATIO) == (30.0, 0.10)  # the kernel's defaults
    short = step_estimate("hf download", LIMITS, downloads=10 * GB, writes=10 * GB, cpu_seconds=20.0, unsynced=True)
    assert short.flush_bytes == 10 * GB and short.flush_seconds == 5.0  # 10 GB / 2 GB/s
    assert short.seconds == 10.0 + 5.0 and short.bound == "link"
    long = step_estimate("hf download", LIMITS, downloads=120 * GB, writes=120 * GB, unsynced=True)
    assert long.link_seconds == 120.0 and long.flush_bytes == 30 * GB  # the last 30 of 120 s
    small = step_estimate("hf download", dataclasses.replace(LIMITS, memory=64 * GB), downloads=120 * GB,
                          writes=120 * GB, unsynced=True)
    assert small.flush_bytes == int(6.4 * GB) and small.seconds == pytest.approx(120.0 + 3.2)
    synced = step_estimate("fetch", LIMITS, downloads=10 * GB, writes=10 * GB)
    assert synced.flush_bytes == 0 and synced.seconds == 10.0
    assert unwritten_at_exit(0, 0.0, None) == 0


def test_only_the_naive_download_is_left_to_the_page_cache(k3_tiny: Path) -> None:
    """k3ckpt's commands sync their files before they exit; ``hf download`` is the one step
    with a flush, and the memory bounds it."""
    sel = RankSelection(tp=2, dp=2, gpus_per_node=2)
    for memory in (None, 1000.0):
        rep = plan_topology(k3_tiny, sel, limits=dataclasses.replace(LIMITS, memory=memory))
        assert rep.ready is not None
        flushed = {s.name: s.flush_bytes for r in rep.ready.nodes[0].routes for s in r.steps if s.flush_bytes}
        assert flushed == {"hf download": rep.ready.checkpoint_bytes if memory is None else 100}


def test_a_tie_names_the_first_limit() -> None:
    s = step_estimate("x", LIMITS, downloads=2 * GB, reads=4 * GB, cpu_seconds=8.0)
    assert s.seconds == 2.0 and s.bound == "link"


def test_costs_and_limits_refuse_what_cannot_be() -> None:
    with pytest.raises(ValueError, match="verify"):
        CostPerGB(verify=0)
    with pytest.raises(ValueError, match="limits must be positive"):
        Limits(link=1e9, disk=0, cores=1)
    with pytest.raises(ValueError, match="memory 0"):
        Limits(link=1e9, disk=1e9, cores=1, memory=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        MEASURED_COSTS.verify = 1.0  # type: ignore[misc]


def test_the_measured_costs_name_their_benchmarks_section() -> None:
    """Each constant cites the BENCHMARKS.md section it was measured in, by its heading, so a
    re-measurement is a one-line change a reader can check against the table it cites."""
    from k3ckpt.deploy import estimate

    source = inspect.getsource(estimate.CostPerGB)
    benchmarks = (Path(__file__).resolve().parents[1] / "BENCHMARKS.md").read_text(encoding="utf-8")
    headings = {line[3:].strip() for line in benchmarks.splitlines() if line.startswith("## ")}
    for f in dataclasses.fields(CostPerGB):
        m = re.search(rf"((?:[ \t]*#:.*\n)+)[ \t]*{f.name}: float =", source)
        assert m, f"CostPerGB.{f.name} has no #: comment"
        comment = " ".join(line.strip().removeprefix("#:").strip() for line in m.group(1).splitlines())
        cited = re.findall(r'BENCHMARKS\.md "([^"]+)"', comment)
        assert cited, f"CostPerGB.{f.name} names no BENCHMARKS.md section"
        assert not set(cited) - headings, f"CostPerGB.{f.name} cites a section BENCHMARKS.md lacks: {cited}"


def test_durations_are_minutes_and_hours() -> None:
    assert format_duration(0.4) == "0.4s" and format_duration(0.0) == "0.0s"
    assert format_duration(0.96) == "0m01s"
    assert format_duration(268) == "4m28s"
    assert format_duration(3723) == "1h02m"


# -- the rate parser -----------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "rate"), [
    ("25Gbit/s", 25e9 / 8), ("25Gbit", 25e9 / 8), ("100 Mbit/s", 100e6 / 8), ("400gbit", 50e9),
    ("1Gibit/s", 1024**3 / 8), ("7GB/s", 7e9), ("3.5GiB/s", 3.5 * 1024**3), ("7B", 7.0), ("8bit", 1.0),
])
def test_parse_rate(text: str, rate: float) -> None:
    assert parse_rate(text) == rate


@pytest.mark.parametrize("text", ["25Gb/s", "25Gbps", "25G", "25", "7GB/sec", "-1GB/s", "fast", ""])
def test_parse_rate_refuses_what_could_be_bits_or_bytes(text: str) -> None:
    with pytest.raises(ValueError, match="is not a rate: write bits as Gbit/s or bytes as GB/s"):
        parse_rate(text)


def test_parse_rate_refuses_zero() -> None:
    with pytest.raises(ValueError, match="more than zero"):
        parse_rate("0GB/s")


# -- what each step moves, on k3-tiny ------------------------------------------------------------


def _reads_by_name(ckpt_tensors: dict, own: set[int], held: set[int] | None) -> int:
    """vLLM's filter written from the tensor names alone (not from the inventory index): every
    tensor but other ranks' ``.weight``/``.weight_packed`` experts, of the experts held."""
    total = 0
    for name, t in ckpt_tensors.items():
        role = classify(name)
        e = role.expert
        if e is not None and held is not None and e not in held:
            continue
        if e is not None and e not in own and name.endswith((".weight", ".weight_packed")):
            continue
        total += t.nbytes
    return total


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_engine_reads_match_a_count_by_name(k3_tiny: Path, placement: str) -> None:
    ckpt = open_checkpoint(k3_tiny)
    idx = index_of(ckpt)
    topo = Topology.make(ep=4, tp=2, world_size=4, placement=placement, num_experts=16)
    node0 = {e for r in (0, 1) for e in topo.rank_info(r).experts}
    for rank in range(4):
        own = set(topo.rank_info(rank).experts)
        assert engine_read_bytes(idx, topo, rank, None) == _reads_by_name(ckpt.tensors, own, None)
        assert engine_read_bytes(idx, topo, rank, node0) == _reads_by_name(ckpt.tensors, own, node0)
    # the original layout's reads hold every expert's scales; the node directory only its own
    assert engine_read_bytes(idx, topo, 0, node0) < engine_read_bytes(idx, topo, 0, None)


@pytest.mark.skipif(VLLM is None, reason=missing_reason("vllm"))
@pytest.mark.parametrize(("tp", "dp", "gpus", "placement"), [(2, 2, 2, "linear"), (1, 4, 2, "round_robin"),
                                                               (4, 1, 4, "linear")])
def test_engine_reads_equal_vllms_filter(request: pytest.FixtureRequest, tp: int, dp: int, gpus: int,
                                        placement: str) -> None:
    """The load step's bytes are what vLLM's own ``should_skip_weight`` keeps (tests/engines.py);
    round_robin on the model with expert groups, the only one its node directories are planned for."""
    assert VLLM is not None
    ckpt = open_checkpoint(request.getfixturevalue("k3_tiny_grouped" if placement == "round_robin" else "k3_tiny"))
    rep = plan_topology(ckpt, RankSelection(tp=tp, dp=dp, gpus_per_node=gpus, placement=placement),
                        limits=LIMITS)
    assert rep.ready is not None
    rows = rank_read_bytes(VLLM, {n: t.nbytes for n, t in ckpt.tensors.items()}, tp=tp, dp=dp,
                           gpus_per_node=gpus, num_experts=16, placement=placement)
    for node in rep.ready.nodes:
        want_node = sum(from_node for r, _, from_node in rows if r in node.ranks)
        want_orig = sum(from_source for r, from_source, _ in rows if r in node.ranks)
        assert node.route(ONE_STEP).steps[-1].read_bytes == want_node
        assert node.route(TWO_STEP).steps[-1].read_bytes == want_node
        assert node.route(NAIVE).steps[-1].read_bytes == want_orig


def test_routes_on_k3_tiny(k3_tiny: Path) -> None:
    """Two 2-GPU nodes of tp 2 x dp 2: each step's bytes and CPU-seconds from the node's share and
    the costs, its time from the limits."""
    costs = CostPerGB(verify=1.0, fetch=2.5, rank_fetch=2.0, reshard=3.0, node_fetch=4.0, hf_download=5.0,
                      hf_cache_verify=0.5, hub_start_seconds=0.5, local_start_seconds=0.25,
                      rank_fetch_per_tensor=1e-3, verify_per_tensor=2e-3, reshard_per_tensor=3e-3,
                      node_fetch_per_tensor=4e-3)
    n = len(open_checkpoint(k3_tiny).tensors)
    rep = plan_topology(k3_tiny, RankSelection(tp=2, dp=2, gpus_per_node=2), limits=LIMITS, costs=costs)
    assert rep.ready is not None and len(rep.ready.nodes) == 2
    for node, nb in zip(rep.ready.nodes, rep.nodes):
        share, whole = nb.total_bytes, rep.checkpoint_bytes
        assert share < whole  # half the experts
        fetch, verify, reshard, load = node.route(TWO_STEP).steps
        assert (fetch.name, verify.name, reshard.name) == ("fetch --ranks", "verify", "reshard --node")
        assert (fetch.download_bytes, fetch.write_bytes, fetch.hash_bytes) == (share, share, share)
        assert (verify.download_bytes, verify.read_bytes, verify.hash_bytes) == (0, share, share)
        assert (reshard.read_bytes, reshard.write_bytes) == (share, share)
        assert fetch.cpu_seconds == pytest.approx(2.0 * share / GB)
        assert verify.cpu_seconds == pytest.approx(1.0 * share / GB)
        assert reshard.cpu_seconds == pytest.approx(3.0 * share / GB)
        assert reshard.disk_seconds == pytest.approx(2 * share / (2 * GB))
        node_fetch, load1 = node.route(ONE_STEP).steps
        assert node_fetch.download_bytes == share and node_fetch.cpu_seconds == pytest.approx(4.0 * share / GB)
        assert load1 == load and load.cpu_seconds == 0 and load.download_bytes == 0
        download, cache_verify, load_orig = node.route(NAIVE).steps
        assert (download.download_bytes, download.write_bytes) == (whole, whole)
        assert download.cpu_seconds == pytest.approx(5.0 * whole / GB)
        assert download.cpu_wall_seconds == pytest.approx(download.cpu_seconds)  # one interpreter
        assert cache_verify.hash_bytes == whole and cache_verify.cpu_seconds == pytest.approx(0.5 * whole / GB)
        assert cache_verify.cpu_wall_seconds == pytest.approx(cache_verify.cpu_seconds)  # one thread
        # the start-up: 0.5 s for a command reading the hub, 0.25 s for one on local files, none for
        # the load; and for each step reading every header, its cost per tensor of the checkpoint
        assert [s.start_seconds for r in node.routes for s in r.steps] == pytest.approx([
            0.5 + 1e-3 * n, 0.25 + 2e-3 * n, 0.25 + 3e-3 * n, 0.0, 0.5 + 4e-3 * n, 0.0, 0.5, 0.25, 0.0])
        assert fetch.seconds == pytest.approx(fetch.start_seconds + max(fetch.link_seconds, fetch.disk_seconds,
                                                                        fetch.cpu_wall_seconds))
        assert load_orig.read_bytes > load.read_bytes
        for route in node.routes:
            assert route.seconds == pytest.approx(sum(s.seconds for s in route.steps))


def test_one_node_fetches_the_whole_checkpoint(k3_tiny: Path) -> None:
    rep = plan_topology(k3_tiny, RankSelection(tp=2), limits=LIMITS)
    assert rep.ready is not None
    fetch = rep.ready.nodes[0].route(TWO_STEP).steps[0]
    assert fetch.name == "fetch" and fetch.download_bytes == rep.nodes[0].total_bytes
    # a whole fetch hashes each file once, at fetch's cost; a rank fetch's cost is rank_fetch
    assert fetch.cpu_seconds == pytest.approx(MEASURED_COSTS.fetch * fetch.download_bytes / GB)
    # and reads no header: its start-up is the command's alone
    assert fetch.start_seconds == MEASURED_COSTS.hub_start_seconds


# -- the CLI -------------------------------------------------------------------------------------

RATES = ["--link", "25Gbit/s", "--disk", "7GB/s", "--cores", "64"]


def test_cli_prints_the_time_to_ready(k3_tiny: Path) -> None:
    res = run("plan", str(k3_tiny), "--tp", "2", "--dp", "2", "--gpus-per-node", "2", *RATES)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "node     ranks" in out  # the plan is still there, the estimate after it
    assert "link 3.12 GB/s (25 Gbit/s), disk 7.00 GB/s (reads + writes), 64 cores" in out
    assert "nodes 0-1, each (2 GPUs)" in out
    n = len(open_checkpoint(k3_tiny).tensors)
    starts = {k: f"{v:.1f} s" for k, v in start_seconds(MEASURED_COSTS, n).items()}
    assert (f"of these {n:,} tensors first: fetch --ranks {starts['fetch --ranks']}, verify of a share "
            f"{starts['verify']},") in out
    assert f"reshard {starts['reshard --node']}, fetch --node {starts['fetch --node']}) plus the longest" in out
    for line in (TWO_STEP, "  fetch --ranks", "  verify", "  reshard --node", "  load (vLLM, 2 ranks)",
                 ONE_STEP, "  fetch --node", NAIVE, "  hf download", "  hf cache verify"):
        assert any(x.startswith(line) for x in out.splitlines()), line
    assert "ready in" in out


def test_cli_json_gives_the_same_numbers(k3_tiny: Path) -> None:
    args = ["plan", str(k3_tiny), "--tp", "2", "--dp", "2", "--gpus-per-node", "2", *RATES]
    res = run(*args, "--json")
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)["time_to_ready"]
    rep = plan_topology(k3_tiny, RankSelection(tp=2, dp=2, gpus_per_node=2),
                        limits=Limits(link=25e9 / 8, disk=7e9, cores=64))
    assert rep.ready is not None
    assert got == json.loads(json.dumps(rep.ready.to_json()))
    assert got["limits"] == {"link_bytes_per_second": 3.125e9, "disk_bytes_per_second": 7e9, "cores": 64,
                             "memory_bytes": None}
    assert got["cpu_seconds_per_gb"] == dataclasses.asdict(MEASURED_COSTS)
    assert got["tensors"] == len(open_checkpoint(k3_tiny).tensors)
    for step in (s for r in got["nodes"][0]["routes"] for s in r["steps"]):
        assert step["seconds"] == step["start_seconds"] + max(step["link_seconds"], step["disk_seconds"],
                                                              step["cpu_wall_seconds"]) + step["flush_seconds"]
        assert step["flush_seconds"] == step["flush_bytes"] / 7e9
    with_memory = json.loads(run(*args, "--memory", "2TiB", "--json").stdout)["time_to_ready"]
    assert with_memory["limits"]["memory_bytes"] == 2 * 2**40
    assert "time_to_ready" not in json.loads(run(*args[:7], "--json").stdout)  # only when asked


def test_cli_prints_the_memory_given(k3_tiny: Path) -> None:
    res = run("plan", str(k3_tiny), "--tp", "2", *RATES, "--memory", "24GiB")
    assert res.exit_code == 0, res.output
    assert "64 cores, 25.77 GB of memory" in res.stdout
    assert "(its last 30 s of writes,\n               at most 10% of the memory)" in res.stdout
    assert "(its last 30 s of writes)\n" in run("plan", str(k3_tiny), "--tp", "2", *RATES).stdout


@pytest.mark.parametrize(("args", "needles"), [
    (["--link", "25Gb/s", "--disk", "7GB/s", "--cores", "8"], ["--link", "'25Gb/s' is not a rate", "Gbit/s"]),
    (["--link", "25G", "--disk", "7GB/s", "--cores", "8"], ["--link", "'25G' is not a rate"]),
    (["--link", "25Gbit", "--disk", "fast", "--cores", "8"], ["--disk", "'fast' is not a rate"]),
    (["--link", "25Gbit", "--disk", "0GB/s", "--cores", "8"], ["--disk", "more than zero"]),
    (["--link", "25Gbit", "--disk", "7GB/s", "--cores", "0"], ["--cores"]),
    (["--link", "25Gbit", "--cores", "8"], ["go together", "add --disk"]),
    (["--link", "25Gbit", "--disk", "7GB/s", "--cores", "8", "--format", "rank"], ["drop --format rank"]),
    (["--memory", "24GiB"], ["--memory is for the time to ready", "add --link, --disk and --cores"]),
    (["--link", "25Gbit", "--disk", "7GB/s", "--cores", "8", "--memory", "0"], ["--memory", "must be positive"]),
])
@pytest.mark.parametrize("as_json", [False, True])
def test_cli_refuses_bad_limits_in_one_line(k3_tiny: Path, args: list[str], needles: list[str],
                                            as_json: bool) -> None:
    res = run("plan", str(k3_tiny), "--tp", "2", *args, *(["--json"] if as_json else []))
    assert_one_line_error(res, 2, *needles)


# -- K3 itself -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_k3_load_bytes_are_the_benchmarked_ones(k3_full: Path) -> None:
    """On the real K3 inventory the load step reads, per rank, the figures BENCHMARKS.md measured
    with vLLM's own filter ("What each rank reads at load under vLLM's weight filter")."""
    for sel, from_orig, from_node in [
        (RankSelection(tp=8, gpus_per_node=8), 369_769_051_104, 369_769_051_104),
        (RankSelection(tp=8, dp=2, gpus_per_node=8), 284_683_400_160, 242_140_574_688),
        # benchmarked round_robin; linear gives each node as many experts of the same sizes (K3's
        # config has no expert groups, so round_robin node directories are refused for it)
        (RankSelection(tp=4, dp=4, gpus_per_node=4), 284_683_400_160, 220_869_161_952),
    ]:
        rep = plan_topology(k3_full, sel, limits=Limits(link=25e9 / 8, disk=7e9, cores=64))
        assert rep.ready is not None
        for node in rep.ready.nodes:
            ranks = len(node.ranks)
            assert node.route(NAIVE).steps[-1].read_bytes == ranks * from_orig
            assert node.route(ONE_STEP).steps[-1].read_bytes == ranks * from_node
