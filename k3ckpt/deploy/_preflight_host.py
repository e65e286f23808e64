"""Preflight's host checks: disk, memory, GPUs and MXFP4 support (capacity), licence, config and
quantization (provenance), and the read-speed test."""

from __future__ import annotations

import errno
import json
import mmap
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..env import K3CKPT_PREFLIGHT_FREE_BYTES, K3CKPT_PREFLIGHT_MEM_BYTES
from ..format.config import ModelConfig
from ..format.loadable import (
    CONFIG_NAME,
    README_NAME,
    Finding,
    config_findings,
    license_findings,
    license_source,
    readme_license,
    tokenizer_files,
)
from ..format.topology import (
    RankEnv,
)
from ..utils import format_ranges, human_bytes, release_pages
from ._memory import WEIGHT_OVERHEAD, loaded_bytes
from ._preflight_report import (
    FAIL,
    PASS,
    WARN,
    Check,
    GpuDevice,
    PreflightReport,
    ReadSpeed,
)

#: Test hook: free disk bytes to use instead of what ``statvfs`` says.
FREE_BYTES_HOOK = K3CKPT_PREFLIGHT_FREE_BYTES.name
#: Test hook: available host memory to use instead of ``/proc/meminfo``'s ``MemAvailable``.
MEM_BYTES_HOOK = K3CKPT_PREFLIGHT_MEM_BYTES.name
DEFAULT_MIN_FREE_DISK = 1024**3
#: How long ``nvidia-smi`` / ``rocm-smi`` may take before the GPU check gives up on it.
GPU_QUERY_TIMEOUT = 15.0
#: Bytes per read of the read-speed test (a multiple of every O_DIRECT alignment).
IO_BUFFER = 16 * 1024 * 1024

#: GPU name fragments -> how MXFP4 weights run there (k3-checkpoint.md: Hopper has no FP4).
MXFP4_NATIVE = ("B200", "B300", "GB200", "GB300", "BLACKWELL", "MI355", "MI350")
MXFP4_WEIGHT_ONLY = ("H100", "H200", "H800", "H20", "GH200")


# ---------------------------------------------------------------------------------------------
# Capacity


def disk_check(root: Path, min_free: int, still_to_write: int, environ: Mapping[str, str]) -> Check:
    """Free space on the filesystem of ``root``, which preflight and the engine only read: it
    matters for what is still to be written there (``still_to_write``: a layout's incomplete
    ranks, which their fix rewrites in place) - a FAIL when that does not fit, or cannot be
    written at all (a read-only mount). ``min_free`` (``--min-free-disk``) is a margin for the
    other writers sharing the filesystem: below it is a WARN, since loading needs no space."""
    st = os.statvfs(root)
    free = K3CKPT_PREFLIGHT_FREE_BYTES.get(environ)  # the hooks live where the launcher variables do
    via = f" ({FREE_BYTES_HOOK})" if free is not None else ""
    free = st.f_bavail * st.f_frsize if free is None else free
    details: dict[str, Any] = {"free_bytes": free, "need_bytes": min_free + still_to_write,
                               "read_only": bool(st.f_flag & os.ST_RDONLY)}
    if details["read_only"]:
        if still_to_write:
            return Check("disk", FAIL, f"{root} is on a read-only mount: the {human_bytes(still_to_write)} of ranks "
                                       f"still to be written cannot be written here",
                         fix=f"remount the filesystem of {root} read-write, or write the layout where it is "
                             f"(the rank rows' fix with another -o)", details=details)
        return Check("disk", PASS, f"read-only mount: preflight and the engine only read {root}, so no free "
                                   f"space is needed", details=details)
    if still_to_write and free < min_free + still_to_write:
        need = min_free + still_to_write
        return Check("disk", FAIL, f"{human_bytes(free)} free{via} on {root}, need {human_bytes(need)} "
                                   f"({human_bytes(still_to_write)} for ranks still to be written + "
                                   f"{human_bytes(min_free)} to keep free)",
                     fix=f"free {human_bytes(need - free)} on the filesystem of {root}", details=details)
    what = f"{human_bytes(min_free)} to keep free" + (
        f" + {human_bytes(still_to_write)} for ranks still to be written" if still_to_write else "")
    if free < min_free:
        return Check("disk", WARN, f"{human_bytes(free)} free{via} on {root}, below the {what}: loading writes "
                                   f"nothing here, but other writers on this filesystem may fail", details=details)
    return Check("disk", PASS, f"{human_bytes(free)} free{via}, need {human_bytes(min_free + still_to_write)} "
                               f"({what})", details=details)


