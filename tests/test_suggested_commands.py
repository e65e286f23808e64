"""Every command k3ckpt suggests runs as printed, in today's words, and does what it promises.

Issue #25: preflight's fixes and the messages spoke hidden legacy flags (``--dest``, ``--repo``,
``--source hf``, ``--ep 8 --tp 4`` for a node directory), dropped the ``--manifest`` the
directory was fetched with, and named commands that could not run as written. Here a campaign
of preflight FAILs (the cases ``test_preflight.py`` builds, on rank layouts, node directories,
downloads, rank-aware fetches and a Hugging Face cache) and of refusals and notes (fetch, reshard)
is driven through the CLI; every suggested command is taken from what was *printed* - the
``fix:`` lines, ``fix all``, and the commands messages quote in backticks - and run as a user
would paste it (placeholders such as ``REPO`` or ``SRC`` filled with what a user knows), against
the loopback hub (``HF_ENDPOINT``). None may exit 2, and a fix must fix: the preflight it came
from passes afterwards (on the directory it wrote, when it writes a new one).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest

from helpers import REPO, run, walk_commands
from k3ckpt.deploy.reshard import reshard
from k3ckpt.format.topology import RankSelection

#: No GPU tool on this PATH (tests that want a GPU FAIL add a fake one in front).
NO_GPU = {"PATH": "/usr/bin:/bin"}
HF = Path(sys.executable).with_name("hf")
#: Commands quoted in a message: `k3ckpt ...`
QUOTED = re.compile(r"`(k3ckpt [^`]+)`")


@pytest.fixture(scope="module")
def served(k3_tiny: Path) -> Path:
    """What the module's loopback hub serves (``conftest.module_hub``): k3-tiny itself, which it only reads."""
    return k3_tiny


