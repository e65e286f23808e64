"""Time to ready: how long each node of a topology takes from an empty disk to a loaded engine,
by three routes, from the measured cost per GB of each step and the node's stated limits.

The model (docs/deploy.md, "Time to ready"). Every node works at once on its own share, with its
own network link, disk and cores; nothing is shared between nodes (the hub is assumed to keep
up). A route is a sequence of steps run one after another; within a step the three resources
overlap perfectly (bytes stream), so a step takes the longest of

    download / link,   (read + write) / disk,   CPU-seconds / cores used

plus the command's start-up (:attr:`CostPerGB.hub_start_seconds`, :attr:`CostPerGB.local_start_seconds`:
the interpreter, the listing before the first byte, the last syncs after it - under a second),
and for a step that reads every header and plans from them (``fetch --ranks``, ``fetch --node``,
``verify``, ``reshard --node``: :func:`start_seconds`) a cost per tensor of the checkpoint,
seconds at K3's ~497k tensors, where CPU-seconds = GB processed x the step's measured CPU-s per GB
(:class:`CostPerGB`, measured as the route runs: an empty page cache, a tensor-hash manifest),
spread evenly over the cores the tool hashes on by default (:func:`step_threads`: for ``fetch``
its default requests on the node's cores, at most 16 writers for ``reshard``, one thread for
``hf download`` and ``hf cache verify``). One disk rate covers reads and writes together: a step
that reads and writes the same bytes (reshard) moves them twice through the disk. A step ends
when its bytes are on the disk: k3ckpt's commands sync before they exit, but ``hf download``
writes through the page cache and leaves the kernel to write the rest, so its step adds the
flush of what is still unwritten when it exits (:func:`unwritten_at_exit`). The routes:

- **two steps**: ``fetch`` (the whole checkpoint on one node, else ``fetch --ranks`` of the
  node's ranks: dense tensors plus the node's experts), ``verify``, ``reshard --node`` into the
  node directory, then the engine's load;
- **one step**: ``fetch --node`` (the node directory straight from the hub, every tensor
  checked against a tensor-hash manifest), then the load;
- **naive**: every node downloads the whole checkpoint (``hf download`` over plain HTTP, at
  :attr:`CostPerGB.hf_download` in one thread: huggingface_hub's download threads share one
  interpreter), ``hf cache verify`` hashes all of it (at :attr:`CostPerGB.hf_cache_verify`, file after
  file in one thread, as huggingface_hub does), then the load from the original layout.

The load is vLLM's with ``--enable-expert-parallel --enable-ep-weight-filter``: every rank of the
node reads every dense tensor, every expert tensor its directory holds except the heavy weights
(``.weight``/``.weight_packed``) of other ranks' experts - so from the original layout all 896
experts' scales - and its own experts whole (BENCHMARKS-history.md, "What each rank reads at load under
vLLM's weight filter"; docs/engines.md). Ranks read separately: no page-cache sharing is counted.
The load's CPU and the engine's start-up after it are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..format.topology import InventoryIndex, Topology
from ..hub import default_requests
from .reshard import MAX_DEFAULT_WRITERS

GB = 10**9

#: Tensor parts vLLM's weight filter skips for experts that are not the rank's (``should_skip_weight``:
#: names ending in ``.weight`` or ``.weight_packed``); every other part (scales) is always read.
FILTERED_PARTS = frozenset({"weight", "weight_packed"})

#: The kernel's defaults for writes left in the page cache (Documentation/admin-guide/sysctl/vm.rst):
#: pages dirty for longer than ``vm.dirty_expire_centisecs`` (3000) are written by the flusher
#: threads, and once dirty pages pass ``vm.dirty_background_ratio`` (10) percent of the memory
#: the kernel can use for them, they write in the background until below it.
DIRTY_EXPIRE_SECONDS = 30.0
DIRTY_BACKGROUND_RATIO = 0.10


@dataclass(frozen=True)
class CostPerGB:
    """What each step costs in CPU-seconds per GB (10^9 bytes) on one core, and each command's
    start-up in seconds: the measured figures the estimate scales by the node's cores. Each
    default names the BENCHMARKS.md section (and row) it comes from; a re-measurement changes one
    line."""

    #: per GB hashed by ``verify --manifest M`` of a partial share with a tensor-hash manifest (each
    #: rewritten file's sha256 and each tensor's: two digests of every byte), page cache empty.
    #: BENCHMARKS.md "Time to ready, the estimate against a run (2026-12-06, #28)" (its constants
    #: paragraph; fitted on 2026-12-05's k3-density run at 1 core, in BENCHMARKS-history.md), CPU-s
    #: beyond the start-up per GB of the share; each figure below the same way. (The
    #: same code costs up to ~1.3x more CPU per GB on one machine of this pool than on another:
    #: 2026-12-04's figures were 1.33 here, 0.97 for both fetches.) 1.64 until verify read 1 MiB
    #: at a time instead of mapping 16 MiB windows: the second digest of each byte then finds it
    #: in the CPU's cache (the evening re-run of that section, cdf4687).
    verify: float = 1.25
    #: per GB received by a whole ``fetch`` (sha256 of every byte, write, fsync). BENCHMARKS.md
    #: "Time to ready, the estimate against a run (2026-12-06, #28)", bench_node's k3-density row.
    fetch: float = 1.09
    #: per GB received by ``fetch --ranks`` (``--format partial``: every tensor hashed against the
    #: manifest as it arrives, and each rewritten file's own sha256). BENCHMARKS.md "Time to
    #: ready, the estimate against a run (2026-12-06, #28)".
    rank_fetch: float = 1.17
    #: per GB written by ``reshard --node`` in the documented flow (every tensor's digest from the
    #: verify that ran before, the files' digests built from them: the kernel copy only).
    #: BENCHMARKS.md "Time to ready, the estimate against a run (2026-12-06, #28)".
    reshard: float = 0.40
    #: per GB received by ``fetch --node`` (each tensor's sha256 while receiving; the files'
    #: digests built from them). BENCHMARKS.md "Time to ready, the estimate against a run
    #: (2026-12-06, #28)".
    node_fetch: float = 1.29
    #: per GB downloaded by ``hf download`` (huggingface_hub over plain HTTP, no Xet): its Python
    #: read-and-write loop, in one thread. BENCHMARKS.md "Time to ready, the estimate against a
    #: run (2026-12-06, #28)".
    hf_download: float = 1.86
    #: per GB hashed by ``hf cache verify`` (huggingface_hub's ``verify_maps``: hashlib's sha256,
    #: OpenSSL's, file after file in one thread, plus its reads). BENCHMARKS.md "Time to ready,
    #: the estimate against a run (2026-12-06, #28)".
    hf_cache_verify: float = 0.71
    #: seconds a command that reads from the hub (``fetch``, ``hf download``) spends besides its
    #: bytes: the interpreter's start, the listing and headers before the first byte, the last
    #: syncs and renames after it (launch to exit on k3-tiny, bench_start). BENCHMARKS.md "Time
    #: to ready, the estimate against a run (2026-12-06, #28)".
    hub_start_seconds: float = 0.6
    #: the same for a command on local files (``verify``, ``reshard``, ``hf cache verify``).
    #: BENCHMARKS.md "Time to ready, the estimate against a run (2026-12-06, #28)".
    local_start_seconds: float = 0.25
    #: seconds per tensor of the checkpoint that ``fetch --ranks`` adds to its start-up: the index
    #: and every shard's header read from the hub and planned from, the tensor-hash manifest
    #: loaded and checked against them (k3-full's 497,385 tensors against k3-tiny's).
    #: BENCHMARKS.md "Start-up at K3's inventory (2026-12-06, #28)".
    rank_fetch_per_tensor: float = 16.8e-6
    #: the same for ``fetch --node``. BENCHMARKS.md "Start-up at K3's inventory (2026-12-06, #28)".
    node_fetch_per_tensor: float = 18.9e-6
    #: the same for ``verify --manifest M`` of a share: the manifest and every header read and
    #: checked against each other before the first byte is hashed (a whole checkpoint's verify
    #: hashes while it parses them: none is counted there). Measured as a whole checkpoint's
    #: ``--quick``, an upper bound: a share parses its headers while the manifest loads.
    #: BENCHMARKS.md "Start-up at K3's inventory (2026-12-06, #28)".
    verify_per_tensor: float = 13.1e-6
    #: the same for ``reshard --node``: every header read and the node's directory planned.
    #: BENCHMARKS.md "Start-up at K3's inventory (2026-12-06, #28)".
    reshard_per_tensor: float = 8.3e-6

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"cost {name} must be more than zero, not {value!r}")


#: The figures the CLI uses.
MEASURED_COSTS = CostPerGB()


@dataclass(frozen=True)
class Limits:
    """What one node can do: ``link`` bytes/s in from the network, ``disk`` bytes/s through its
    disk (reads and writes together), ``cores`` CPU cores; ``memory``, its bytes of RAM, if
    known (only the naive route's flush depends on it: :func:`unwritten_at_exit`)."""

    link: float
    disk: float
    cores: int
    memory: float | None = None

    def __post_init__(self) -> None:
        if not (self.link > 0 and self.disk > 0 and self.cores >= 1 and (self.memory is None or self.memory > 0)):
            raise ValueError(f"limits must be positive: link {self.link!r}, disk {self.disk!r}, cores {self.cores!r}"
                             + (f", memory {self.memory!r}" if self.memory is not None else ""))


@dataclass
class NodeBytes:
    """What one node directory (``reshard --format node``) holds on disk: the node's share, which
    the estimate's fetch, verify and reshard steps move (:func:`k3ckpt.deploy.plan.node_bytes`
    counts it)."""

    node: int
    ranks: list[int]
    experts: int
    dense_bytes: int  # every non-expert tensor, whole
    expert_bytes: int  # the routed experts of the node's ranks

    @property
    def total_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes


@dataclass(frozen=True)
class StepEstimate:
    """One step on one node: the bytes it moves and checks, its CPU-seconds, and how long each
    limit alone would take; :attr:`seconds` is the longest, :attr:`bound` which one it is."""

    name: str
    download_bytes: int
    read_bytes: int
    write_bytes: int
    hash_bytes: int
    cpu_seconds: float
    link_seconds: float
    disk_seconds: float
    cpu_wall_seconds: float
    start_seconds: float = 0.0
    #: what the command left unwritten in the page cache at its exit, then flushed at the disk's rate
    flush_bytes: int = 0
    flush_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return self.start_seconds + max(self.link_seconds, self.disk_seconds, self.cpu_wall_seconds) + self.flush_seconds

    @property
    def bound(self) -> str:
        """``link``, ``disk`` or ``cpu``: the limit that sets the step's time (the first on a tie)."""
        times = {"link": self.link_seconds, "disk": self.disk_seconds, "cpu": self.cpu_wall_seconds}
        return max(times, key=times.__getitem__)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": self.seconds, "bound": self.bound}


def step_estimate(name: str, limits: Limits, *, downloads: int = 0, reads: int = 0, writes: int = 0,
                  hashes: int = 0, cpu_seconds: float = 0.0, threads: int | None = None,
                  start: float = 0.0, unsynced: bool = False) -> StepEstimate:
    """A step's time under ``limits``: ``start`` plus max(downloads / link, (reads + writes) /
    disk, CPU-s / the cores it can use), where a tool that hashes in ``threads`` threads uses at
    most that many; a step that leaves its ``writes`` to the kernel (``unsynced``) adds the flush
    of what is unwritten at its exit (:func:`unwritten_at_exit`) at the disk's rate."""
    cores = limits.cores if threads is None else min(limits.cores, threads)
    link_s, disk_s, cpu_s = downloads / limits.link, (reads + writes) / limits.disk, cpu_seconds / cores
    flush = unwritten_at_exit(writes, max(link_s, disk_s, cpu_s), limits.memory) if unsynced else 0
    return StepEstimate(name, download_bytes=downloads, read_bytes=reads, write_bytes=writes, hash_bytes=hashes,
                        cpu_seconds=cpu_seconds, link_seconds=link_s, disk_seconds=disk_s, cpu_wall_seconds=cpu_s,
                        start_seconds=start, flush_bytes=flush, flush_seconds=flush / limits.disk)


def unwritten_at_exit(written: int, seconds: float, memory: float | None) -> int:
    """The bytes still dirty in the page cache when a command that wrote ``written`` bytes over
    ``seconds`` without syncing exits: the kernel has written what was dirty for longer than
    :data:`DIRTY_EXPIRE_SECONDS`, and whatever passed :data:`DIRTY_BACKGROUND_RATIO` of
    ``memory`` when it is known (on a node that serves K3, with a TB or more, the expiry binds first)."""
    left = written if seconds <= DIRTY_EXPIRE_SECONDS else written * DIRTY_EXPIRE_SECONDS / seconds
    if memory is not None:
        left = min(left, DIRTY_BACKGROUND_RATIO * memory)
    return int(left)


@dataclass(frozen=True)
class RouteEstimate:
    """A route's steps on one node, run one after another."""

    name: str
    steps: tuple[StepEstimate, ...]

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "seconds": self.seconds, "steps": [s.to_json() for s in self.steps]}