def _mem_available(environ: Mapping[str, str]) -> tuple[int | None, str]:
    hooked = K3CKPT_PREFLIGHT_MEM_BYTES.get(environ)
    if hooked is not None:
        return hooked, f" ({MEM_BYTES_HOOK})"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, ""
    except (OSError, ValueError, IndexError):
        pass
    return None, ""


def memory_check(largest_file: int, local_ranks: int, environ: Mapping[str, str]) -> Check:
    """Host RAM: each local rank's loader may stage one whole weight file at a time."""
    avail, via = _mem_available(environ)
    need = largest_file * local_ranks
    if avail is None:
        return Check("host memory", WARN, "not checked: /proc/meminfo has no MemAvailable")
    rule = f"{local_ranks} rank(s) x largest file {human_bytes(largest_file)}"
    details = {"available_bytes": avail, "need_bytes": need}
    if avail < need:
        return Check("host memory", WARN, f"{human_bytes(avail)} available{via}, loaders may stage "
                                          f"{human_bytes(need)} ({rule}): expect swapping or the OOM killer",
                     details=details)
    return Check("host memory", PASS, f"{human_bytes(avail)} available{via}, need {human_bytes(need)} ({rule})",
                 details=details)


def query_gpus(environ: Mapping[str, str]) -> tuple[str | None, list[GpuDevice] | str]:
    """``(tool, devices)`` from ``nvidia-smi`` or ``rocm-smi`` on ``environ['PATH']``;
    ``(None, why)`` when neither is there, ``(tool, why)`` when it failed."""
    path = environ.get("PATH", os.defpath)
    for tool, args, parse in (
        ("nvidia-smi", ["--query-gpu=name,memory.total,memory.used", "--format=csv,noheader,nounits"], _parse_nvidia),
        ("rocm-smi", ["--showproductname", "--showmeminfo", "vram", "--json"], _parse_rocm),
    ):
        exe = shutil.which(tool, path=path)
        if exe is None:
            continue
        try:
            res = subprocess.run([exe, *args], capture_output=True, text=True, timeout=GPU_QUERY_TIMEOUT,
                                 env=dict(environ))
        except subprocess.TimeoutExpired:
            return tool, f"{tool} did not answer within {GPU_QUERY_TIMEOUT:.0f} s"
        except OSError as e:
            return tool, f"{tool} could not run ({e.strerror or e})"
        if res.returncode != 0:
            last = (res.stderr or res.stdout).strip().splitlines()
            return tool, f"{tool} exited {res.returncode}" + (f": {last[-1]}" if last else "")
        try:
            devices = parse(res.stdout)
        except (ValueError, KeyError, TypeError) as e:
            return tool, f"{tool}: unexpected output ({e})"
        return tool, _visible(devices, environ, tool)
    return None, "neither nvidia-smi nor rocm-smi is on PATH"


def _parse_nvidia(out: str) -> list[GpuDevice]:
    devices = []
    for i, line in enumerate(x for x in out.splitlines() if x.strip()):
        name, total, used = (p.strip() for p in line.rsplit(",", 2))
        devices.append(GpuDevice(i, name, int(float(total)) * 1024**2, int(float(used)) * 1024**2))
    if not devices:
        raise ValueError("no GPUs listed")
    return devices


def _parse_rocm(out: str) -> list[GpuDevice]:
    data = json.loads(out)
    devices = []
    for i, (card, info) in enumerate(sorted((k, v) for k, v in data.items() if k.startswith("card"))):
        name = next((info[k] for k in ("Card Series", "Card series", "Card model", "Card SKU") if info.get(k)), card)
        total = int(next(v for k, v in info.items() if "Total Memory (B)" in k))
        used = int(next(v for k, v in info.items() if "Total Used Memory (B)" in k))
        devices.append(GpuDevice(i, str(name), total, used))
    if not devices:
        raise ValueError("no GPUs listed")
    return devices


def _visible(devices: list[GpuDevice], environ: Mapping[str, str], tool: str) -> list[GpuDevice]:
    """The devices the engine will see: ``CUDA_VISIBLE_DEVICES`` (``HIP_``/``ROCR_`` on AMD)
    by index, renumbered from 0 as the runtime does."""
    var = ("CUDA_VISIBLE_DEVICES",) if tool == "nvidia-smi" else ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
    for v in var:
        raw = environ.get(v)
        if raw is None or raw.strip() == "":
            continue
        items = [x.strip() for x in raw.split(",")]
        if not all(x.isdigit() for x in items):
            return devices  # UUIDs: keep the tool's order
        picked = [devices[int(x)] for x in items if int(x) < len(devices)]
        return [GpuDevice(i, d.name, d.total, d.used) for i, d in enumerate(picked)]
    return devices


