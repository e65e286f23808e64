"""The ``k3ckpt`` load format's checks without an engine (#27): each refusal of the topology guard
is one line naming the mismatch and ending with the launch that fits; a plain checkpoint is
accepted; tensor digests from the marker or a tensor-hash manifest catch a changed tensor and a
tensor never read, and excuse what the engine's filter skipped."""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

import pytest

from helpers import run
from k3ckpt.deploy.serve import serve_command
from k3ckpt.engine import TensorDigests, check_topology, fitting_launch, spans
from k3ckpt.engine.guard import weight_map
from k3ckpt.errors import EngineTopologyError, ManifestError, TensorDigestError


@pytest.fixture(scope="module")
def k2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("guard")
    src = root / "k2"
    assert run("synth", str(src), "--preset", "k2-engine").exit_code == 0
    for name, args in {"tp1": ["--tp", "1"], "dp2": ["--tp", "1", "--dp", "2", "--gpus-per-node", "1"]}.items():
        res = run("reshard", str(src), "-o", str(root / name), *args)
        assert res.exit_code == 0, res.output
    return root


def refusal(root: Path, **state: object) -> str:
    with pytest.raises(EngineTopologyError) as e:
        check_topology(root, **state)  # type: ignore[arg-type]
    line = str(e.value)
    assert "\n" not in line
    return line


def test_ep_off_on_a_directory_with_some_experts_is_refused_with_the_fitting_launch(k2: Path) -> None:
    node0 = k2 / "dp2" / "node-00000"
    line = refusal(node0, expert_parallel=False, ep_size=1, ep_rank=0, tp_size=1, dp_size=1, local_experts=range(16))
    assert line.startswith(f"{node0}: node 0 of a 2-rank expert-parallel topology holds experts 0-7 of 16, "
                           "but the engine runs without expert parallelism (engine: tp 1 x dp 1, ep size 1)"), line
    want = shlex.join([*serve_command(node0, tp=1, dp=2, node=0, gpus_per_node=1), "--load-format", "k3ckpt"])
    assert line.endswith(f"; serve it with: {want}"), line
    assert "--enable-expert-parallel" in want and "--data-parallel-size 2" in want


def test_another_ep_size_is_refused(k2: Path) -> None:
    node0 = k2 / "dp2" / "node-00000"
    line = refusal(node0, expert_parallel=True, ep_size=4, ep_rank=0, tp_size=1, dp_size=4, local_experts=range(4))
    assert "the engine's ep size is 4, not 2 (engine: tp 1 x dp 4, ep size 4)" in line, line
    assert "serve it with: vllm serve" in line


@pytest.mark.parametrize("mine", [range(8, 16), [0, 2, 4, 6, 8, 10, 12, 14]], ids=["other node", "round robin"])
def test_experts_this_directory_does_not_hold_are_refused(k2: Path, mine: object) -> None:
    node0 = k2 / "dp2" / "node-00000"
    line = refusal(node0, expert_parallel=True, ep_size=2, ep_rank=0, tp_size=1, dp_size=2, local_experts=mine)
    assert f"the engine gives ep rank 0 experts {spans(mine)} (wrong placement or another node's directory)" in line  # type: ignore[arg-type]
    assert "--expert-placement-strategy linear" in line


def test_the_fitting_launches_are_accepted(k2: Path) -> None:
    for node, mine in ((0, range(8)), (1, range(8, 16))):
        check_topology(k2 / "dp2" / f"node-0000{node}", expert_parallel=True, ep_size=2, ep_rank=node, tp_size=1,
                       dp_size=2, local_experts=mine)
    one = k2 / "tp1" / "node-00000"
    check_topology(one, expert_parallel=False, ep_size=1, ep_rank=0, tp_size=1, dp_size=1, local_experts=range(16))
    check_topology(one, expert_parallel=True, ep_size=1, ep_rank=0, tp_size=1, dp_size=1, local_experts=range(16))