#: The routes, in the order they are shown.
TWO_STEP, ONE_STEP, NAIVE = "fetch, verify, reshard", "fetch --node", "naive: hf download, verify"


@dataclass(frozen=True)
class NodeEstimate:
    node: int
    ranks: tuple[int, ...]
    routes: tuple[RouteEstimate, ...]

    def route(self, name: str) -> RouteEstimate:
        return next(r for r in self.routes if r.name == name)

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "ranks": list(self.ranks), "routes": [r.to_json() for r in self.routes]}


@dataclass
class ReadyEstimate:
    """Every node's routes under one set of limits and costs."""

    limits: Limits
    costs: CostPerGB
    checkpoint_bytes: int
    nodes: list[NodeEstimate] = field(default_factory=list)
    tensors: int = 0  # the checkpoint's: the start-up of a step reading every header grows with them

    def to_json(self) -> dict[str, Any]:
        return {"limits": {"link_bytes_per_second": self.limits.link, "disk_bytes_per_second": self.limits.disk,
                           "cores": self.limits.cores, "memory_bytes": self.limits.memory},
                "cpu_seconds_per_gb": asdict(self.costs), "checkpoint_bytes": self.checkpoint_bytes,
                "tensors": self.tensors, "nodes": [n.to_json() for n in self.nodes]}


