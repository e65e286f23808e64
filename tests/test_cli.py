"""The CLI: help with examples, one-line errors with the right exit codes, --json, --version."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import click
import pytest

from helpers import assert_one_line_error, run, walk_commands
from k3ckpt import __version__
from k3ckpt.cli import main


def test_version_and_module_entry_point() -> None:
    assert run("--version").output.strip() == f"k3ckpt, version {__version__}"
    out = subprocess.run([sys.executable, "-m", "k3ckpt", "--version"], capture_output=True, text=True, check=True)
    assert __version__ in out.stdout


def test_commands_load_by_name() -> None:
    """The root group imports a command's module on first use (``k3ckpt --version`` imports
    none): every listed name gives the command of that name, an unknown one is a usage error
    with a suggestion, as click says it."""
    ctx = click.Context(main)
    names = main.list_commands(ctx)
    assert names == sorted(names) and {"verify", "fetch", "reshard", "mx", "serve-command"} <= set(names)
    assert all(getattr(main.get_command(ctx, n), "name", None) == n for n in names)
    assert main.get_command(ctx, "nope") is None
    res = run("verifyy", "x")
    assert res.exit_code == 2 and "No such command 'verifyy'. Did you mean 'verify'?" in res.output


@pytest.mark.parametrize("path", [path for path, _ in walk_commands()], ids=" ".join)
def test_every_command_has_help_with_an_example(path: tuple[str, ...]) -> None:
    res = run(*path, "--help")
    assert res.exit_code == 0
    assert "Example" in res.output and f"k3ckpt {' '.join(path)}" in res.output


def _options_named(flag: str) -> list[tuple[str, click.Option]]:
    return [(" ".join(path), p) for path, cmd in walk_commands() for p in cmd.params
            if isinstance(p, click.Option) and flag in p.opts]


def test_every_json_option_comes_from_the_shared_decorator() -> None:
    """``--json`` is declared once (cli._options.json_option): an option declared by hand is a
    plain click.Option, so a second class, or a different name or default, shows up here."""
    found = _options_named("--json")
    assert len(found) >= 16, [where for where, _ in found]
    assert {type(p) for _, p in found} != {click.Option}
    first = found[0][1]
    for where, p in found:
        assert type(p) is type(first), where
        assert (p.name, p.opts, p.secondary_opts, p.is_flag) == ("as_json", ["--json"], [], True), where
        assert (p.default, p.flag_value, p.required) == (first.default, first.flag_value, first.required), where


def test_topology_options_mean_the_same_everywhere() -> None:
    """The topology options come from one table: the same type (and so the same checks) in
    every command that takes them."""
    for flag in ("--ep", "--tp", "--world-size", "--placement", "--ranks", "--node", "--gpus-per-node"):
        found = _options_named(flag)
        assert len(found) >= 2, flag
        assert len({repr(p.type) for _, p in found}) == 1, (flag, [(w, p.type) for w, p in found])


def test_inspect_text_and_json(k3_tiny: Path) -> None:
    res = run("inspect", str(k3_tiny))
    assert res.exit_code == 0, res.output
    assert "16 routed, 4 active per token" in res.output
    res = run("inspect", str(k3_tiny), "--json", "--layers")
    assert res.exit_code == 0
    data = json.loads(res.output)
    assert data["num_layers"] == 5 and len(data["layers"]) == 5
    assert data["findings"] == [] and data["family"] == "kimi_k3"


def test_missing_directory_exits_2(tmp_path: Path) -> None:
    assert_one_line_error(run("inspect", str(tmp_path / "nope")), 2, "nope", "no such directory")


def test_not_a_checkpoint_exits_2(tmp_path: Path) -> None:
    assert_one_line_error(run("inspect", str(tmp_path)), 2, "no model.safetensors.index.json and no model.safetensors")


def test_malformed_header_exits_2_naming_the_shard(k3_tiny: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    shutil.copytree(k3_tiny, root)
    shard = root / "model-00003-of-000008.safetensors"
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8 + n // 2] = 0xFF  # not UTF-8 inside the JSON
    shard.write_bytes(bytes(data))
    assert_one_line_error(run("inspect", str(root)), 2, "model-00003-of-000008.safetensors", "not valid UTF-8")


def test_truncated_shard_exits_2(k3_tiny: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    shutil.copytree(k3_tiny, root)
    shard = root / "model-00002-of-000008.safetensors"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 100)
    assert_one_line_error(run("inspect", str(root)), 2, "model-00002-of-000008.safetensors", "data buffer")


def test_contradicting_config_exits_1(k3_tiny: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    shutil.copytree(k3_tiny, root)
    cfg = json.loads((root / "config.json").read_text())
    cfg["text_config"]["num_experts"] = 20
    (root / "config.json").write_text(json.dumps(cfg))
    res = run("inspect", str(root))
    assert res.exit_code == 1
    assert "ERROR layer 1: 4 of 20 routed experts missing" in res.output


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_shows_the_traceback_and_keeps_the_exit_code(tmp_path: Path, where: str) -> None:
    """``--debug`` adds the traceback; the one line and the exit code stay what a script sees
    without it (issue #25: it turned exit 2 into 1)."""
    args = ["inspect", str(tmp_path / "nope")]
    res = run("--debug", *args) if where == "before" else run(*args, "--debug")
    assert res.exit_code == 2, res.output
    assert "Traceback (most recent call last)" in res.stderr and "CheckpointNotFoundError" in res.stderr
    assert res.stderr.rstrip().splitlines()[-1] == f"k3ckpt: error: {tmp_path / 'nope'}: no such directory"


def test_synth_cli_json_and_refusals(tmp_path: Path) -> None:
    res = run("synth", str(tmp_path / "s"), "--preset", "k3-tiny", "--layers", "2", "--experts", "4",
              "--active", "2", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["tensors"] > 0 and Path(data["path"]).is_dir()
    again = run("synth", str(tmp_path / "s"), "--preset", "k3-tiny")
    assert_one_line_error(again, 2, "holds a synthetic checkpoint already (use --force to replace it)")
    bad = run("synth", str(tmp_path / "t"), "--moe-intermediate", "40")
    assert_one_line_error(bad, 2, "multiple of the MXFP4 block size")


def test_console_script_subprocess(k3_tiny: Path) -> None:
    """The installed entry point, as a user runs it: quiet stderr on success."""
    exe = Path(sys.executable).with_name("k3ckpt")
    out = subprocess.run([str(exe), "inspect", str(k3_tiny), "--json"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stderr == ""
    assert json.loads(out.stdout)["tensors"] > 500