def device_slots(ranks: list[int], per_node: int | None, env: RankEnv) -> dict[int, int]:
    """Which local device each rank runs on: its local rank (``rank % per_node``), the launcher's
    ``LOCAL_RANK`` for a single rank, else its position in the node's list."""
    if len(ranks) == 1 and env.local_rank is not None:
        return {ranks[0]: env.local_rank}
    if per_node:
        return {r: r % per_node for r in ranks}
    return {r: i for i, r in enumerate(ranks)}


def mxfp4_support(gpu_name: str) -> str | None:
    """``native``, ``weight-only`` or ``None`` (unknown) for a GPU's product name."""
    up = gpu_name.upper().replace(" ", "")
    if any(k in up for k in MXFP4_NATIVE):
        return "native"
    if any(k in up for k in MXFP4_WEIGHT_ONLY):
        return "weight-only"
    return None


def gpu_checks(need: Mapping[int, int | None] | None, slots: Mapping[int, int], kv_budget: int,
               environ: Mapping[str, str], *, mxfp4: bool) -> list[Check]:
    """GPU memory per local rank (weights x 1.15 + KV budget <= free), then the MXFP4 note.
    ``need``: rank -> weight bytes (``None`` for a rank not yet written); ``None`` when no
    topology says what a GPU loads."""
    tool, devices = query_gpus(environ)
    if isinstance(devices, str):
        what = "GPU memory and MXFP4 support" if mxfp4 else "GPU memory"
        return [Check("gpu", WARN, f"{what} not checked: {devices}")]
    out = []
    short, unknown, fixes = [], [], []
    for r, weights in sorted((need or {}).items()):
        slot = slots.get(r, 0)
        if slot >= len(devices):
            short.append(f"rank {r} needs device {slot} but {tool} shows {len(devices)}")
            fixes.append(f"run on a node with {slot + 1} GPUs visible (CUDA_VISIBLE_DEVICES), or give "
                         f"--gpus-per-node the number it has")
            continue
        if weights is None:
            unknown.append(r)
            continue
        loaded = loaded_bytes(weights)
        want = loaded + kv_budget
        d = devices[slot]
        if want > d.free:
            short.append(f"rank {r} needs {human_bytes(want)} ({human_bytes(weights)} x {WEIGHT_OVERHEAD} + "
                         f"{human_bytes(kv_budget)} KV) but GPU {slot} ({d.name}) has {human_bytes(d.free)} free")
            fixes.append(f"--kv-budget {(d.free - loaded) >> 20}MiB at most fits rank {r} on GPU {slot}, or free its "
                         f"{human_bytes(d.used)} in use" if loaded < d.free else
                         f"rank {r}'s weights alone need {human_bytes(loaded)} of GPU {slot}'s "
                         f"{human_bytes(d.free)} free: spread them over more GPUs (a larger --tp/--dp)")
    names = sorted({d.name for d in devices})
    seen = f"{len(devices)} x {' / '.join(names)} ({tool})"
    details = {"devices": [d.__dict__ | {"free": d.free} for d in devices], "kv_budget": kv_budget}
    if short:
        more = f" (+{len(short) - 1} more)" if len(short) > 1 else ""
        out.append(Check("gpu", FAIL, short[0] + more, fix=fixes[0], details={**details, "problems": short}))
    elif unknown:
        out.append(Check("gpu", WARN, f"{seen}; weights of ranks {format_ranges(unknown)} unknown (no manifest yet)",
                         details=details))
    elif need:
        biggest = max(w for w in need.values() if w is not None)
        out.append(Check("gpu", PASS, f"{seen}: every rank fits (largest: {human_bytes(biggest)} x "
                                      f"{WEIGHT_OVERHEAD} + {human_bytes(kv_budget)} KV)", details=details))
    else:
        out.append(Check("gpu", WARN, f"{seen}; not compared: give --ep/--tp so preflight knows what each GPU "
                                      f"loads", details=details))
    if mxfp4:
        out.append(mxfp4_row(names))
    return out


def mxfp4_row(names: list[str]) -> Check:
    kinds = {n: mxfp4_support(n) for n in names}
    if all(k == "native" for k in kinds.values()):
        return Check("mxfp4", PASS, f"MXFP4 runs natively on {', '.join(names)}")
    if all(k in ("native", "weight-only") for k in kinds.values()):
        slow = [n for n, k in kinds.items() if k == "weight-only"]
        return Check("mxfp4", PASS, f"weight-only MXFP4 on {', '.join(slow)} (Hopper has no FP4: weights stay "
                                    f"MXFP4 in memory and are upcast in-kernel, W4A16)")
    odd = [n for n, k in kinds.items() if k is None]
    return Check("mxfp4", WARN, f"no known MXFP4 support on {', '.join(odd)}: check that the engine has a "
                                f"weight-only MXFP4 kernel for it")


