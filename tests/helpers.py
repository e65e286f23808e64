"""Helpers shared by the test modules (fixtures live in ``conftest.py``; helpers that break a
checkpoint in precise ways in ``ckpt_edit.py``).

Import them as ``from helpers import run`` (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
from click.testing import CliRunner, Result

from k3ckpt.cli import main
from k3ckpt.format import open_checkpoint

REPO = "moonshotai/Kimi-K3"
"""The repo name the loopback hub serves the synthetic checkpoints under."""


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    """Run ``k3ckpt ARGS...`` in-process; an unexpected exception propagates (with its traceback)."""
    return CliRunner().invoke(main, list(args), catch_exceptions=False, env=env)


def hub_offline(monkeypatch: Any) -> None:
    """``HF_HUB_OFFLINE=1`` as the Hugging Face client (and so ``k3ckpt fetch``) sees it: the
    client reads the variable at import, so its constant is set too (``monkeypatch`` undoes both)."""
    import huggingface_hub.constants as hfc

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", True)


def assert_one_line_error(res: Result, code: int, *needles: str) -> None:
    """The command failed with exit ``code`` and said so in one ``k3ckpt: error: ...`` line on
    stderr (no traceback) that contains every one of ``needles``; stdout holds nothing or - under
    ``--json`` - exactly the JSON error object carrying the same message (docs/errors.md)."""
    assert res.exit_code == code, res.output
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3ckpt: error: "), res.output
    assert "Traceback" not in res.output
    for n in needles:
        assert n in lines[0], lines[0]
    if res.stdout.strip():
        error = json.loads(res.stdout)["error"]
        assert set(error) == {"kind", "path", "message"}, error
        assert lines[0] == f"k3ckpt: error: {error['message']}", res.output


def shard_of(root: Path, tensor: str) -> str:
    """The shard file (relative name) holding ``tensor`` in the checkpoint at ``root``."""
    return open_checkpoint(root).tensors[tensor].file


def tensor_digests(root: Path) -> dict[str, str]:
    """sha256 of every tensor's bytes, read through the headers."""
    ckpt = open_checkpoint(root)
    out = {}
    for name, info in ckpt.tensors.items():
        hdr = ckpt.shards[info.file]
        with open(hdr.path, "rb") as fh:
            fh.seek(hdr.data_start + info.begin)
            out[name] = hashlib.sha256(fh.read(info.nbytes)).hexdigest()
    return out


def segments_digest(raw: bytes) -> str:
    """A node file's digest as docs/trust.md defines it, computed here from the file's bytes
    alone (not with k3ckpt's code): sha256 of the header's sha256 (8-byte length, JSON and
    padding) followed by each tensor's sha256, in file order."""
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n
    entries = [v["data_offsets"] for k, v in json.loads(raw[8:start]).items() if k != "__metadata__"]
    out = hashlib.sha256(hashlib.sha256(raw[:start]).digest())
    for b, e in sorted(entries):
        out.update(hashlib.sha256(raw[start + b:start + e]).digest())
    return out.hexdigest()


def settled(count: Callable[[], int], want: int, timeout: float = 5.0) -> int:
    """``count()`` once it reaches ``want`` (or after ``timeout`` s): the loopback hub's handler
    threads add a body's bytes to their counters after ``sendfile`` returns, which can be just
    after the client has read the body. A count that never reaches ``want`` is returned as is,
    for the caller's assertion to show."""
    deadline = time.monotonic() + timeout
    while count() < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return count()


def kill_at_pause(code: str, args: list[str], point: str, tmp_path: Path) -> None:
    """Run ``python -c code *args`` with the fetch test hook armed at ``point``
    (``K3CKPT_TEST_PAUSE_AT``), wait until the child has frozen itself there, and SIGKILL it: a
    crash at an exact moment. The child gets no hub or k3ckpt settings of this process's."""
    paused = tmp_path / "paused"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MODELSCOPE_", "K3CKPT_"))}
    env.update(HF_HOME=str(tmp_path / "hf-home"), HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
               K3CKPT_TEST_PAUSE_AT=point, K3CKPT_TEST_PAUSE_FILE=str(paused))
    proc = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not paused.exists():
        if proc.poll() is not None:
            assert proc.stderr is not None
            raise AssertionError(f"child exited ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
        assert time.monotonic() < deadline, "the child never reached its pause point"
        time.sleep(0.01)
    proc.kill()
    proc.wait()


def walk_commands(group: click.Group = main, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    """Every command and group under ``group`` with its path, groups before their commands,
    asked the way click asks (``list_commands``/``get_command``: the root loads its commands
    lazily, so its ``commands`` mapping holds only those looked up so far)."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        cmd = group.get_command(ctx, name)
        assert cmd is not None, (prefix, name)
        yield (*prefix, name), cmd
        if isinstance(cmd, click.Group):
            yield from walk_commands(cmd, (*prefix, name))