def test_a_plain_checkpoint_is_accepted_whatever_the_launch(k2: Path) -> None:
    for ep in (False, True):
        check_topology(k2 / "k2", expert_parallel=ep, ep_size=3, ep_rank=2, tp_size=3, dp_size=1, local_experts=[0])
    assert TensorDigests.for_directory(k2 / "k2") is None
    # ... and the refusal above is not vacuous: the same state on a node directory is refused
    refusal(k2 / "dp2" / "node-00000", expert_parallel=True, ep_size=3, ep_rank=2, tp_size=3, dp_size=1,
            local_experts=[0])


def test_spans_and_a_marker_without_a_topology() -> None:
    assert spans([7, 0, 1, 2, 3, 9, 10]) == "0-3,7,9-10" and spans([]) == "none"
    assert fitting_launch("/x", {"experts": [0]}) is None


def feed(digests: TensorDigests, root: Path, skip: set[str] = frozenset(), flip: str | None = None) -> None:  # type: ignore[assignment]
    """Yield every tensor of ``root`` the way the engine would (bytes from its shards)."""
    from k3ckpt.format.header import read_header

    for name, file in sorted(weight_map(root).items()):
        if name in skip:
            continue
        h = read_header(root / file)
        t = h.tensors[name]
        with open(root / file, "rb") as f:
            f.seek(h.data_start + t.begin)
            data = bytearray(f.read(t.end - t.begin))
        if name == flip:
            data[len(data) // 2] ^= 1
        digests.update(name, data)


def test_marker_digests_pass_then_name_a_flipped_tensor_and_a_missing_one(k2: Path) -> None:
    node = k2 / "tp1" / "node-00000"
    marker = node / "k3ckpt-node.json"
    names = sorted(weight_map(node))
    ok = TensorDigests.for_directory(node)
    assert ok is not None and ok.source == str(marker) and len(ok.expected) == len(names)
    feed(ok, node)
    ok.finish()

    experts = [n for n in names if ".experts.5." in n]
    bad = TensorDigests.for_directory(node)
    assert bad is not None
    feed(bad, node, flip=experts[0])
    with pytest.raises(TensorDigestError) as e:
        bad.finish()
    file = weight_map(node)[experts[0]]
    assert str(e.value) == (f"{file}: tensor {experts[0]}: bytes differ from the sha256 in {marker}; "
                            "the engine refused to serve them")
    assert e.value.exit_code == 1

    short = TensorDigests.for_directory(node)
    assert short is not None
    feed(short, node, skip=set(experts))
    with pytest.raises(TensorDigestError) as e:
        short.finish()
    assert str(e.value) == (f"{weight_map(node)[sorted(experts)[0]]}: tensor {sorted(experts)[0]} listed in "
                            f"{marker} was never read by the engine (+{len(experts) - 1} more)")
    # what the engine's own filter skipped (another rank's experts) is not missing
    short.finish(skipped=lambda n: ".experts.5." in n)


def test_a_tensor_yielded_twice_is_hashed_once_and_an_unknown_one_ignored(k2: Path) -> None:
    d = TensorDigests({"a": ("f.safetensors", hashlib.sha256(b"abc").hexdigest())}, "marker")
    d.update("a", b"abc")
    d.update("a", b"changed later")  # hashed once: the first read is what was checked
    d.update("not-listed", b"x")
    d.finish()
    d2 = TensorDigests({"a": ("f.safetensors", hashlib.sha256(b"abc").hexdigest()),
                        "b": ("g.safetensors", "0" * 64)}, "marker")
    d2.update("a", b"abd")
    d2.update("b", b"")
    with pytest.raises(TensorDigestError,
                       match=r"^f.safetensors: tensor a: bytes differ from the sha256 in marker \(\+1 more\); the engine"):
        d2.finish()


def test_a_tensor_hash_manifest_is_a_source_and_names_this_directory_s_file(k2: Path, tmp_path: Path) -> None:
    node = k2 / "tp1" / "node-00000"
    manifest = tmp_path / "k2.manifest.json"
    res = run("manifest", "build", str(k2 / "k2"), "-o", str(manifest), "--tensor-hashes")
    assert res.exit_code == 0, res.output
    d = TensorDigests.for_directory(node, {"manifest": str(manifest)})
    assert d is not None and d.source == str(manifest) and set(d.expected) == set(weight_map(node))
    assert {f for f, _ in d.expected.values()} == set(weight_map(node).values())  # the node's files, not the source's
    experts = sorted(n for n in d.expected if ".experts.2." in n)
    feed(d, node, flip=experts[0])
    with pytest.raises(TensorDigestError, match=rf"^{weight_map(node)[experts[0]]}: tensor {experts[0]}: bytes differ "
                                                rf"from the sha256 in {manifest}"):
        d.finish()

    plain = tmp_path / "plain.manifest.json"
    assert run("manifest", "build", str(k2 / "k2"), "-o", str(plain)).exit_code == 0
    with pytest.raises(ManifestError, match="no tensor digests"):
        TensorDigests.for_directory(node, {"manifest": str(plain)})
    assert json.loads(manifest.read_text())["tensor_hashes"] is True


# -- the serve lines: --load-format k3ckpt where the plugin is, a note where it is not ------------


def test_the_entry_point_vllm_loads_is_the_one_serve_lines_look_for() -> None:
    """pyproject's plugin entry point is what :func:`guard_installed` finds, and it names the
    function that registers :data:`LOAD_FORMAT`."""
    import tomllib

    from k3ckpt.deploy import serve
    from k3ckpt.engine import vllm

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    (name, value), = project["entry-points"][serve.PLUGIN_GROUP].items()
    assert value == serve.PLUGIN_ENTRY == f"{vllm.__name__}:{vllm.register.__name__}"
    assert vllm.LOAD_FORMAT == serve.LOAD_FORMAT == "k3ckpt"


def test_guard_installed_needs_vllm_here_and_k3ckpt_s_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata
    from importlib.metadata import EntryPoint

    from k3ckpt.deploy import serve

    ours = EntryPoint("k3ckpt", serve.PLUGIN_ENTRY, serve.PLUGIN_GROUP)
    other = EntryPoint("lora", "someone.else:register", serve.PLUGIN_GROUP)
    for vllm_here, points, want in [(True, [other, ours], True), (True, [other], False), (False, [ours], False)]:
        monkeypatch.setattr(serve.importlib.util, "find_spec", lambda name, v=vllm_here: object() if v else None)
        # serve imports entry_points when it asks (importlib.metadata is slow to import)
        monkeypatch.setattr(importlib.metadata, "entry_points", lambda group, p=points: [e for e in p if e.group == group])
        assert serve.guard_installed() is want
        assert serve.resolve_guard(None, "vllm") is want and serve.resolve_guard(None, "sglang") is False
    assert serve.resolve_guard(True, "vllm") and not serve.resolve_guard(False, "vllm")


def test_serve_command_with_and_without_the_guard(k2: Path) -> None:
    from k3ckpt.errors import TopologyError

    d = k2 / "dp2" / "node-00000"
    plain = serve_command(d, tp=1, dp=2, gpus_per_node=1, leader_address="gpu01")
    assert serve_command(d, tp=1, dp=2, gpus_per_node=1, leader_address="gpu01", guard=True) == \
        [*plain, "--load-format", "k3ckpt"]
    with pytest.raises(TopologyError, match="vLLM plugin"):
        serve_command(d, tp=1, dp=2, gpus_per_node=1, engine="sglang", guard=True)

    # this venv has no vLLM: the line goes without it and stderr says what that loses
    args = ["serve-command", str(d), "--tp", "1", "--dp", "2", "--gpus-per-node", "1", "--leader-address", "gpu01"]
    res = run(*args)
    assert res.exit_code == 0 and res.stdout.strip() == shlex.join(plain)
    assert res.stderr.startswith("note: without --load-format k3ckpt vLLM checks neither"), res.stderr
    res = run(*args, "--guard")
    assert res.exit_code == 0 and res.stdout.strip().endswith(" --load-format k3ckpt") and not res.stderr
    assert json.loads(run(*args, "--guard", "--json").stdout) == {"serve": [*plain, "--load-format", "k3ckpt"],
                                                                   "guarded": True}
    res = run(*args, "--guard", "--engine", "sglang")
    assert res.exit_code == 2 and "sglang has no guarded load" in res.stderr
    assert not run(*args, "--engine", "sglang").stderr  # no load format to miss


def test_preflight_serve_lines_carry_the_guard_or_say_what_is_missing(k2: Path) -> None:
    d = k2 / "dp2" / "node-00000"
    args = ["preflight", str(d), "--no-env", "--leader-address", "gpu01"]
    env = {"PATH": "/usr/bin:/bin"}  # no nvidia-smi
    lines = run(*args, env=env).stdout.splitlines()
    assert lines[-2].startswith("note       without --load-format k3ckpt") and "--load-format" not in lines[-1]
    res = run(*args, "--guard", env=env)
    assert res.exit_code == 0, res.output
    last = res.stdout.splitlines()
    assert last[-1].endswith(" --load-format k3ckpt") and not any(x.startswith("note ") for x in last)
    out = json.loads(run(*args, "--guard", "--json", env=env).stdout)
    assert out["guarded"] and out["serve"][-2:] == ["--load-format", "k3ckpt"]
    # the fix of a launch without EP is the guarded expert-parallel launch too
    res = run(*args, "--guard", "--no-expert-parallel", env=env)
    assert res.exit_code == 1 and "fix: vllm serve" in res.stdout
    fix = next(x for x in res.stdout.splitlines() if "fix: vllm serve" in x)
    assert fix.endswith("--load-format k3ckpt"), fix
    res = run("preflight", str(k2 / "tp1" / "node-00000"), "--guard", "--no-env", env=env)  # vllm by default
    assert res.exit_code == 0, res.output
    res = run("preflight", str(k2 / "k2"), "--guard", "--no-env", env=env)  # a plain checkpoint: no engine
    assert res.exit_code == 2 and "give --engine" in res.stderr


def test_the_folder_checked_is_the_directory_or_the_cache_snapshot_holding_a_marker(
        k2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the load format checks for a model argument: a directory itself; a hub id's snapshot
    in the Hugging Face cache (the revision asked) when it holds a k3ckpt marker; else nothing."""
    import huggingface_hub.constants as hfc

    from k3ckpt.engine.vllm import model_folder

    node = k2 / "tp1" / "node-00000"
    assert model_folder(str(node), None) == node
    cache = tmp_path / "hub"
    monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--org--name"
    snap = repo / "snapshots" / ("c" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "k3ckpt-partial-x").write_text("c" * 40)
    assert model_folder("org/name", "k3ckpt-partial-x") is None  # a plain snapshot: nothing to check
    (snap / "k3ckpt-partial.json").write_text("{}")
    assert model_folder("org/name", "k3ckpt-partial-x") == snap
    assert model_folder("org/name", None) is None  # main is not that snapshot
    assert model_folder("org/other", "k3ckpt-partial-x") is None
    assert model_folder("not a/repo/id", None) is None


def test_a_rank_aware_fetch_s_marker_has_no_digests_a_manifest_gives_them(tmp_path: Path) -> None:
    """``k3ckpt-partial.json`` counts its tensors (its proofs are per file): no digests from it,
    and no error either; a tensor-hash manifest is the way to check a partial's bytes."""
    root = tmp_path / "partial"
    root.mkdir()
    (root / "k3ckpt-partial.json").write_text(json.dumps({"format": "k3ckpt-partial", "experts": [0, 1],
                                                          "tensors": 201}))
    assert TensorDigests.for_directory(root) is None