# ---------------------------------------------------------------------------------------------
# Provenance


def license_kind(text: str) -> tuple[str, str]:
    """``(kind, status)`` of a license by its content. K3's "Modified MIT" is not plain MIT: it
    adds an attribution condition for large deployments."""
    head = " ".join(text.split()).lower()
    if "modified mit" in head:
        return "Modified MIT (not plain MIT: adds a display/attribution condition for large deployments)", PASS
    if "apache license" in head and "version 2.0" in head:
        return "Apache-2.0", PASS
    if "mit license" in head or "permission is hereby granted, free of charge" in head:
        return "MIT", PASS
    return "unrecognized license text (read it)", WARN


#: Builds the command that restores the named files (relative to the directory), or ``None``.
Restorer = Callable[[list[str]], "str | None"]


def provenance_files(root: Path, source: dict[str, Any] | None, restore: Restorer | None) -> list[Check]:
    """What an engine reads beside the weights (:mod:`k3ckpt.format.loadable`: config.json, the
    tokenizer, the licence; each missing or unreadable file is a FAIL naming it, with
    ``restore``'s command as its fix) and where the checkpoint came from."""
    cfg, config_found = config_findings(root)
    tok_present, tok_found = tokenizer_files(root)

    def row(name: str, found: list[Finding], ok: str) -> Check:
        if not found:
            return Check(name, PASS, ok)
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        fix = restore(sorted({_rel(root, f.path) for f in found})) if restore else None
        return Check(name, FAIL, f"{found[0]}{more}", fix=fix, details={"missing": [str(f) for f in found]})

    out = [row("config", config_found, _describe_config(cfg) if cfg else ""),
           row("tokenizer", tok_found, ", ".join(_rel(root, p) for p in tok_present) + " present"),
           _license_row(root, restore)]
    src = source or {}
    repo, rev = src.get("repo"), src.get("revision")
    digest = src.get("index_sha256")
    if rev:
        where = f"{repo}@{rev}" if repo else f"revision {rev}"
        extra = f", index sha256 {digest[:12]}..." if digest else ""
        out.append(Check("source", PASS, f"from {where}{extra}"))
    elif source is None:
        out.append(Check("source", WARN, "not recorded: no usable topology.json"))
    else:
        extra = f" (only the index sha256 {digest[:12]}... is recorded)" if digest else ""
        out.append(Check("source", WARN, f"source revision not recorded: the checkpoint did not come from a "
                                         f"hub download k3ckpt could identify{extra}"))
    return out


