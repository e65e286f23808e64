"""The ``K3CKPT_*`` registry (``k3ckpt/env.py``): declared once, documented in docs/env.md, read
only through the registry, a bad value a one-line exit-2 error through the real CLI, a good
one honoured."""

from __future__ import annotations

import ast
import json
import os
import re
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import helpers
import k3ckpt
from k3ckpt import env
from k3ckpt.cli import main
from k3ckpt.errors import EnvError
from k3ckpt.utils import parse_size

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(k3ckpt.__file__).resolve().parent
DOCS = ROOT / "docs" / "env.md"
NO_GPU = {"PATH": "/usr/bin:/bin"}
REPO = "moonshotai/Kimi-K3"
_NAME = re.compile(r"K3CKPT_[A-Z0-9_]+")


def run(*args: str, env_vars: dict[str, str] | None = None):
    return CliRunner().invoke(main, list(args), env=env_vars, catch_exceptions=False)


def assert_one_line_error(res, *needles: str) -> None:
    helpers.assert_one_line_error(res, 2, *needles)


# -- the registry and its docs -----------------------------------------------------------------


def _docs_rows() -> dict[str, tuple[str, str]]:
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and _NAME.fullmatch(cells[0].strip("`")):
            rows[cells[0].strip("`")] = (cells[1], cells[2].strip("`"))
    return rows


def test_docs_list_exactly_the_registry_with_its_types_and_defaults() -> None:
    want = {v.name: (v.kind, v.shown_default) for v in env.REGISTRY.values()}
    assert _docs_rows() == want


def test_every_module_level_variable_is_registered() -> None:
    declared = {name: v for name, v in vars(env).items() if isinstance(v, env.EnvVar)}
    assert {v.name for v in declared.values()} == set(env.REGISTRY) == set(declared)
    assert set(env.__all__) >= set(declared)