@pytest.fixture
def env(hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_hub_clients: None) -> dict[str, str]:
    """What a user's shell has: the hub's endpoint (the loopback hub), a cache of its own, and
    no GPU tool; the working directory is the test's."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("K3CKPT_CACHE_DIR", str(tmp_path / "k3ckpt-cache"))
    monkeypatch.chdir(tmp_path)
    return {**NO_GPU, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1"}


# -- printed words -----------------------------------------------------------------------------


def _hidden_aliases() -> dict[str, set[str]]:
    """command path ("fetch", "manifest pull") -> the option names it accepts but does not show."""
    out: dict[str, set[str]] = {}
    for path, cmd in walk_commands():
        if isinstance(cmd, click.Group):
            continue
        ctx = click.Context(cmd, info_name=" ".join(path))
        hidden: set[str] = set()
        for p in cmd.params:
            if not isinstance(p, click.Option):
                continue
            rec = p.get_help_record(ctx)
            shown = set(rec[0].replace(",", " ").replace("/", " ").split()) if rec else set()
            hidden |= {o for o in p.opts + p.secondary_opts if o not in shown}
        out[" ".join(path)] = hidden
    return out


HIDDEN = _hidden_aliases()
#: Option names no command shows (``--dest``, ``--workers``, ``--rank``...): never in any words.
NOWHERE_SHOWN = set().union(*HIDDEN.values()) - {
    o for path, cmd in walk_commands() if not isinstance(cmd, click.Group) for p in cmd.params
    if isinstance(p, click.Option) and (rec := p.get_help_record(click.Context(cmd))) is not None
    for o in rec[0].replace(",", " ").replace("/", " ").split()}


def assert_todays_words(argv: list[str]) -> None:
    """A suggested k3ckpt command uses no option its command hides (the legacy spellings), and
    no ``--source hf`` (the default, said for nothing)."""
    words = argv[1:]
    command = " ".join(words[:2]) if " ".join(words[:2]) in HIDDEN else words[0]
    legacy = [w for w in words if w.split("=")[0] in HIDDEN[command]]
    assert not legacy, f"{shlex.join(argv)}: hidden option(s) {legacy} - say it in today's words"
    assert "--source hf" not in shlex.join(argv), shlex.join(argv)


def printed_fixes(output: str) -> list[str]:
    """The commands a preflight report printed: its ``fix:`` lines and ``fix all``."""
    out = [m.group(1) for m in re.finditer(r"^\s+fix: (.*)$", output, re.MULTILINE)]
    out += [m.group(1) for m in re.finditer(r"^fix all\s+(.*)$", output, re.MULTILINE)]
    return out


def is_command(text: str) -> bool:
    return text.split(" ", 1)[0] in ("k3ckpt", "cp", "hf")


def run_as_printed(text: str, fill: dict[str, str] | None = None, *, env: dict[str, str]) -> tuple[int, str]:
    """Run a printed command as a user pastes it, placeholders replaced by ``fill`` (what the
    user knows: the repo, the source directory). Returns (exit code, output); exit 2 - a usage
    error, an option that does not exist - fails here."""
    argv = [(fill or {}).get(a, a) for a in shlex.split(text)]
    if argv[0] == "k3ckpt":
        assert_todays_words(argv)
        res = run(*argv[1:], env=env)
        code, output = res.exit_code, res.output
    else:
        if argv[0] == "hf" and not HF.exists():
            pytest.skip("the hf CLI of huggingface_hub is not installed next to python")
        proc = subprocess.run([str(HF) if argv[0] == "hf" else argv[0], *argv[1:]], capture_output=True, text=True,
                              timeout=300, env={**os.environ, **env})
        code, output = proc.returncode, proc.stdout + proc.stderr
    assert code != 2, f"{shlex.join(argv)} exited 2:\n{output}"
    return code, output


def preflight(d: Path, *args: str, env: dict[str, str]) -> tuple[int, str]:
    res = run("preflight", str(d), *args, "--no-env", env=env)
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, res.output


def fix_and_recheck(d: Path, args: tuple[str, ...], env: dict[str, str], fill: dict[str, str] | None = None,
                    *, expect: set[str] | None = None) -> list[str]:
    """Preflight ``d`` (it must FAIL), run every printed fix command, then preflight again where
    the fixes wrote: it must pass. ``expect``: the commands the fixes must be (``reshard``...)."""
    code, out = preflight(d, *args, env=env)
    assert code == 1, out
    fixes = printed_fixes(out)
    for f in fixes:  # the prose ones too
        assert not set(re.findall(r"--[\w-]+", f)) & NOWHERE_SHOWN, f
    commands = list(dict.fromkeys(f for f in fixes if is_command(f)))
    assert commands, out
    if expect is not None:
        assert {shlex.split(c)[1] if c.startswith("k3ckpt ") else c.split()[0] for c in commands} == expect, commands
    targets = set()
    for c in commands[-1:] if any(line.startswith("fix all") for line in out.splitlines()) else commands:
        code, output = run_as_printed(c, fill, env=env)
        assert code == 0, f"{c}:\n{output}"
        if shlex.split(c)[:2] != ["k3ckpt", "verify"]:  # (a verify proves bytes; it repairs nothing)
            targets.add(_written(shlex.split(c), d, fill))
    for t in targets:
        code, out = preflight(t, *args, env=env)
        assert code == 0, f"after the fix, {t}:\n{out}"
    return commands


def _written(argv: list[str], checked: Path, fill: dict[str, str] | None) -> Path:
    """The directory to check after a fix: the one it wrote (a new output's node or rank layout),
    else the directory checked."""
    argv = [(fill or {}).get(a, a) for a in argv]
    for flag in ("-o", "--local-dir"):
        if flag in argv:
            out = Path(argv[argv.index(flag) + 1])
            if argv[1] == "reshard" and "--node" in argv:  # a node of a node-format output
                return out / f"node-{int(argv[argv.index('--node') + 1]):05d}"
            return out
    return checked


# -- rank layouts ------------------------------------------------------------------------------


@pytest.fixture
def source(env: dict[str, str], tmp_path: Path) -> Path:
    """k3-tiny fetched from the hub into a local dir, as a user starts (its source recorded)."""
    dest = tmp_path / "Kimi-K3"
    res = run("fetch", REPO, "--local-dir", str(dest))
    assert res.exit_code == 0, res.output
    return dest


@pytest.fixture
def layout(source: Path, tmp_path: Path) -> Path:
    out = tmp_path / "k3-ep4-tp2"
    reshard(source, out, RankSelection(ep=4, tp=2), layout="rank")
    return out


def test_rank_layout_fixes(layout: Path, source: Path, env: dict[str, str]) -> None:
    shutil.rmtree(layout / "rank-00003")
    (layout / "rank-00001" / "READY").unlink()
    fix_and_recheck(layout, ("--node", "1", "--gpus-per-node", "2"), env, expect={"reshard"})
    part = layout / "rank-00002" / "model-rank-2-part-0.safetensors"
    data = bytearray(part.read_bytes())
    data[-10] ^= 0xFF
    part.write_bytes(bytes(data))
    (layout / "rank-00000" / "READY").unlink()
    fix_and_recheck(layout, ("--full",), env, expect={"reshard"})  # fix all, --force
    (layout / "LICENSE").unlink()
    fix_and_recheck(layout, (), env, expect={"cp"})


def test_rank_layout_of_another_topology_or_none(layout: Path, source: Path, env: dict[str, str]) -> None:
    fix_and_recheck(layout, ("--ep", "8", "--tp", "2", "--node", "0", "--gpus-per-node", "4"), env, expect={"reshard"})
    (layout / "topology.json").unlink()  # nothing records the source or the topology any more
    fix_and_recheck(layout, (), env, {"SRC": str(source), "E": "4", "T": "2"}, expect={"reshard"})


# -- node directories --------------------------------------------------------------------------


@pytest.fixture
def nodes(source: Path, tmp_path: Path) -> Path:
    out = tmp_path / "k3-tp2-dp2"
    reshard(source, out, RankSelection(tp=2, dp=2, gpus_per_node=2))
    return out


def _launch(node: int, tp: int = 2, dp: int = 2) -> tuple[str, ...]:
    return ("--tp", str(tp), "--dp", str(dp), "--node", str(node), "--gpus-per-node", "2")


def test_node_directory_fixes(nodes: Path, env: dict[str, str]) -> None:
    fix_and_recheck(nodes / "node-00000", _launch(0, tp=1, dp=4), env, expect={"reshard"})  # another topology
    fix_and_recheck(nodes / "node-00000", _launch(1), env, expect={"reshard"})  # another node of it
    victim = next((nodes / "node-00001").glob("model-rank-00003-experts-*.safetensors"))
    victim.unlink()
    fix_and_recheck(nodes / "node-00001", _launch(1), env, expect={"reshard"})
    (nodes / "node-00001" / "tokenizer_config.json").unlink()
    fix_and_recheck(nodes / "node-00001", _launch(1), env, expect={"cp"})


def test_sglang_refusal_points_at_the_launch_vllm_serves(source: Path, tmp_path: Path, env: dict[str, str]) -> None:
    out = tmp_path / "uneven"
    reshard(source, out, RankSelection(tp=2, dp=3, gpus_per_node=2))
    code, text = preflight(out / "node-00002", "--engine", "sglang", *_launch(2, dp=3), env=env)
    assert code == 1
    [fix] = printed_fixes(text)
    assert run_as_printed(fix, env=env)[0] == 0


# -- downloads and rank-aware fetches ----------------------------------------------------------


def test_download_fixes(source: Path, env: dict[str, str]) -> None:
    (source / "model-00003-of-000008.safetensors").unlink()
    (source / "config.json").unlink()
    fix_and_recheck(source, (), env, expect={"fetch"})


def test_a_copy_that_names_no_repo(source: Path, tmp_path: Path, env: dict[str, str]) -> None:
    """A copy without fetch's record (``cp -r`` of a download): not k3ckpt's to write into, so the
    client adds the missing shard (or k3ckpt fetches the whole beside it); the fixes say
    ``REPO``, which the user fills in."""
    copy = tmp_path / "copy"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns(".cache"))
    (copy / "model-00002-of-000008.safetensors").unlink()
    commands = fix_and_recheck(copy, (), env, {"REPO": REPO}, expect={"hf", "fetch"})
    assert all(shlex.split(c)[2] == "REPO" for c in commands)


@pytest.mark.parametrize("with_manifest", [False, True])
def test_fetched_node_directory_checked_for_another_node(k3_tiny_manifests: dict[str, Path], tmp_path: Path,
                                                        env: dict[str, str], with_manifest: bool) -> None:
    manifest = tmp_path / "kimi-k3.tensors.json"
    shutil.copy(k3_tiny_manifests["tensors"], manifest)
    dest = tmp_path / "node"
    res = run("fetch", REPO, "--local-dir", str(dest), *_launch(0), *(["--manifest", manifest.name] * with_manifest))
    assert res.exit_code == 0, res.output
    # (and, for the bytes no manifest proved, the verify against the hub that proves them: docs/trust.md)
    [fix, *_] = fix_and_recheck(dest, _launch(1), env, expect={"fetch"} if with_manifest else {"fetch", "verify"})
    assert ("--manifest" in fix) == with_manifest and "--dp 2" in fix and "--ep" not in fix
    res = run(*shlex.split(fix)[1:], "--json", env=env)  # a re-run: everything there, proven as before
    assert json.loads(res.output)["verification"] == ("tensor-sha256" if with_manifest else "structure-and-sizes")


def test_rank_aware_fetch_checked_for_other_ranks(k3_tiny_manifests: dict[str, Path], tmp_path: Path,
                                                  env: dict[str, str]) -> None:
    dest = tmp_path / "ranks"
    res = run("fetch", REPO, "--local-dir", str(dest), "--ep", "4", "--tp", "2", "--ranks", "2-3",
              "--manifest", str(k3_tiny_manifests["tensors"]))
    assert res.exit_code == 0, res.output
    # (fetched with --manifest, its rewritten shards carry the manifest's proof: the only fix is the fetch)
    [fix, *_] = fix_and_recheck(dest, ("--ep", "4", "--tp", "2", "--ranks", "0-1"), env, expect={"fetch"})
    assert f"--manifest {k3_tiny_manifests['tensors']}" in fix


def test_plain_checkpoint_read_as_an_expert_cut(source: Path, env: dict[str, str]) -> None:
    code, out = preflight(source, "--ep", "1", "--tp", "4", "--dp", "2", "--node", "0", "--gpus-per-node", "4",
                          env=env)
    assert code == 1
    [fix] = printed_fixes(out)
    assert shlex.split(fix)[:2] == ["k3ckpt", "preflight"] and run_as_printed(fix, env=env)[0] == 0


def test_hf_cache_fix_is_the_clients_own(tmp_path: Path, env: dict[str, str]) -> None:
    cache = tmp_path / "hf-cache"
    res = run("fetch", REPO, "--cache-dir", str(cache))
    assert res.exit_code == 0, res.output
    repo_dir = cache / "models--moonshotai--Kimi-K3"
    snap = next((repo_dir / "snapshots").iterdir())
    (snap / "LICENSE").unlink()
    fix_and_recheck(repo_dir, (), env, expect={"hf"})


# -- refusals and notes ------------------------------------------------------------------------


def test_quoted_commands_in_refusals_and_notes_run(source: Path, k3_tiny_manifests: dict[str, Path],
                                                   tmp_path: Path, env: dict[str, str]) -> None:
    """The commands messages quote (pull a tensor-hash manifest, build one) run as printed, and
    the command refused runs with what they made."""
    plain = tmp_path / "kimi-k3.json"
    shutil.copy(k3_tiny_manifests["files"], plain)
    node = ["fetch", REPO, "--local-dir", str(tmp_path / "n"), *_launch(0)]
    res = run(*node, "--manifest", str(plain))
    assert res.exit_code == 2
    [pull] = QUOTED.findall(res.output)[:1]
    assert run_as_printed(pull, env=env)[0] == 0
    made = Path(shlex.split(pull)[shlex.split(pull).index("-o") + 1])
    assert run(*node, "--manifest", str(made)).exit_code == 0
    # no manifest: the note says how to get one, for this very commit
    res = run("fetch", REPO, "--local-dir", str(tmp_path / "r"), "--ep", "4", "--ranks", "1")
    assert res.exit_code == 0 and "not proven: no --manifest" in res.output
    [pull] = QUOTED.findall(res.output)
    assert shlex.split(pull)[:4] == ["k3ckpt", "manifest", "pull", REPO] and "--revision" in pull
    assert run_as_printed(pull, env=env)[0] == 0
    # reshard with a plain manifest: the command that builds the one it needs
    args = ["reshard", str(source), "-o", str(tmp_path / "o"), "--tp", "2"]
    res = run(*args, "--manifest", str(plain))
    assert res.exit_code == 2
    [build] = QUOTED.findall(res.output)
    assert run_as_printed(build, env=env)[0] == 0
    made = Path(shlex.split(build)[shlex.split(build).index("-o") + 1])
    assert run(*args, "--manifest", str(made)).exit_code == 0


@pytest.mark.parametrize("refused", [
    ["--tp", "2", "--dp", "2", "--node", "0", "--gpus-per-node", "2"],  # a node fetch into a download
    ["--ep", "4", "--ranks", "0"],  # a rank-aware fetch into a download
])
def test_fetch_refusals_name_todays_option(source: Path, env: dict[str, str], refused: list[str]) -> None:
    res = run("fetch", REPO, "--local-dir", str(source), *refused)
    assert res.exit_code == 2 and "fetch into another --local-dir" in res.output, res.output
    assert not set(re.findall(r"--[\w-]+", res.output)) & NOWHERE_SHOWN, res.output