def _rel(root: Path, path: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return str(path)


def _describe_config(cfg: ModelConfig) -> str:
    experts = f", {cfg.num_experts} routed experts in {len(cfg.moe_layers)} MoE layers" if cfg.moe_layers else ""
    return f"{CONFIG_NAME}: {cfg.model_type or cfg.family}, {cfg.num_layers} layers{experts}"


def _license_row(root: Path, restore: Restorer | None) -> Check:
    lic = license_source(root)
    if lic is None:
        found = license_findings(root)
        return Check("license", FAIL, str(found[0]), fix=restore([_rel(root, found[0].path)]) if restore else None)
    if lic.name == README_NAME:
        return Check("license", PASS, f"{README_NAME} metadata: license {readme_license(lic)}")
    try:
        kind, status = license_kind(lic.read_text(errors="replace")[:20000])
    except OSError as e:
        kind, status = f"unreadable ({e.strerror})", WARN
    return Check("license", status, f"{lic.name}: {kind}")


def quant_check(cfg: ModelConfig | None, mx: int, fp8: int) -> Check:
    """The quantization format ``config.json`` declares against the ``mx`` MXFP4 weights and
    ``fp8`` FP8 tensors present."""
    if cfg is None:
        return Check("quantization", WARN, "no readable config.json: the quantization format was not checked")
    declared = cfg.quant_format
    found = f"{mx:,} MXFP4 weights" if mx else (f"{fp8:,} FP8 tensors" if fp8 else "no quantized tensors")
    says = declared or "no quantization_config"
    ok = ((mx > 0) == bool(declared and "mxfp4" in declared)
          and (not (declared or "").startswith("fp8") or fp8 > 0))
    if not ok:
        return Check("quantization", FAIL, f"config.json says {says} but the tensors have {found}",
                     fix="compare config.json's quantization_config with the checkpoint's source and restore "
                         "whichever was changed (the config, or the weights)",
                     details={"declared": declared, "mxfp4_tensors": mx, "fp8_tensors": fp8})
    return Check("quantization", PASS, f"config.json says {says}; {found}",
                 details={"declared": declared, "mxfp4_tensors": mx, "fp8_tensors": fp8})


# ---------------------------------------------------------------------------------------------
# Read speed


def measure_read_speed(files: list[Path], seconds: float, *, readers: int = 4) -> ReadSpeed:
    """Read ``files`` for at most ``seconds`` with ``readers`` threads, bypassing the page cache
    with O_DIRECT where the filesystem allows it. Where it does not (tmpfs answers EINVAL),
    the file is read buffered after ``POSIX_FADV_DONTNEED`` dropped its cached pages - which a
    RAM-backed filesystem cannot honour, so :attr:`ReadSpeed.note` says so.

    Raises:
        OSError: a file cannot be opened or read (an I/O error is a finding, not a speed).
    """
    queue = list(reversed(files))
    lock = threading.Lock()
    total = [0]
    fellback: list[str] = []
    errors: list[OSError] = []
    deadline = time.monotonic() + seconds

    def worker() -> None:
        buf = mmap.mmap(-1, IO_BUFFER)  # page-aligned, as O_DIRECT requires
        try:
            while time.monotonic() < deadline:
                with lock:
                    if not queue or errors:
                        return
                    f = queue.pop()
                n, direct = _read_file(f, buf, deadline)
                with lock:
                    total[0] += n
                    if not direct:
                        fellback.append(f.name)
        except OSError as e:
            if not e.filename:
                e.filename = str(f)
            with lock:
                errors.append(e)
        finally:
            buf.close()

    n_threads = max(1, min(readers, len(files)))
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, name=f"io-test-{i}") for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    if errors:
        raise errors[0]
    note = ""
    if fellback:
        note = (f"O_DIRECT refused for {len(fellback)} file(s) (tmpfs before Linux 6.6, some FUSE and network "
                f"filesystems): read buffered after "
                f"POSIX_FADV_DONTNEED; a RAM-backed filesystem keeps its pages, so this is memory speed")
    return ReadSpeed(total[0], elapsed, n_threads, not fellback, len(files), note)


def _read_file(path: Path, buf: mmap.mmap, deadline: float) -> tuple[int, bool]:
    """Bytes read from ``path`` until its end or ``deadline``, and whether O_DIRECT held."""
    direct = hasattr(os, "O_DIRECT")
    fd = -1
    if direct:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            direct = False
    if not direct:
        fd = _open_uncached(path)
    pos = 0
    try:
        while time.monotonic() < deadline:
            try:
                n = os.preadv(fd, [buf], pos)
            except OSError as e:
                if not (direct and e.errno == errno.EINVAL):
                    raise
                os.close(fd)  # the filesystem accepted O_DIRECT at open but not for reads
                fd, direct = _open_uncached(path), False
                continue
            if n == 0:
                break
            pos += n
    finally:
        os.close(fd)
    return pos, direct


def _open_uncached(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    release_pages(fd, 0, 0)  # length 0: to the end of the file
    return fd


def io_check(report: PreflightReport, seconds: float) -> None:
    files, node_bytes = report.load_files, report.node_bytes
    if not files:
        report.checks.append(Check("read speed", WARN, "not measured: no complete weight files to read"))
        return
    try:
        rs = measure_read_speed(files, seconds, readers=max(1, min(len(report.ranks) or 1, 8)))
    except OSError as e:
        report.checks.append(Check("read speed", FAIL, f"{e.filename or ''}: read failed ({e.strerror or e})",
                                   fix="the engine's load would fail the same way: check the device (dmesg, "
                                       "smartctl) and write the file again"))
        return
    report.read_speed = rs
    rate = rs.bytes_per_second
    mode = "O_DIRECT" if rs.direct else "buffered"
    predicted = node_bytes / rate if rate else None
    when = f"; this node's {human_bytes(node_bytes)} would load in ~{_duration(predicted)}" if predicted else ""
    reason = (f"{human_bytes(rate)}/s ({human_bytes(rs.bytes_read)} in {rs.seconds:.1f} s, {mode}, "
              f"{rs.readers} reader(s)){when}")
    status = PASS if rs.direct else WARN
    report.checks.append(Check("read speed", status, reason + (f"; {rs.note}" if rs.note else ""),
                               details={**rs.to_json(), "node_bytes": node_bytes,
                                        "predicted_load_seconds": round(predicted, 1) if predicted else None}))


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"
