"""The same class of bad input gives the same exit code in every command, and under ``--json``
a fatal error prints the JSON error object (issue 14, observation 7; ``docs/errors.md``).

Table-driven: each class of bad input (a path that does not exist, a directory that is not a
checkpoint, a truncated safetensors header, an index naming a missing shard, a bad option value,
an unreachable hub; issue #25's topology the engine cannot serve and MoE config without its
expert count) is run through every command that takes such an input. The rule: exit 2
("could not run") everywhere, except that the checkers - ``verify`` and ``preflight``, whose job
is to find damage - report a damaged checkpoint as a finding (exit 1, their report). Then the
same run with ``--json``: exit code unchanged; an error prints exactly one JSON object
``{"error": {"kind", "path", "message"}}`` on stdout and one ``k3ckpt: error: MESSAGE`` line on
stderr; a checker's finding prints its report.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from click.testing import Result

from helpers import REPO, run, shard_of
from k3ckpt.errors import K3ckptError

#: commands whose job is to find damage: a damaged checkpoint is their finding (exit 1)
CHECKERS = {"verify", "preflight"}
#: the classes of issue #25 that no command may write (UNSERVABLE below)
UNSERVABLE_TOPOLOGY = "a topology the engine cannot serve"
UNCOUNTED = "a MoE config without its expert count"
#: classes of input that are a damaged checkpoint (rather than no checkpoint at all), or one no
#: engine can serve as asked: a checker's finding
DAMAGE = {"truncated header", "index names a missing shard", "a shard is a symlink loop", "a shard is a directory",
          UNSERVABLE_TOPOLOGY, UNCOUNTED}
EMBED = "language_model.model.embed_tokens.weight"


def expected_exit(case: str, command: str) -> int:
    return 1 if case in DAMAGE and command in CHECKERS else 2


class Inputs:
    """The bad inputs, built once: checkpoints (``ckpt``), rank layouts (``layout``) and single
    safetensors files (``file``) for each class."""

    def __init__(self, root: Path, k3_tiny: Path) -> None:
        self.root = root
        self.good = k3_tiny
        self.ckpt: dict[str, Path] = {"path does not exist": root / "missing", "not a checkpoint": root / "empty"}
        (root / "empty").mkdir()
        first = shard_of(k3_tiny, EMBED)
        trunc = root / "truncated"
        shutil.copytree(k3_tiny, trunc)
        with open(trunc / first, "r+b") as fh:
            fh.truncate(20)  # the 8-byte length promises a header the file no longer has
        self.ckpt["truncated header"] = trunc
        gone = root / "noshard"
        shutil.copytree(k3_tiny, gone)
        (gone / first).unlink()
        self.ckpt["index names a missing shard"] = gone
        # issue #25: a self-referential symlink gave verify and preflight a traceback
        for case, make in (("a shard is a symlink loop", lambda p: p.symlink_to(p.name)),
                           ("a shard is a directory", lambda p: p.mkdir())):
            odd = root / case.replace(" ", "-")
            shutil.copytree(k3_tiny, odd)
            (odd / first).unlink()
            make(odd / first)
            self.ckpt[case] = odd

        layout = root / "layout"
        assert run("reshard", str(k3_tiny), "-o", str(layout), "--format", "rank", "--ep", "2").exit_code == 0
        self.layout = dict(self.ckpt)
        part = sorted((layout / "rank-00000").glob("*.safetensors"))[0]
        for case, damage in (("truncated header", "truncate"), ("index names a missing shard", "unlink"),
                             ("a shard is a symlink loop", "loop"), ("a shard is a directory", "dir")):
            copy = root / f"layout-{damage}"
            shutil.copytree(layout, copy)
            target = copy / part.relative_to(layout)
            if damage == "truncate":
                with open(target, "r+b") as fh:
                    fh.truncate(20)
            else:
                target.unlink()
                if damage == "loop":
                    target.symlink_to(target.name)
                elif damage == "dir":
                    target.mkdir()
            self.layout[case] = copy
        self.file = {"path does not exist": root / "missing.safetensors", "not a checkpoint": root / "empty",
                     "truncated header": trunc / first}
        # issue #25: what the engine format cannot serve. A config without its expert count (the
        # headers show 16 routed experts), here and on a hub (url set by the fixture); a node
        # directory to preflight for a launch with a TP group across nodes.
        uncounted = root / "uncounted"
        shutil.copytree(k3_tiny, uncounted)
        config = json.loads((uncounted / "config.json").read_text())
        del config["text_config"]["num_experts"]
        (uncounted / "config.json").write_text(json.dumps(config, indent=2))
        self.ckpt[UNCOUNTED] = uncounted
        self.hub_url = ""
        nodes = root / "nodes"
        assert run("reshard", str(k3_tiny), "-o", str(nodes), "--tp", "4", "--dp", "2", "--gpus-per-node", "4",
                   "--node", "0").exit_code == 0
        self.node_dir = nodes / "node-00000"

    def out(self, name: str) -> str:
        """A fresh output path (never created by a failing command)."""
        n = sum(1 for _ in self.root.glob(f"out-{name}-*"))
        return str(self.root / f"out-{name}-{n}")


@pytest.fixture(scope="module")
def inputs(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Inputs]:
    from k3ckpt.testing.hub import LoopbackHub

    i = Inputs(tmp_path_factory.mktemp("bad-inputs"), k3_tiny)
    with LoopbackHub({REPO: i.ckpt[UNCOUNTED]}, cache_dir=tmp_path_factory.mktemp("bad-inputs-hub")) as hub:
        i.hub_url = hub.url
        yield i


# command -> argv for a local input; each takes the Inputs and the case
Argv = Callable[[Inputs, str], list[str] | None]
LOCAL: dict[str, Argv] = {
    "inspect": lambda i, c: ["inspect", str(i.ckpt[c])],
    "verify": lambda i, c: ["verify", str(i.ckpt[c])],
    "manifest build": lambda i, c: ["manifest", "build", str(i.ckpt[c]), "-o", i.out("m") + ".json"],
    "plan": lambda i, c: ["plan", str(i.ckpt[c]), "--tp", "2"],
    "reshard": lambda i, c: ["reshard", str(i.ckpt[c]), "-o", i.out("reshard"), "--tp", "2"],
    "unshard": lambda i, c: ["unshard", str(i.layout[c]), "-o", i.out("unshard")],
    "preflight": lambda i, c: ["preflight", str(i.ckpt[c]), "--no-env"],
    "mx inspect": lambda i, c: ["mx", "inspect", str(i.ckpt[c])],
    "mx dequant": lambda i, c: ["mx", "dequant", str(i.ckpt[c]), "-o", i.out("dq") + ".safetensors"],
    "mx error": lambda i, c: ["mx", "error", str(i.file[c])] if c in i.file else None,
    "mx quantize": lambda i, c: ["mx", "quantize", str(i.file[c]), "-o", i.out("q") + ".safetensors"]
                                if c in i.file else None,
    "manifest diff": lambda i, c: ["manifest", "diff", str(i.root / "missing.json"), str(i.root / "missing.json")]
                                  if c == "path does not exist" else None,
    "manifest sign": lambda i, c: ["manifest", "sign", str(i.root / "missing.json"), "--key", str(i.root / "k")]
                                  if c == "path does not exist" else None,
}

#: one bad option value per command (the input itself is good)
BAD_OPTION: dict[str, Argv] = {
    "inspect": lambda i, c: ["inspect", str(i.good), "--jobs", "0"],
    "verify": lambda i, c: ["verify", str(i.good), "--jobs", "0"],
    "manifest build": lambda i, c: ["manifest", "build", str(i.good), "-o", i.out("m"), "--jobs", "0"],
    "manifest pull": lambda i, c: ["manifest", "pull", "--source", "hf", "--repo", "o/r", "-o", i.out("m"), "--jobs",
                                   "zero"],
    "manifest diff": lambda i, c: ["manifest", "diff", "a.json", "b.json", "--colour"],
    "manifest keygen": lambda i, c: ["manifest", "keygen", i.out("key"), "--force=yes"],
    "manifest sign": lambda i, c: ["manifest", "sign", "a.json"],
    "fetch": lambda i, c: ["fetch", "--source", "hf", "--repo", "o/r", "--dest", i.out("f"), "--workers", "0"],
    "plan": lambda i, c: ["plan", str(i.good), "--kv-budget", "lots"],
    "reshard": lambda i, c: ["reshard", str(i.good), "-o", i.out("r"), "--max-file-size", "0"],
    "unshard": lambda i, c: ["unshard", str(i.good), "-o", i.out("u"), "--max-shard-size", "-1"],
    "preflight": lambda i, c: ["preflight", str(i.good), "--io-test", "0"],
    "serve-command": lambda i, c: ["serve-command", str(i.good), "--tp", "0"],
    "synth": lambda i, c: ["synth", i.out("s"), "--layers", "0"],
    "mx inspect": lambda i, c: ["mx", "inspect", str(i.good), "--top", "-1"],
    "mx error": lambda i, c: ["mx", "error", str(i.good), "--scale-mode", "nearest"],
    "mx dequant": lambda i, c: ["mx", "dequant", str(i.good), "-o", i.out("dq"), "--to", "fp4"],
    "mx quantize": lambda i, c: ["mx", "quantize", str(i.good), "-o", i.out("q"), "--scale-mode", "nearest"],
}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: nothing listens there


#: hub commands against an endpoint nothing listens on (hf: its client does not retry a refusal)
UNREACHABLE: dict[str, Argv] = {
    "fetch": lambda i, c: ["fetch", "--source", "hf", "--repo", "o/r", "--dest", i.out("f"), "--endpoint", c],
    "fetch --ranks": lambda i, c: ["fetch", "--source", "hf", "--repo", "o/r", "--dest", i.out("f"), "--endpoint", c,
                                   "--ep", "2", "--ranks", "0"],
    "manifest pull": lambda i, c: ["manifest", "pull", "--source", "hf", "--repo", "o/r", "-o", i.out("m"),
                                   "--endpoint", c],
    "verify --against": lambda i, c: ["verify", str(i.good), "--against", "hf", "--repo", "o/r", "--endpoint", c],
}

#: issue #25: what the engine format cannot serve is refused by every command that would write it,
#: before the first byte (exit 2; fetch --node before any request: its endpoint does not even
#: listen), and reported by the checkers (exit 1)
ACROSS = ("--tp", "4", "--dp", "2", "--gpus-per-node", "3")
UNSERVABLE: dict[str, dict[str, Argv]] = {
    UNSERVABLE_TOPOLOGY: {
        "plan": lambda i, c: ["plan", str(i.good), *ACROSS],
        "reshard": lambda i, c: ["reshard", str(i.good), "-o", i.out("reshard"), *ACROSS],
        "fetch --node": lambda i, c: ["fetch", REPO, "--local-dir", i.out("f"), "--endpoint", c, *ACROSS,
                                      "--node", "0"],
        "preflight": lambda i, c: ["preflight", str(i.node_dir), "--engine", "vllm", *ACROSS, "--node", "0",
                                   "--no-env"],
    },
    UNCOUNTED: {
        "plan": lambda i, c: ["plan", str(i.ckpt[UNCOUNTED]), "--tp", "2"],
        "reshard": lambda i, c: ["reshard", str(i.ckpt[UNCOUNTED]), "-o", i.out("reshard"), "--tp", "2"],
        "fetch --node": lambda i, c: ["fetch", REPO, "--local-dir", i.out("f"), "--endpoint", i.hub_url, "--tp", "2",
                                      "--node", "0"],
        "verify": lambda i, c: ["verify", str(i.ckpt[UNCOUNTED])],
        "preflight": lambda i, c: ["preflight", str(i.ckpt[UNCOUNTED]), "--no-env"],
    },
}

CASES = [(case, command) for case in ("path does not exist", "not a checkpoint", "truncated header",
                                      "index names a missing shard", "a shard is a symlink loop",
                                      "a shard is a directory") for command in LOCAL]
CASES += [("bad option value", command) for command in BAD_OPTION]
CASES += [("unreachable hub", command) for command in UNREACHABLE]
CASES += [(case, command) for case, commands in UNSERVABLE.items() for command in commands]
#: the kind every command gives for a class, where the class decides it
KINDS = {"bad option value": "usage", "unreachable hub": "hub_unreachable", UNSERVABLE_TOPOLOGY: "topology",
         UNCOUNTED: "config"}


def _argv(inputs: Inputs, case: str, command: str) -> list[str] | None:
    if case == "bad option value":
        return BAD_OPTION[command](inputs, case)
    if case == "unreachable hub":
        return UNREACHABLE[command](inputs, f"http://127.0.0.1:{_closed_port()}")
    if case in UNSERVABLE:
        return UNSERVABLE[case][command](inputs, f"http://127.0.0.1:{_closed_port()}")
    return LOCAL[command](inputs, case)


def _one_json_object(text: str) -> dict:
    obj = json.loads(text)  # raises unless stdout is exactly one JSON document
    assert isinstance(obj, dict), text
    return obj


@pytest.mark.usefixtures("isolated_hub_clients")
@pytest.mark.parametrize(("case", "command"), CASES, ids=[f"{c}/{m}" for c, m in CASES])
def test_same_class_same_exit_code_and_a_json_error_object(inputs: Inputs, case: str, command: str) -> None:
    argv = _argv(inputs, case, command)
    if argv is None:
        pytest.skip(f"{command} takes no input of this class")
    want = expected_exit(case, command)
    plain = run(*argv)
    assert plain.exit_code == want, (argv, plain.output)
    assert "Traceback" not in plain.output
    if want == 2:
        _assert_error_line(plain)

    res = run(*argv, "--json")
    assert res.exit_code == want, (argv, res.output)
    doc = _one_json_object(res.stdout)
    if want == 1:  # a checker's finding: its report, not an error
        assert "error" not in doc and res.stderr.strip() == "", res.output
        return
    assert set(doc) == {"error"} and set(doc["error"]) == {"kind", "path", "message"}, doc
    err = doc["error"]
    line = _assert_error_line(res)
    assert line == f"k3ckpt: error: {err['message']}"
    assert err["kind"] == KINDS.get(case, err["kind"]) and err["kind"] in _KNOWN_KINDS, err
    assert err["path"] is None or isinstance(err["path"], str)
    if case == "truncated header" and command in ("inspect", "manifest build", "reshard", "mx inspect"):
        assert err["path"] == str(inputs.ckpt[case].resolve() / shard_of(inputs.good, EMBED))


def _assert_error_line(res: Result) -> str:
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("k3ckpt: error: "), res.stderr
    return lines[0]


def _all_kinds(cls: type[K3ckptError]) -> set[str]:
    return {cls.kind}.union(*(_all_kinds(c) for c in cls.__subclasses__()))


_KNOWN_KINDS = _all_kinds(K3ckptError) | {"usage", "os"}


def test_the_rule_has_both_outcomes() -> None:
    # the table is not vacuous: checkers report damage, everything else cannot run on it
    assert {expected_exit(c, m) for c, m in CASES} == {1, 2}
    assert {m for m in LOCAL} | set(BAD_OPTION) >= {"inspect", "verify", "manifest build", "fetch", "plan", "reshard",
                                                    "unshard", "preflight", "synth", "mx inspect", "mx error",
                                                    "mx dequant", "mx quantize", "manifest pull", "manifest diff",
                                                    "manifest keygen", "manifest sign"}


def test_a_json_error_raised_while_parsing_options_still_prints_the_object(inputs: Inputs) -> None:
    # --json after the bad value: click has not processed it when the value fails
    for argv in (["inspect", str(inputs.good), "--jobs", "0", "--json"],
                 ["inspect", str(inputs.good), "--json", "--jobs", "0"]):
        res = run(*argv)
        assert res.exit_code == 2
        assert _one_json_object(res.stdout)["error"]["kind"] == "usage"
        assert "'--jobs'" in _assert_error_line(res)
    # without --json: nothing on stdout
    res = run("inspect", str(inputs.good), "--jobs", "0")
    assert res.exit_code == 2 and res.stdout == ""
    # a "--json" after "--" is an argument, not the option
    res = run("mx", "inspect", str(inputs.good), "--", "--json")
    assert res.exit_code == 2 and res.stdout == ""


def test_usage_errors_are_one_line_naming_the_help(inputs: Inputs) -> None:
    res = run("fetch", "--source", "hf", "--local-dir", inputs.out("f"))
    assert res.exit_code == 2
    assert re.fullmatch(r"k3ckpt: error: Missing argument 'REPO_ID'\. \(see '\S+ fetch --help'\)", _assert_error_line(res))
    res = run("fetch", "o/r", "--local-dir")
    assert re.fullmatch(r"k3ckpt: error: Option '--local-dir' requires an argument\. \(see '\S+ fetch --help'\)",
                        _assert_error_line(res))
    # a group without a command still shows its help (click's behaviour, exit 2)
    res = run("manifest")
    assert res.exit_code == 2 and "Commands:" in res.output


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_an_unwritable_stdout_still_gives_the_line_and_the_code(tmp_path: Path) -> None:
    # the JSON object cannot be written (a full disk, a reader gone): the error is still told
    # on stderr, with its own exit code, and no traceback about stdout
    import subprocess
    import sys

    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "k3ckpt", "inspect", str(tmp_path / "missing"), "--json"],
                              stdout=full, stderr=subprocess.PIPE, text=True, check=False)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"k3ckpt: error: {tmp_path / 'missing'}: no such directory"], proc.stderr


def test_an_exit_1_error_is_an_error_object_too(inputs: Inputs, tmp_path: Path) -> None:
    # a signature that does not verify exits 1 like a finding, but it is an error (nothing was
    # verified): --json gives the error object, kind "signature", not a report
    key, manifest = tmp_path / "release.key", tmp_path / "m.json"
    assert run("manifest", "keygen", str(key)).exit_code == 0
    assert run("manifest", "build", str(inputs.good), "-o", str(manifest), "--sign", str(key)).exit_code == 0
    manifest.write_text(manifest.read_text() + "\n")  # still the same JSON, no longer the signed bytes
    res = run("verify", str(inputs.good), "--manifest", str(manifest), "--signature", f"{manifest}.sig",
              "--pubkey", f"{key}.pub", "--json")
    assert res.exit_code == 1, res.output
    err = _one_json_object(res.stdout)["error"]
    assert err["kind"] == "signature" and _assert_error_line(res) == f"k3ckpt: error: {err['message']}"