def step_threads(cores: int) -> dict[str, int | None]:
    """How many threads each step hashes in by default on a node of ``cores`` cores, which caps
    the cores it can use: ``fetch`` and ``fetch --node`` hash each request's bytes in its thread
    (the default ``--jobs`` there, :func:`k3ckpt.hub.default_requests`), ``reshard`` writes with
    at most 16 writers, ``verify`` hashes one file per core (``None``: every core), and ``hf
    cache verify`` (huggingface_hub's ``verify_maps``) hashes file after file in one thread
    (BENCHMARKS.md: CPU/wall 1.00 on 2 cores), as ``hf download``'s threads do in effect: they
    share one interpreter, whose lock their Python loop holds. tests/test_estimate.py pins these
    to the commands' own defaults."""
    requests = default_requests(cores)
    return {"fetch": requests, "fetch --node": requests, "reshard": MAX_DEFAULT_WRITERS, "verify": None,
            "hf download": 1, "hf cache verify": 1}


def start_seconds(costs: CostPerGB, tensors: int) -> dict[str, float]:
    """The start-up of each step that reads every header of a checkpoint of ``tensors`` tensors
    before its first byte (``verify``: of a share); the whole ``fetch`` and the ``hf`` steps read
    none, and a whole checkpoint's ``verify`` hashes while it reads them: theirs is the command's
    alone."""
    hub, local = costs.hub_start_seconds, costs.local_start_seconds
    return {"fetch --ranks": hub + costs.rank_fetch_per_tensor * tensors,
            "verify": local + costs.verify_per_tensor * tensors,
            "reshard --node": local + costs.reshard_per_tensor * tensors,
            "fetch --node": hub + costs.node_fetch_per_tensor * tensors}