def _k3ckpt_names_in(tree: ast.AST) -> list[tuple[int, str]]:
    """``K3CKPT_*`` names spelled out as a whole string or as a keyword argument (``environ.get(
    "K3CKPT_X")``, ``dict(K3CKPT_X=...)``): how a module would read one behind the registry's back."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _NAME.fullmatch(node.value):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.keyword) and node.arg and _NAME.fullmatch(node.arg):
            found.append((node.value.lineno, node.arg))
    return found


def test_no_module_reads_a_variable_except_through_the_registry() -> None:
    offenders, used = [], set()
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "env.py":
            continue
        source = path.read_text()
        offenders += [f"{path.relative_to(PACKAGE)}:{line}: {name}"
                      for line, name in _k3ckpt_names_in(ast.parse(source))]
        used |= {n for n in env.REGISTRY if re.search(rf"\b{n}\b\.(get|name|default)\b", source)}
    assert offenders == [], "read K3CKPT_* variables through k3ckpt.env"
    assert used == set(env.REGISTRY), "a registered variable nothing reads"


# -- parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, n", [
    ("1048576", 1048576), ("16M", 16_000_000), ("16MiB", 16 * 2**20), ("16mib", 16 * 2**20), (" 5 GiB ", 5 * 2**30),
    ("20GB", 20 * 10**9), ("1.5G", 1_500_000_000), ("0", 0), ("64KiB", 65536),
])
def test_parse_size(text: str, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["16Q", "", "-1", "1e6", "MiB", "16 M B", "0x10"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)


def test_get_reads_at_call_time_and_blank_means_default(monkeypatch: pytest.MonkeyPatch) -> None:
    var = env.K3CKPT_HASH_BUFFER
    monkeypatch.delenv(var.name, raising=False)
    assert var.get() == var.default == 2**20
    monkeypatch.setenv(var.name, "16M")
    assert var.get() == 16_000_000
    monkeypatch.setenv(var.name, "  ")
    assert var.get() == var.default
    assert var.get({var.name: "2KiB"}) == 2048 and var.get({}) == var.default  # an explicit environment
    assert env.K3CKPT_LOCK_STALE_SECONDS.get({"K3CKPT_LOCK_STALE_SECONDS": "0.5"}) == 0.5
    assert [env.K3CKPT_DIRECT_IO.get({"K3CKPT_DIRECT_IO": v}) for v in ("OFF", "0", "no", "On", "1", "true")] == \
        [False, False, False, True, True, True]
    assert env.K3CKPT_DIRECT_IO.get({}) is True
    assert env.K3CKPT_CACHE_DIR.get({"K3CKPT_CACHE_DIR": "~/c"}) == Path("~/c").expanduser()


@pytest.mark.parametrize("name, value, problem", [
    ("K3CKPT_HASH_BUFFER", "16Q", "is not a byte count (examples: 16MiB, 16M, 1048576)"),
    ("K3CKPT_HASH_BUFFER", "0", "must be at least 1 byte"),
    ("K3CKPT_PREFLIGHT_FREE_BYTES", "-5", "is not a byte count"),
    ("K3CKPT_LOCK_STALE_SECONDS", "a day", "is not a number of seconds"),
    ("K3CKPT_LOCK_STALE_SECONDS", "-1", "is not a number of seconds >= 0"),
    ("K3CKPT_LOCK_STALE_SECONDS", "inf", "is not a number of seconds >= 0"),
    ("K3CKPT_DIRECT_IO", "maybe", "is not on or off (examples: on, off, 1, 0)"),
    ("K3CKPT_SHARE_FILES", "auto", "is not on or off (examples: on, off, 1, 0)"),
])
def test_bad_values_are_typed_errors(name: str, value: str, problem: str) -> None:
    with pytest.raises(EnvError) as e:
        env.REGISTRY[name].get({name: value})
    assert str(e.value).startswith(f"{name}={value!r} {problem}")
    assert e.value.exit_code == 2 and (e.value.name, e.value.value) == (name, value)


# -- through the real CLI ----------------------------------------------------------------------

#: The variables the CLI tests below set to a bad value; paths and text have none.
CLI_CHECKED = {"K3CKPT_HASH_BUFFER", "K3CKPT_MAX_HEADER_BYTES", "K3CKPT_MX_CHUNK_BYTES", "K3CKPT_MX_INSPECT_CHUNK_BYTES",
               "K3CKPT_PREFLIGHT_FREE_BYTES", "K3CKPT_PREFLIGHT_MEM_BYTES", "K3CKPT_LOCK_STALE_SECONDS",
               "K3CKPT_DIRECT_IO", "K3CKPT_SHARE_FILES"}


def test_every_variable_that_can_be_bad_is_checked_through_the_cli() -> None:
    assert CLI_CHECKED == {v.name for v in env.REGISTRY.values() if v.kind in (env.SIZE, env.SECONDS, env.SWITCH)}


@pytest.fixture()
def cache(tmp_path: Path) -> dict[str, str]:
    """A fresh verify cache, so each run hashes (a cached verdict would not read the buffer)."""
    return {"K3CKPT_CACHE_DIR": str(tmp_path / "cache")}


def test_hash_buffer(k3_tiny: Path, cache: dict[str, str]) -> None:
    res = run("verify", str(k3_tiny), env_vars={**cache, "K3CKPT_HASH_BUFFER": "16Q"})
    assert_one_line_error(res, "K3CKPT_HASH_BUFFER='16Q' is not a byte count")
    res = run("verify", str(k3_tiny), env_vars={**cache, "K3CKPT_HASH_BUFFER": "16M"})
    assert res.exit_code == 0 and res.output.startswith("not proven: "), res.output


def test_hash_buffer_refused_before_reshard_or_unshard_makes_its_output(k3_tiny: Path, tmp_path: Path,
                                                                        cache: dict[str, str]) -> None:
    """reshard and unshard hash what they copy in $K3CKPT_HASH_BUFFER steps: a bad value stops
    them before the output directory exists, not part-way through writing it."""
    bad = {**cache, "K3CKPT_HASH_BUFFER": "16Q"}
    ranks = tmp_path / "ranks"
    res = run("reshard", str(k3_tiny), "-o", str(ranks), "--format", "rank", "--ep", "2", env_vars=bad)
    assert_one_line_error(res, "K3CKPT_HASH_BUFFER='16Q' is not a byte count")
    assert not ranks.exists()
    res = run("reshard", str(k3_tiny), "-o", str(ranks), "--format", "rank", "--ep", "2",
              env_vars={**cache, "K3CKPT_HASH_BUFFER": "4097"})  # odd steps: still the same bytes
    assert res.exit_code == 0, res.output
    res = run("unshard", str(ranks), "-o", str(tmp_path / "back"), env_vars=bad)
    assert_one_line_error(res, "K3CKPT_HASH_BUFFER='16Q' is not a byte count")
    assert not (tmp_path / "back").exists()
    res = run("unshard", str(ranks), "-o", str(tmp_path / "back"), env_vars={**cache, "K3CKPT_HASH_BUFFER": "4097"})
    assert res.exit_code == 0, res.output
    assert helpers.tensor_digests(tmp_path / "back") == helpers.tensor_digests(k3_tiny)


def test_cache_dir(k3_tiny: Path, tmp_path: Path) -> None:
    where = tmp_path / "my cache"
    assert run("verify", str(k3_tiny), env_vars={"K3CKPT_CACHE_DIR": str(where)}).exit_code == 0
    assert list((where / "verify").glob("*.json"))


@pytest.mark.parametrize("jobs", ["1", "2"])  # 2: the header is read, and the error raised, in a worker
def test_max_header_bytes(k3_tiny: Path, jobs: str) -> None:
    res = run("inspect", str(k3_tiny), "--jobs", jobs, env_vars={"K3CKPT_MAX_HEADER_BYTES": "lots"})
    assert_one_line_error(res, "K3CKPT_MAX_HEADER_BYTES='lots' is not a byte count")
    res = run("inspect", str(k3_tiny), "--jobs", jobs, env_vars={"K3CKPT_MAX_HEADER_BYTES": "1KiB"})
    assert_one_line_error(res, "exceeds the 1024-byte limit")
    assert run("inspect", str(k3_tiny), "--jobs", jobs, env_vars={"K3CKPT_MAX_HEADER_BYTES": "100MiB"}).exit_code == 0


def test_mx_chunk_bytes(k3_tiny: Path, tmp_path: Path) -> None:
    from k3ckpt.mx.convert import dequantize_to_file

    out = tmp_path / "d.safetensors"
    res = run("mx", "dequant", str(k3_tiny), "--layer", "1", "-o", str(out), env_vars={"K3CKPT_MX_CHUNK_BYTES": "8X"})
    assert_one_line_error(res, "K3CKPT_MX_CHUNK_BYTES='8X' is not a byte count")
    assert not out.exists()
    steps = {}
    for value in ("8MiB", "1KiB"):
        seen: list[int] = []
        os.environ["K3CKPT_MX_CHUNK_BYTES"] = value
        try:
            dequantize_to_file(k3_tiny, out, layer=1, progress=seen.append)
        finally:
            del os.environ["K3CKPT_MX_CHUNK_BYTES"]
        steps[value] = len(seen)
    assert steps["1KiB"] > steps["8MiB"]


def test_mx_inspect_chunk_bytes(k3_tiny: Path) -> None:
    from k3ckpt.mx.inspect import inspect_mx

    res = run("mx", "inspect", str(k3_tiny), "--layer", "1", env_vars={"K3CKPT_MX_INSPECT_CHUNK_BYTES": "1 MB?"})
    assert_one_line_error(res, "K3CKPT_MX_INSPECT_CHUNK_BYTES='1 MB?' is not a byte count")
    steps = {}
    for value in ("1MiB", "512"):
        seen: list[int] = []
        os.environ["K3CKPT_MX_INSPECT_CHUNK_BYTES"] = value
        try:
            inspect_mx(k3_tiny, layer=1, jobs=1, progress=seen.append)
        finally:
            del os.environ["K3CKPT_MX_INSPECT_CHUNK_BYTES"]
        steps[value] = len(seen)
    assert steps["512"] > steps["1MiB"]


@pytest.mark.parametrize("name", ["K3CKPT_PREFLIGHT_FREE_BYTES", "K3CKPT_PREFLIGHT_MEM_BYTES"])
def test_preflight_hooks(k3_tiny: Path, name: str) -> None:
    res = run("preflight", str(k3_tiny), "--json", env_vars={**NO_GPU, name: "plenty"})
    assert_one_line_error(res, f"{name}='plenty' is not a byte count")
    res = run("preflight", str(k3_tiny), "--json", env_vars={**NO_GPU, name: "3KiB"})
    checks = {c["name"]: c for c in json.loads(res.output)["checks"]}
    row = checks["disk" if name.endswith("FREE_BYTES") else "host memory"]
    assert f"({name})" in row["reason"]
    assert 3072 in row["details"].values()


@pytest.mark.usefixtures("isolated_hub_clients")
def test_lock_stale_seconds(served_hub, tmp_path: Path) -> None:
    h, _ = served_hub
    dest = tmp_path / "dest"
    dest.mkdir()
    lock = dest / ".k3ckpt-fetch.lock"
    lock.write_text(json.dumps({"host": "node-17.example", "pid": 4242, "started": time.time(), "token": "t"}))
    old = time.time() - 120
    os.utime(lock, (old, old))
    args = ("fetch", "--source", "hf", "--repo", REPO, "--dest", str(dest), "--endpoint", h.url, "--include", "LICENSE")
    assert_one_line_error(run(*args, env_vars={"K3CKPT_LOCK_STALE_SECONDS": "a day"}),
                          "K3CKPT_LOCK_STALE_SECONDS='a day' is not a number of seconds")
    assert_one_line_error(run(*args), "another fetch is running there")  # 24 h by default: still live
    res = run(*args, env_vars={"K3CKPT_LOCK_STALE_SECONDS": "60"})
    assert res.exit_code == 0, res.output
    assert (dest / "LICENSE").exists() and not lock.exists()


@pytest.mark.usefixtures("isolated_hub_clients")
def test_direct_io(served_hub, tmp_path: Path) -> None:
    h, _ = served_hub
    args = ("fetch", "--source", "hf", "--repo", REPO, "--endpoint", h.url, "--include", "LICENSE")
    res = run(*args, "--dest", str(tmp_path / "a"), env_vars={"K3CKPT_DIRECT_IO": "maybe"})
    assert_one_line_error(res, "K3CKPT_DIRECT_IO='maybe' is not on or off")
    assert not (tmp_path / "a" / "LICENSE").exists()
    for value in ("off", "on"):
        res = run(*args, "--dest", str(tmp_path / value), env_vars={"K3CKPT_DIRECT_IO": value})
        assert res.exit_code == 0, res.output
        assert (tmp_path / value / "LICENSE").exists()


@pytest.mark.usefixtures("isolated_hub_clients")
@pytest.mark.parametrize("node", [False, True])
def test_share_files(node: bool, served_hub, tmp_path: Path) -> None:
    """A bad value is refused before any byte, by the whole-repo fetch and by fetch --node."""
    h, _ = served_hub
    args = ["fetch", "--source", "hf", "--repo", REPO, "--endpoint", h.url]
    args += ["--tp", "2", "--gpus-per-node", "2", "--node", "0"] if node else ["--include", "LICENSE"]
    res = run(*args, "--dest", str(tmp_path / "a"), env_vars={"K3CKPT_SHARE_FILES": "sometimes"})
    assert_one_line_error(res, "K3CKPT_SHARE_FILES='sometimes' is not on or off")
    assert not (tmp_path / "a").exists()
    for value in ("off", "on"):
        res = run(*args, "--dest", str(tmp_path / value), env_vars={"K3CKPT_SHARE_FILES": value})
        assert res.exit_code == 0, res.output
        assert (tmp_path / value / ("config.json" if node else "LICENSE")).exists()
