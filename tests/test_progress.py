"""Progress bars of the commands that can run for minutes (synth, inspect, preflight --full): a bar
on stderr when it is a terminal, nothing extra otherwise; and the byte counts behind the bars."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from k3ckpt.deploy import preflight as pf
from k3ckpt.deploy.reshard import reshard
from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.format.topology import RankSelection
from k3ckpt.testing.synth import spec_from_preset, synthesize

#: No GPU tool on this PATH; the launcher's variables are not read (--no-env).
ENV = {**os.environ, "PATH": "/usr/bin:/bin", "COLUMNS": "100"}


def k3ckpt(args: list[str], *, tty: bool) -> tuple[int, bytes, bytes]:
    """Run the CLI in a subprocess with stderr on a pseudo-terminal (``tty``) or a pipe:
    (exit code, stdout, stderr)."""
    cmd = [sys.executable, "-m", "k3ckpt", *args]
    if not tty:
        p = subprocess.run(cmd, capture_output=True, env=ENV, stdin=subprocess.DEVNULL, timeout=300)
        return p.returncode, p.stdout, p.stderr
    master, slave = pty.openpty()
    # a new pty has 0 columns, in which tqdm draws nothing: give it a terminal's size
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, env=ENV) as proc:
        os.close(slave)
        err = b""
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: the child closed its end
                break
            if not chunk:
                break
            err += chunk
        os.close(master)
        assert proc.stdout is not None
        out = proc.stdout.read()
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def layout(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("layout") / "k3-ep4-tp2"
    reshard(k3_tiny, out, RankSelection(ep=4, tp=2), layout="rank")
    return out


def commands(tmp: Path, k3_tiny: Path, layout: Path) -> dict[str, tuple[list[str], bytes]]:
    """Each command, and what its bar says."""
    return {
        "synth": (["synth", str(tmp / "synth"), "--force"], b"writing"),
        "inspect": (["inspect", str(k3_tiny)], b"reading headers"),
        "preflight --full (rank files hashed)": (["preflight", str(layout), "--full", "--no-env"], b"checking (--full)"),
        "preflight --full (scales scanned)": (["preflight", str(k3_tiny), "--full", "--no-env"], b"checking (--full)"),
    }


@pytest.mark.parametrize("which", ["synth", "inspect", "preflight --full (rank files hashed)",
                                   "preflight --full (scales scanned)"])
def test_bar_on_a_terminal_and_nothing_extra_without_one(which: str, k3_tiny: Path, layout: Path,
                                                         tmp_path: Path) -> None:
    args, label = commands(tmp_path, k3_tiny, layout)[which]
    code, out, err = k3ckpt(args, tty=False)
    assert err == b"", err
    tty_code, tty_out, tty_err = k3ckpt(args, tty=True)
    # the bar changes neither the result nor stdout (not compared whole: preflight's free-disk
    # figure moves between the two runs)
    assert tty_code == code and tty_out.splitlines()[0] == out.splitlines()[0]
    assert label not in tty_out and b"%|" not in tty_out
    assert label + b":" in tty_err and b"%|" in tty_err, tty_err[:300]


def test_json_output_draws_no_bar_even_on_a_terminal(k3_tiny: Path) -> None:
    code, _, err = k3ckpt(["inspect", str(k3_tiny), "--json"], tty=True)
    assert code == 0 and err == b""


class Counter:
    def __init__(self) -> None:
        self.planned: list[int] = []
        self.done = 0

    def plan(self, total: int) -> None:
        self.planned.append(total)

    def __call__(self, n: int) -> None:
        self.done += n


@pytest.mark.parametrize("jobs", [1, 2])
def test_synth_counts_every_tensor_byte(jobs: int, tmp_path: Path) -> None:
    c = Counter()
    res = synthesize(spec_from_preset("k3-tiny"), tmp_path / "s", jobs=jobs, progress=c, on_plan=c.plan)
    ckpt = open_checkpoint(res.path)
    assert c.planned == [c.done] and c.done == sum(t.nbytes for t in ckpt.tensors.values())


def test_open_checkpoint_counts_every_shard_header(k3_tiny: Path) -> None:
    c = Counter()
    ckpt = open_checkpoint(k3_tiny, progress=c, on_plan=c.plan)
    assert c.planned == [c.done] == [len(ckpt.shards)]


def test_preflight_full_counts_what_it_reads(k3_tiny: Path, layout: Path) -> None:
    hashed = Counter()
    assert pf.preflight(layout, full=True, use_env=False, environ={"PATH": "/usr/bin:/bin"},
                        progress=hashed, on_plan=hashed.plan).ok
    rank_files = sum(p.stat().st_size for p in layout.glob("rank-*/*.safetensors"))
    assert hashed.planned == [hashed.done] and hashed.done >= rank_files
    scanned = Counter()
    pf.preflight(k3_tiny, full=True, use_env=False, environ={"PATH": "/usr/bin:/bin"},
                 progress=scanned, on_plan=scanned.plan)
    scales = sum(t.nbytes for n, t in open_checkpoint(k3_tiny).tensors.items() if n.endswith("weight_scale"))
    assert scanned.planned == [scanned.done] == [scales]
    quick = Counter()
    pf.preflight(layout, use_env=False, environ={"PATH": "/usr/bin:/bin"}, progress=quick, on_plan=quick.plan)
    assert quick.planned == [] and quick.done == 0  # without --full nothing is read: no bar