def _cpu(gb_cost: float, nbytes: int) -> float:
    return gb_cost * nbytes / GB


def engine_read_bytes(idx: InventoryIndex, topo: Topology, rank: int, held: set[int] | None) -> int:
    """The tensor bytes vLLM's expert-parallel load with ``--enable-ep-weight-filter`` reads on
    ``rank`` from a directory holding the experts ``held`` (``None``: every expert, the original
    layout): every dense tensor, the always-read parts (scales) of every held expert, and the
    filtered parts (:data:`FILTERED_PARTS`) of the rank's own experts."""
    size = [s.nbytes for s in idx.sigs]
    heavy = [s.part in FILTERED_PARTS for s in idx.sigs]
    own = set(topo.rank_info(rank).experts)
    total = sum(map(size.__getitem__, idx.dense_sigs))
    for e, counts in idx.expert_counts.items():
        if held is not None and e not in held:
            continue
        for s, n in counts.items():
            if e in own or not heavy[s]:
                total += n * size[s]
    return total


def estimate_ready(idx: InventoryIndex, topo: Topology, nodes: Sequence[NodeBytes], checkpoint_bytes: int,
                   limits: Limits, costs: CostPerGB = MEASURED_COSTS) -> ReadyEstimate:
    """The three routes (module docstring) for every node of ``nodes`` (the node directories of
    ``topo``, :func:`k3ckpt.deploy.plan.node_bytes`); ``checkpoint_bytes``: the whole checkpoint."""
    out = ReadyEstimate(limits, costs, checkpoint_bytes, tensors=idx.num_tensors)
    threads = step_threads(limits.cores)
    hub, local = costs.hub_start_seconds, costs.local_start_seconds
    starts = start_seconds(costs, idx.num_tensors)
    for nb in nodes:
        held = {e for r in nb.ranks for e in topo.rank_info(r).experts}
        share = nb.total_bytes
        whole = len(held) >= topo.num_experts
        load_node = sum(engine_read_bytes(idx, topo, r, held) for r in nb.ranks)
        load_orig = sum(engine_read_bytes(idx, topo, r, None) for r in nb.ranks)
        load_name = f"load (vLLM, {len(nb.ranks)} rank{'s' if len(nb.ranks) != 1 else ''})"
        two = RouteEstimate(TWO_STEP, (
            step_estimate("fetch" if whole else "fetch --ranks", limits, downloads=share, writes=share,
                          hashes=share, cpu_seconds=_cpu(costs.fetch if whole else costs.rank_fetch, share),
                          threads=threads["fetch"], start=hub if whole else starts["fetch --ranks"]),
            step_estimate("verify", limits, reads=share, hashes=share, cpu_seconds=_cpu(costs.verify, share),
                          threads=threads["verify"], start=local if whole else starts["verify"]),
            step_estimate("reshard --node", limits, reads=share, writes=share, hashes=share,
                          cpu_seconds=_cpu(costs.reshard, share), threads=threads["reshard"],
                          start=starts["reshard --node"]),
            step_estimate(load_name, limits, reads=load_node),
        ))
        one = RouteEstimate(ONE_STEP, (
            step_estimate("fetch --node", limits, downloads=share, writes=share, hashes=share,
                          cpu_seconds=_cpu(costs.node_fetch, share), threads=threads["fetch --node"],
                          start=starts["fetch --node"]),
            step_estimate(load_name, limits, reads=load_node),
        ))
        naive = RouteEstimate(NAIVE, (
            step_estimate("hf download", limits, downloads=checkpoint_bytes, writes=checkpoint_bytes,
                          cpu_seconds=_cpu(costs.hf_download, checkpoint_bytes), threads=threads["hf download"],
                          start=hub, unsynced=True),
            step_estimate("hf cache verify", limits, reads=checkpoint_bytes, hashes=checkpoint_bytes,
                          cpu_seconds=_cpu(costs.hf_cache_verify, checkpoint_bytes), threads=threads["hf cache verify"],
                          start=local),
            step_estimate(load_name, limits, reads=load_orig),
        ))
        out.nodes.append(NodeEstimate(nb.node, tuple(nb.ranks), (two, one, naive)))
    return out


