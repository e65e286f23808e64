"""Ready means loadable (issue 14, observations 3, 6 and the config part of 7): the rule of
:mod:`k3ckpt.format.loadable` (config.json, the tokenizer, the licence), reshard refusing a source
that breaks it, preflight FAILing a directory that breaks it and printing no PASS for a check
that could not run, every command treating a broken config.json alike, and preflight on a real
Hugging Face cache (symlinks into ``blobs/``) whose fixes never write into the cache."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers import REPO, assert_one_line_error, run
from k3ckpt.deploy import preflight as pf
from k3ckpt.deploy.reshard import reshard
from k3ckpt.errors import ConfigError, EngineFilesError
from k3ckpt.format.loadable import license_source, loadable_findings, require_loadable
from k3ckpt.format.topology import RankSelection
from k3ckpt.utils import is_within

NO_GPU = {"PATH": "/usr/bin:/bin"}


def rows(rep: pf.PreflightReport) -> dict[str, pf.Check]:
    return {c.name: c for c in rep.checks}


# -- the rule -----------------------------------------------------------------------------------


def test_every_synthetic_preset_is_loadable(k3_tiny: Path, gptoss_tiny: Path, k2_tiny: Path) -> None:
    for root in (k3_tiny, gptoss_tiny, k2_tiny):
        cfg, found = loadable_findings(root)
        assert cfg is not None and found == [], (root, [str(f) for f in found])


@pytest.mark.parametrize("name, kind", [
    ("config.json", "config"),
    ("configuration_kimi_k3.py", "config"),  # config.json's auto_map names it for AutoConfig
    ("tokenizer_config.json", "tokenizer"),
    ("tokenization_kimi.py", "tokenizer"),  # tokenizer_config.json's auto_map names it
    ("tiktoken.model", "tokenizer"),  # tokenization_kimi.py's VOCAB_FILES_NAMES names it
    ("LICENSE", "license"),
])
def test_each_missing_file_is_named(k3_tiny: Path, clone_checkpoint, name: str, kind: str) -> None:
    root = clone_checkpoint(k3_tiny)
    (root / name).unlink()
    _, found = loadable_findings(root)
    assert [(f.kind, f.path.name) for f in found] == [(kind, name)]
    assert str(found[0]).startswith(f"{root / name}: not found")
    with pytest.raises(ConfigError if kind == "config" else EngineFilesError, match=name):
        require_loadable(root)


def test_a_tokenizers_json_tokenizer_needs_its_vocabulary(gptoss_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(gptoss_tiny)
    (root / "tokenizer.json").unlink()
    _, found = loadable_findings(root)
    assert [f.kind for f in found] == ["tokenizer"] and found[0].path == root / "tokenizer_config.json"
    assert "names no vocabulary file and none is present (tokenizer.json" in str(found[0])


def test_tokenizer_rule_reads_what_the_config_names(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    tc = {"auto_map": {"AutoTokenizer": ["org/other--tokenization_x.Tok", None]}, "merges_file": "merges.txt"}
    (root / "tokenizer_config.json").write_text(json.dumps(tc))
    _, found = loadable_findings(root)
    # a module in another repository is not required here; a *_file the config names is
    assert [f.path.name for f in found if f.kind == "tokenizer"] == ["merges.txt"]
    tc["auto_map"] = {"AutoTokenizer": "tokenization_x.Tok"}
    (root / "tokenization_x.py").write_text('VOCAB_FILES_NAMES: dict[str, str] = {"vocab_file": "x.model"}\n')
    (root / "merges.txt").write_text("")
    (root / "tokenizer_config.json").write_text(json.dumps(tc))
    _, found = loadable_findings(root)
    assert [f.path.name for f in found if f.kind == "tokenizer"] == ["x.model"]  # read with ast, never imported
    (root / "tokenizer_config.json").write_text("[1, 2]")
    _, found = loadable_findings(root)
    assert [str(f) for f in found if f.kind == "tokenizer"] == [f"{root / 'tokenizer_config.json'}: not a JSON object"]


def test_a_model_cards_license_metadata_is_a_licence(k3_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(k3_tiny)
    (root / "LICENSE").unlink()
    (root / "README.md").write_text("# Kimi\n\nlicense: mit\n")  # not in the metadata block: not a declaration
    assert license_source(root) is None
    (root / "README.md").write_text("---\nlibrary_name: transformers\nlicense: other\n---\n# Kimi\n")
    assert license_source(root) == root / "README.md" and loadable_findings(root)[1] == []
    assert rows(pf.preflight(root, environ=NO_GPU))["license"].reason == "README.md metadata: license other"


def test_a_dangling_symlink_is_named_as_one(k3_tiny: Path, clone_checkpoint) -> None:
    root = clone_checkpoint(k3_tiny)
    (root / "LICENSE").unlink()
    (root / "LICENSE").symlink_to("../../blobs/0123abcd")
    _, found = loadable_findings(root)
    assert [str(f) for f in found] == [f"{root / 'LICENSE'}: not found (a symlink to ../../blobs/0123abcd, "
                                       f"which does not exist)"]


# -- reshard refuses a source an engine could not load ------------------------------------------------


@pytest.mark.parametrize("name, content", [
    ("config.json", None), ("config.json", "garbage{"), ("tiktoken.model", None), ("tokenization_kimi.py", None),
    ("tokenizer_config.json", None), ("LICENSE", None),
])
@pytest.mark.parametrize("layout", ["node", "rank"])
def test_reshard_refuses_before_writing_anything(k3_tiny: Path, clone_checkpoint, tmp_path: Path, name: str,
                                                 content: str | None, layout: str) -> None:
    src = clone_checkpoint(k3_tiny)
    if content is None:
        (src / name).unlink()
    else:
        (src / name).write_text(content)
    out = tmp_path / "out"
    res = run("reshard", str(src), "-o", str(out), "--ep", "2", "--format", layout)
    assert_one_line_error(res, 2, str(src / name))
    assert not out.exists()


# -- preflight: ready means loadable; no PASS for a check that could not run ----------------------------


@pytest.mark.parametrize("content", [None, "garbage{"])
def test_preflight_of_a_checkpoint_with_a_missing_or_garbage_config(k3_tiny: Path, clone_checkpoint,
                                                                    content: str | None) -> None:
    root = clone_checkpoint(k3_tiny)
    if content is None:
        (root / "config.json").unlink()
    else:
        (root / "config.json").write_text(content)
    res = run("preflight", str(root))
    assert res.exit_code == 1 and "not ready" in res.output and "ready to load" not in res.output
    lines = res.output.splitlines()
    config = [x for x in lines if x.startswith("FAIL  config")]
    assert len(config) == 1 and str(root / "config.json") in config[0]
    # which layers need which experts is the config's to say: that check did not run
    assert not any(x.startswith("PASS  experts") for x in lines)
    assert any(x.startswith("WARN  experts") and "not checked" in x for x in lines)
    assert not any(x.startswith("PASS") and "config agree" in x for x in lines)


def test_preflight_of_a_node_directory_with_a_garbage_config(k3_tiny: Path, tmp_path: Path) -> None:
    out = tmp_path / "nodes"
    reshard(k3_tiny, out, RankSelection(tp=2, dp=2, gpus_per_node=2))
    node = out / "node-00000"
    (node / "config.json").write_text("garbage{")
    rep = pf.preflight(node, environ=NO_GPU)
    r = rows(rep)
    assert not rep.ok and r["config"].status == "FAIL" and str(node / "config.json") in r["config"].reason
    assert r["config"].fix == f"cp -n {k3_tiny.resolve()}/config.json {node}/"  # reshard's source has it
    assert r["experts"].status != "PASS" and r["quantization"].status != "PASS"


def test_preflight_of_a_rank_layout_without_its_config_and_licence(k3_tiny: Path, tmp_path: Path) -> None:
    """The observation: a layout with no config.json was "0 FAIL ... ready to load"."""
    out = tmp_path / "layout"
    reshard(k3_tiny, out, RankSelection(ep=2), layout="rank")
    assert pf.preflight(out, environ=NO_GPU).ok
    (out / "config.json").unlink()
    (out / "LICENSE").unlink()
    (out / "tiktoken.model").unlink()
    rep = pf.preflight(out, environ=NO_GPU)
    text = pf.render_preflight(rep)
    assert not rep.ok and text.splitlines()[-1].endswith("not ready")
    fails = {c.name: c for c in rep.checks if c.status == "FAIL"}
    assert set(fails) == {"config", "tokenizer", "license"}
    assert fails["config"].reason == f"{out / 'config.json'}: not found"
    assert fails["tokenizer"].reason.startswith(f"{out / 'tiktoken.model'}: not found")
    assert fails["license"].reason.startswith(f"{out / 'LICENSE'}: not found")
    for c in fails.values():  # the fix copies from the source reshard recorded, replacing nothing
        assert c.fix is not None and c.fix.startswith(f"cp -n {k3_tiny.resolve()}/")
        argv = shlex.split(c.fix)
        shutil.copy(argv[2], argv[3])
    assert pf.preflight(out, environ=NO_GPU).ok


# -- the same broken config.json in every command ---------------------------------------------------


@pytest.mark.parametrize("content, problem", [("garbage{", "not valid JSON"), ('{"num_hidden_layers": "x"}', "")])
def test_every_command_on_a_garbage_config(k3_tiny: Path, clone_checkpoint, tmp_path: Path, content: str,
                                           problem: str) -> None:
    """A command that processes a checkpoint and cannot exits 2 with ConfigError's line; verify
    and preflight, whose job is to judge one, report it as a problem found (exit 1) in the same
    words (docs/deploy.md, "config.json in every command")."""
    root = clone_checkpoint(k3_tiny)
    (root / "config.json").write_text(content)
    cfg = str(root / "config.json")
    line = f"{cfg}: {problem}"
    cannot_run = [
        ["inspect", str(root)],
        ["plan", str(root), "--ep", "2"],
        ["reshard", str(root), "-o", str(tmp_path / "out"), "--ep", "2"],
        ["mx", "inspect", str(root)],
        ["manifest", "build", str(root), "-o", str(tmp_path / "m.json")],
    ]
    for args in cannot_run:
        assert_one_line_error(run(*args), 2, line)
    layout = tmp_path / "layout"  # unshard reads a rank layout: its copy of the config
    reshard(k3_tiny, layout, RankSelection(ep=2), layout="rank")
    (layout / "config.json").write_text(content)
    assert_one_line_error(run("unshard", str(layout), "-o", str(tmp_path / "un")), 2,
                          f"{layout / 'config.json'}: {problem}")
    assert not (tmp_path / "un").exists()

    for args in (["verify", str(root)], ["preflight", str(root)]):
        res = run(*args)
        assert res.exit_code == 1, (args, res.output)
        assert "config.json: " + (problem or "") in res.output and "Traceback" not in res.output


# -- a real Hugging Face cache ------------------------------------------------------------------------


@pytest.fixture
def hf_cache(k3_tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path, str]]:
    """``(repo folder, snapshot, commit)`` of k3-tiny downloaded by huggingface_hub's own client
    from the loopback hub (still serving, as ``HF_ENDPOINT``): blobs/, refs/main and
    snapshots/<commit>/ of relative symlinks."""
    import huggingface_hub.constants as hc
    from huggingface_hub import snapshot_download

    from k3ckpt.testing.hub import LoopbackHub

    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    served = tmp_path / "served"
    shutil.copytree(k3_tiny, served)
    with LoopbackHub({REPO: served}, cache_dir=tmp_path / "hub-hashes") as hub:
        snap = Path(snapshot_download(REPO, cache_dir=tmp_path / "hub", endpoint=hub.url, token=False))
        commit = hub.commit(REPO)
        repo_dir = tmp_path / "hub" / "models--moonshotai--Kimi-K3"
        assert (snap / "LICENSE").is_symlink() and snap == repo_dir / "snapshots" / commit
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield repo_dir, snap, commit


def _fix_outputs(rep: pf.PreflightReport) -> list[Path]:
    """Every directory a k3ckpt fix command of ``rep`` writes into."""
    outs = []
    for fix in [c.fix for c in rep.checks if c.fix] + ([rep.fix_all] if rep.fix_all else []):
        argv = shlex.split(fix)
        for flag in ("-o", "--local-dir"):
            if argv[0] == "k3ckpt" and flag in argv:
                outs.append(Path(argv[argv.index(flag) + 1]))
    return outs


@pytest.mark.parametrize("which", ["repo folder", "snapshot"])
def test_preflight_follows_the_snapshots_symlinks(hf_cache: tuple[Path, Path, str], which: str) -> None:
    repo_dir, snap, commit = hf_cache
    rep = pf.preflight(repo_dir if which == "repo folder" else snap, environ=NO_GPU)
    r = rows(rep)
    assert rep.ok, pf.render_preflight(rep)
    assert r["license"].status == "PASS" and r["license"].reason.startswith("LICENSE: Modified MIT")
    assert r["config"].status == r["tokenizer"].status == "PASS"
    assert r["source"].reason == f"from {REPO}@{commit}"


@pytest.mark.parametrize("which", ["repo folder", "snapshot"])
def test_fixes_never_write_into_the_cache(hf_cache: tuple[Path, Path, str], which: str) -> None:
    repo_dir, snap, commit = hf_cache
    target = repo_dir if which == "repo folder" else snap
    (snap / "LICENSE").resolve().unlink()  # the blob goes: the snapshot's symlink dangles
    shard = sorted(snap.glob("model-*.safetensors"))[-1]
    shard.resolve().unlink()
    rep = pf.preflight(target, environ=NO_GPU)
    r = rows(rep)
    assert r["license"].status == "FAIL"
    assert r["license"].reason.startswith(f"{snap.resolve() / 'LICENSE'}: not found (a symlink to ../../blobs/")
    # the cache's own client adds what is missing, the cache's way (blobs + symlinks)
    assert r["license"].fix == f"hf download {REPO} LICENSE --revision {commit} --cache-dir {repo_dir.parent}"
    assert r["structure"].fix == f"hf download {REPO} {shard.name} --revision {commit} --cache-dir {repo_dir.parent}"
    engine = pf.preflight(target, RankSelection(tp=2, dp=2, node=1, gpus_per_node=2), engine="vllm",
                          environ=NO_GPU)
    assert rows(engine)["exact"].status == "WARN"  # a full download holds other nodes' experts
    outs = _fix_outputs(rep) + _fix_outputs(engine)
    assert outs and all(not is_within(o, repo_dir) and not o.exists() for o in outs), outs
    assert rows(engine)["exact"].fix.split("--local-dir ")[1].startswith(f"{repo_dir.parent}-Kimi-K3-node1-tp2-dp2 ")
    # the hub client's fix repairs the cache its own way: the snapshot loads again
    for fix in (r["license"].fix, r["structure"].fix):
        hf = Path(sys.executable).with_name("hf")
        res = subprocess.run([str(hf), *shlex.split(fix)[1:]], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
    assert (snap / "LICENSE").is_symlink() and pf.preflight(target, environ=NO_GPU).ok


def test_topology_mismatch_fix_writes_a_new_directory_and_keeps_the_old(k3_tiny: Path, tmp_path: Path) -> None:
    """The observation: the fix was ``reshard ... -o <the ep 2 layout> --ep 4 --force``."""
    out = tmp_path / "k3-ep2"
    reshard(k3_tiny, out, RankSelection(ep=2), layout="rank")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    (tmp_path / "k3-ep2-ep4-tp1").mkdir()  # taken: the fix picks the next free name
    r = rows(pf.preflight(out, RankSelection(ep=4), environ=NO_GPU))["topology"]
    assert r.status == "FAIL" and r.fix is not None and "--force" not in r.fix
    new = tmp_path / "k3-ep2-ep4-tp1-2"
    assert r.fix == f"k3ckpt reshard {k3_tiny.resolve()} -o {new} --format rank --ep 4 --tp 1"
    res = run(*shlex.split(r.fix)[1:])
    assert res.exit_code == 0, res.output
    assert pf.preflight(new, RankSelection(ep=4), environ=NO_GPU).ok
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert pf.preflight(out, RankSelection(ep=2), environ=NO_GPU).ok