def format_duration(seconds: float) -> str:
    """``1h02m``, ``4m28s``, ``0m07s``: whole seconds (minutes past an hour); under a second,
    ``0.4s`` (a small checkpoint's steps would otherwise all read ``0m00s``)."""
    if seconds < 0.95:
        return f"{seconds:.1f}s"
    s = round(seconds)
    h, rest = divmod(s, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s"


def render_ready(est: ReadyEstimate) -> list[str]:
    """The estimate as text lines: the model and figures used, then per group of nodes with the
    same numbers a table of routes and steps, and which route is fastest."""
    from ..utils import format_ranges, human_bytes

    def b(n: int) -> str:
        return human_bytes(n) if n else "-"

    lim, c = est.limits, est.costs
    threads = step_threads(lim.cores)
    flush = f"               hf download then flushes what it left unwritten (its last {DIRTY_EXPIRE_SECONDS:g} s of writes"
    flush_lines = ([f"{flush},", f"               at most {DIRTY_BACKGROUND_RATIO:.0%} of the memory)"]
                   if lim.memory is not None else [f"{flush})"])
    memory = f", {human_bytes(int(lim.memory))} of memory" if lim.memory is not None else ""
    starts = {name: f"{seconds:.1f} s" for name, seconds in start_seconds(c, est.tensors).items()}
    lines = [
        "time to ready  all nodes at once, each step after the last; a step takes its start-up",
        f"               ({c.hub_start_seconds:g} s from the hub, {c.local_start_seconds:g} s local, and reading and "
        "planning from every header",
        f"               of these {est.tensors:,} tensors first: fetch --ranks {starts['fetch --ranks']}, "
        f"verify of a share {starts['verify']},",
        f"               reshard {starts['reshard --node']}, fetch --node {starts['fetch --node']}) plus the longest of "
        "download / link,",
        "               (read + write) / disk and CPU-s / the cores it hashes on (fetch and",
        f"               fetch --node {threads['fetch']} requests, reshard {threads['reshard']} writers, hf download "
        f"and hf cache verify {threads['hf cache verify']});",
        *flush_lines,
        f"limits         per node: link {human_bytes(lim.link)}/s ({lim.link * 8 / GB:g} Gbit/s), "
        f"disk {human_bytes(lim.disk)}/s (reads + writes), {lim.cores} cores{memory}",
        f"CPU-s per GB   fetch {c.fetch:.2f}, fetch --ranks {c.rank_fetch:.2f}, verify {c.verify:.2f}, "
        f"reshard {c.reshard:.2f},",
        f"               fetch --node {c.node_fetch:.2f}, hf download {c.hf_download:.2f}, "
        f"hf cache verify {c.hf_cache_verify:.2f}",
    ]
    groups: dict[Any, list[NodeEstimate]] = {}
    for n in est.nodes:
        key = tuple((s.name, s.download_bytes, s.read_bytes, s.write_bytes, s.hash_bytes)
                    for r in n.routes for s in r.steps)
        groups.setdefault(key, []).append(n)
    for members in groups.values():
        first = members[0]
        ids = [n.node for n in members]
        lines += ["", (f"node {ids[0]}" if len(ids) == 1 else f"nodes {format_ranges(ids)}, each")
                  + f" ({len(first.ranks)} GPUs)",
                  f"{'route / step':<30} {'download':>10} {'write':>10} {'read':>10} {'hash':>10} {'CPU-s':>6} "
                  f"{'time':>6}  bound"]
        for route in first.routes:
            lines.append(f"{route.name:<30} {'':>10} {'':>10} {'':>10} {'':>10} {'':>6} "
                         f"{format_duration(route.seconds):>6}")
            for s in route.steps:
                cpu = "-" if not s.cpu_seconds else f"{s.cpu_seconds:,.0f}" if s.cpu_seconds >= 10 else f"{s.cpu_seconds:.2f}"
                lines.append(f"  {s.name:<28} {b(s.download_bytes):>10} {b(s.write_bytes):>10} "
                             f"{b(s.read_bytes):>10} {b(s.hash_bytes):>10} {cpu:>6} {format_duration(s.seconds):>6}  {s.bound}")
        best = min(first.routes, key=lambda r: r.seconds)
        naive = first.route(NAIVE)
        line = f"ready in       {format_duration(best.seconds)} by {best.name}"
        if best is not naive:
            line += f"; the naive route takes {format_duration(naive.seconds)} ({naive.seconds / best.seconds:.1f}x as long)"
        lines.append(line)
    return lines
