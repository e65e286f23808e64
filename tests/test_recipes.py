"""The deployment recipes run: ``examples/node-init.sh`` with the environment LeaderWorkerSet and
SLURM set, the LWS manifest's containers and the sbatch script themselves, against the loopback
hub (docs/recipes.md).

The served checkpoint is k3-tiny with 8 attention heads and 32 experts, so the examples' own
settings (8 GPUs per node, TP 8, 2 nodes, EP 16) run unchanged; only paths are mapped (each
emulated node gets its own "/nvme"). ``vllm``, ``srun`` and ``scontrol`` are stubs on PATH that
record what they were asked to run; ``k3ckpt`` is this interpreter's.
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

import pytest
import yaml

from helpers import REPO
from k3ckpt.format import open_checkpoint, read_node_marker
from k3ckpt.format.topology import Topology, ranks_of_node, tensors_for_ranks
from k3ckpt.integrity.manifest import build_manifest
from k3ckpt.testing.synth import spec_from_preset, synthesize

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
NODE_INIT = EXAMPLES / "node-init.sh"
LWS_YAML = EXAMPLES / "kubernetes" / "lws-kimi-k3.yaml"
SBATCH = EXAMPLES / "slurm" / "kimi-k3.sbatch"
NUM_EXPERTS = 32
ERROR = "node-init.sh: error: "

# The stubs. vllm records its argv and the launcher's view of the node; srun runs its command
# once per node, in order, with the variables srun sets for a task (one task per node), each
# emulated node's /nvme being its own directory; scontrol expands a node list "gpu[01-0N]".
VLLM_STUB = """#!{python}
import json, os, sys
with open(os.environ["VLLM_STUB_LOG"], "a") as fh:
    node = os.environ.get("LWS_WORKER_INDEX", os.environ.get("SLURM_NODEID"))
    fh.write(json.dumps({{"argv": sys.argv[1:], "node": node}}) + "\\n")
"""
SRUN_STUB = """#!{python}
import os, subprocess, sys
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("-"):
    key, _, value = args.pop(0).partition("=")
    opts[key] = value
if opts.get("--ntasks-per-node") != "1":
    sys.exit("srun stub: the recipe runs one task per node (--ntasks-per-node=1)")
nodes = int(opts.get("--nodes", os.environ["SLURM_NNODES"]))
for i in range(nodes):
    env = dict(os.environ, SLURM_NODEID=str(i), SLURM_NNODES=str(nodes), SLURM_PROCID=str(i),
               SLURM_NTASKS=str(nodes), SLURM_LOCALID="0", SLURM_NTASKS_PER_NODE="1")
    env["K3_DEST"] = env["K3_DEST"].replace("/nvme", os.environ["NODE_DISKS"] + f"/node{{i}}", 1)
    rc = subprocess.run(args, env=env).returncode
    if rc:
        sys.exit(rc)
"""
SCONTROL_STUB = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] || exit 2
i=1; while [ "$i" -le "$SLURM_NNODES" ]; do printf 'gpu%02d\\n' "$i"; i=$((i + 1)); done
"""
K3CKPT_STUB = """#!/bin/sh
exec {python} -m k3ckpt "$@"
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """k3-tiny widened to the examples' topology: 8 heads (TP 8) and 32 experts (EP 8, 16, 32)."""
    dest = tmp_path_factory.mktemp("recipe") / "Kimi-K3"
    synthesize(spec_from_preset("k3-tiny", num_attention_heads=8, kda_num_heads=8, num_experts=NUM_EXPERTS), dest)
    return dest


@pytest.fixture(scope="module")
def tensor_manifest(served: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("manifest") / "kimi-k3.tensors.json"
    build_manifest(served, tensor_hashes=True).save(path)
    return path


@pytest.fixture
def stubs(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("vllm", VLLM_STUB), ("srun", SRUN_STUB), ("scontrol", SCONTROL_STUB), ("k3ckpt", K3CKPT_STUB)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    return bin_dir


@pytest.fixture
def base_env(hub: Any, stubs: Path, tmp_path: Path, tensor_manifest: Path) -> dict[str, str]:
    """A clean environment (no launcher, hub or k3ckpt variables of this machine): the stubs
    first on PATH, the loopback hub as the Hugging Face endpoint, and the tensor-hash manifest
    that proves what a node fetches (without it the recipe refuses: docs/trust.md)."""
    return {
        "K3_MANIFEST": str(tensor_manifest),
        "PATH": f"{stubs}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        "HOME": str(tmp_path / "home"),
        "LANG": "C.UTF-8",
        "HF_ENDPOINT": hub.url,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HOME": str(tmp_path / "hf-home"),
        "K3CKPT_CACHE_DIR": str(tmp_path / "cache"),
        "VLLM_STUB_LOG": str(tmp_path / "vllm.jsonl"),
    }


def node_init(env: dict[str, str], *args: str, shell: str = "sh") -> subprocess.CompletedProcess[str]:
    return subprocess.run([shell, str(NODE_INIT), *args], env=env, capture_output=True, text=True, timeout=300,
                          check=False)


def vllm_calls(env: dict[str, str]) -> list[dict[str, Any]]:
    log = Path(env["VLLM_STUB_LOG"])
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def expected_serve(dest: str, node: int, nodes: int, gpus: int, tp: int, leader: str | None) -> list[str]:
    """The vllm serve argv for one node, from vLLM 0.33.0's multi-node data-parallel launch: the
    same DP size and local DP size on every node, the leader's address and RPC port; node 0
    serves the API, the others run headless from their first DP rank."""
    dp, dp_local = nodes * gpus // tp, gpus // tp
    argv = ["serve", dest, "--served-model-name", REPO, "--trust-remote-code", "--tensor-parallel-size", str(tp),
            "--enable-expert-parallel", "--enable-ep-weight-filter", "--expert-placement-strategy", "linear"]
    if dp > 1:
        argv += ["--data-parallel-size", str(dp)]
    if nodes > 1:
        assert leader is not None
        argv += ["--data-parallel-size-local", str(dp_local), "--data-parallel-address", leader,
                 "--data-parallel-rpc-port", "13345"]
        if node > 0:
            argv += ["--headless", "--data-parallel-start-rank", str(node * dp_local)]
    return argv


def assert_node_dir(dest: Path, served: Path, node: int, nodes: int, gpus: int, tp: int) -> None:
    """``dest`` is node ``node``'s directory: exactly the tensors its ranks hold (every dense
    tensor, only its ranks' experts), byte sizes as the source's, and the marker says so."""
    world = nodes * gpus
    topo = Topology.make(ep=world, tp=tp, num_experts=NUM_EXPERTS)
    ranks = ranks_of_node(node, gpus, world)
    full = open_checkpoint(served)
    want = set().union(*(rt.tensors for rt in tensors_for_ranks(full, topo, ranks).values()))
    have = open_checkpoint(dest).tensors
    assert set(have) == want
    assert all(have[n].nbytes == full.tensors[n].nbytes for n in have)
    experts = sorted({e for r in ranks for e in topo.rank_info(r).experts})
    assert len(experts) == NUM_EXPERTS // nodes
    marker = read_node_marker(dest)
    assert marker is not None
    assert (marker["node"], marker["ranks"], marker["experts"]) == (node, ranks, experts)
    assert (marker["topology"]["ep"], marker["topology"]["tp"]) == (world, tp)


def assert_one_line_error(res: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert res.returncode == code, res.stdout + res.stderr
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(ERROR), res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


# ----------------------------------------------------------------------------------------------
# node-init.sh under each launcher's variables
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shell", ["sh", "bash"])
def test_lws_nodes_fetch_their_share_check_it_and_serve(served: Path, tensor_manifest: Path, base_env: dict[str, str],
                                                       tmp_path: Path, shell: str) -> None:
    """2 nodes x 4 GPUs, TP 2: DP 4 with 2 DP ranks per node, EP 8 (4 experts per rank)."""
    leader = "kimi-k3-0.kimi-k3.default"
    dests = []
    for node in (0, 1):
        dest = tmp_path / f"node{node}" / "kimi-k3"
        env = dict(base_env, LWS_WORKER_INDEX=str(node), LWS_GROUP_SIZE="2", LWS_LEADER_ADDRESS=leader,
                   K3_DEST=str(dest), K3_GPUS_PER_NODE="4", K3_TP="2", K3_MANIFEST=str(tensor_manifest))
        res = node_init(env, "init", shell=shell)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"LeaderWorkerSet node {node} of 2: ranks {4 * node}-{4 * node + 3} of ep 8 x tp 2 (dp 4)" in res.stdout
        assert "tensors verified against the manifest, 0 failed" in res.stdout
        assert "result     0 FAIL" in res.stdout and "ready to load" in res.stdout
        want = expected_serve(str(dest), node, 2, 4, 2, leader)
        assert res.stdout.splitlines()[-1] == shlex.join(["vllm", *want])
        assert_node_dir(dest, served, node, 2, 4, 2)
        # the main container's step: exactly that command, exec'd
        assert node_init(env, "serve", shell=shell).returncode == 0
        assert vllm_calls(env)[-1] == {"argv": want, "node": str(node)}
        dests.append(dest)
    # the two nodes split the experts between them and each holds every dense tensor
    m0, m1 = (read_node_marker(d) for d in dests)
    assert m0 is not None and m1 is not None
    assert sorted(m0["experts"] + m1["experts"]) == list(range(NUM_EXPERTS))


def test_slurm_single_node_serves_without_data_parallel_flags(served: Path, base_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    """One node of 8 GPUs, TP 8: every expert on the node, vLLM TP 8 with EP 8, no DP flags; no
    leader address needed. A re-run (a restarted init) fetches nothing and passes again."""
    dest = tmp_path / "nvme" / "kimi-k3"
    env = dict(base_env, SLURM_NODEID="0", SLURM_NNODES="1", K3_DEST=str(dest))
    for _ in range(2):
        res = node_init(env, "init")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "ready to load" in res.stdout
    assert re.search(r" 0 node files written, 0 whole files fetched, [1-9]\d* already present, [\d,]+ tensors "
                     r"verified against the manifest, 0 failed; 0 B downloaded this run", res.stdout)
    assert res.stdout.splitlines()[-1] == shlex.join(["vllm", *expected_serve(str(dest), 0, 1, 8, 8, None)])
    assert "--data-parallel" not in res.stdout.splitlines()[-1]
    assert_node_dir(dest, served, 0, 1, 8, 8)


def test_k3_guard_puts_the_k3ckpt_load_format_in_the_recorded_line(served: Path, base_env: dict[str, str],
                                                                     tmp_path: Path) -> None:
    """K3_GUARD=1: the line init records (and serve execs) loads with ``--load-format k3ckpt``;
    0 or unset in an environment without vLLM: without it, and the report says what that loses;
    anything else is a one-line error before any byte."""
    dest = tmp_path / "nvme" / "kimi-k3"
    env = dict(base_env, SLURM_NODEID="0", SLURM_NNODES="1", K3_DEST=str(dest))
    plain = ["vllm", *expected_serve(str(dest), 0, 1, 8, 8, None)]
    for guard, want in (("1", [*plain, "--load-format", "k3ckpt"]), ("0", plain), (None, plain)):
        res = node_init(env if guard is None else dict(env, K3_GUARD=guard), "init")
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.splitlines()[-1] == shlex.join(want)
        assert ("note       without --load-format k3ckpt" in res.stdout) == (guard != "1")
        assert node_init(dict(env, K3_GUARD=guard or ""), "serve").returncode == 0
        assert vllm_calls(env)[-1]["argv"] == want[1:]
    assert_one_line_error(node_init(dict(env, K3_GUARD="yes"), "init"), 2, "K3_GUARD=yes is not 0 or 1")


def test_a_disk_that_held_another_node_is_turned_into_this_one(served: Path, base_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    """LWS with a hostPath: a rescheduled group can give a node's disk another worker index. The
    init then rewrites the shards that differ, keeps the rest, and the directory holds exactly
    the new node's experts - none of the old node's left behind."""
    dest = tmp_path / "nvme" / "kimi-k3"
    for node in (0, 1):
        env = dict(base_env, LWS_WORKER_INDEX=str(node), LWS_GROUP_SIZE="2", LWS_LEADER_ADDRESS="leader",
                   K3_DEST=str(dest), K3_GPUS_PER_NODE="4", K3_TP="4")
        res = node_init(env, "init")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "ready to load" in res.stdout
    assert re.search(r" 0 whole files fetched, [1-9]\d* already present, [\d,]+ tensors verified against the "
                     r"manifest, 0 failed; ", res.stdout)
    assert_node_dir(dest, served, 1, 2, 4, 4)


def test_without_a_manifest_the_recipe_refuses_before_any_byte_unless_told(hub: Any, base_env: dict[str, str],
                                                                          tmp_path: Path) -> None:
    """Issue #25: with no K3_MANIFEST, node-init fetched node files it could only check for
    structure and sizes, and preflight said "ready to load". Now the fetch is refused before any
    byte (exit 2); K3_ALLOW_UNPROVEN=1 serves such a share knowingly, and preflight says so."""
    dest = tmp_path / "nvme" / "kimi-k3"
    env = {k: v for k, v in base_env.items() if k != "K3_MANIFEST"}
    env.update(SLURM_NODEID="0", SLURM_NNODES="1", K3_DEST=str(dest))
    hub.reset_counters()
    res = node_init(env, "init")
    assert res.returncode == 2 and "--require-proof: a rank-aware fetch without --manifest" in res.stderr, res.stdout
    assert not dest.exists() and hub.total_bytes_sent() == 0 and "vllm serve" not in res.stdout
    res = node_init(dict(env, K3_ALLOW_UNPROVEN="1"), "init")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "K3_ALLOW_UNPROVEN=1 and no K3_MANIFEST" in res.stderr
    assert re.search(r"^WARN  proof +not proven: ", res.stdout, re.MULTILINE) and "loadable, not proven" in res.stdout
    assert "ready to load" not in res.stdout and res.stdout.splitlines()[-1].startswith("vllm serve ")


def small_gpus(stubs: Path) -> None:
    """An ``nvidia-smi`` showing 8 GPUs of 15 GiB: the default 20 GiB KV budget does not fit, a
    preflight FAIL."""
    smi = stubs / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor i in 1 2 3 4 5 6 7 8; do echo 'Tesla T4, 15360, 0'; done\n")
    smi.chmod(0o755)


def test_a_preflight_fail_stops_the_node_before_serving(base_env: dict[str, str], stubs: Path,
                                                         tmp_path: Path) -> None:
    """preflight's exit 1 is the script's: the init container fails, no serve line is printed.
    (GPUs too small for the KV budget: a full disk would not do, loading writes nothing there.)"""
    small_gpus(stubs)
    env = dict(base_env, SLURM_NODEID="1", SLURM_NNODES="2", K3_LEADER_ADDRESS="gpu01",
               K3_DEST=str(tmp_path / "nvme" / "kimi-k3"))
    res = node_init(env, "init")
    assert res.returncode == 1, res.stdout + res.stderr
    assert re.search(r"^FAIL  gpu .*Tesla T4", res.stdout, re.MULTILINE)
    assert "not ready" in res.stdout and "vllm serve" not in res.stdout


@pytest.mark.parametrize(("variables", "needles"), [
    ({}, ["no launcher variables", "LWS_WORKER_INDEX", "SLURM_NODEID"]),
    ({"LWS_GROUP_SIZE": "2"}, ["LWS_WORKER_INDEX is not"]),
    ({"LWS_WORKER_INDEX": "1"}, ["LWS_GROUP_SIZE is not"]),
    ({"SLURM_NNODES": "2"}, ["SLURM_NODEID is not", "srun"]),
    ({"SLURM_NODEID": "0"}, ["SLURM_NNODES is not"]),
    ({"SLURM_NODEID": "x", "SLURM_NNODES": "2"}, ["SLURM_NODEID=x is not a non-negative integer"]),
    ({"SLURM_NODEID": "2", "SLURM_NNODES": "2"}, ["node index 2 is not below the node count 2"]),
    ({"SLURM_NODEID": "1", "SLURM_NNODES": "2"}, ["2 nodes need the leader's address"]),
    ({"SLURM_NODEID": "0", "SLURM_NNODES": "1", "K3_TP": "3"}, ["K3_TP=3 does not divide K3_GPUS_PER_NODE=8"]),
    ({"SLURM_NODEID": "0", "SLURM_NNODES": "1", "K3_TP": "0"}, ["must be at least 1"]),
])
@pytest.mark.parametrize("mode", ["init", "print"])
def test_missing_or_bad_launcher_variables_are_one_line_errors(base_env: dict[str, str], variables: dict[str, str],
                                                              needles: list[str], mode: str) -> None:
    res = node_init(dict(base_env, **variables), mode)
    assert_one_line_error(res, 2, *needles)
    assert not Path(base_env["K3CKPT_CACHE_DIR"]).exists()  # nothing was fetched


def test_bad_usage_is_a_one_line_error(base_env: dict[str, str]) -> None:
    env = dict(base_env, SLURM_NODEID="0", SLURM_NNODES="1")
    assert_one_line_error(node_init(env, "deploy"), 2, "unknown mode 'deploy'")
    assert_one_line_error(node_init(env, "init", "--tp", "8"), 2, "too many arguments", "K3_*")
    env["PATH"] = "/usr/bin:/bin"  # no k3ckpt
    assert_one_line_error(node_init(env, "init"), 2, "k3ckpt is not on PATH")


def test_leading_zeros_are_decimal(base_env: dict[str, str]) -> None:
    """Shell arithmetic reads 010 as octal; a launcher value with leading zeros is still decimal."""
    env = dict(base_env, LWS_WORKER_INDEX="09", LWS_GROUP_SIZE="010", LWS_LEADER_ADDRESS="leader")
    res = node_init(env, "print")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["vllm", *expected_serve("/nvme/kimi-k3", 9, 10, 8, 8, "leader")]


def test_extra_vllm_flags_are_appended_split_on_spaces_and_never_globbed(base_env: dict[str, str],
                                                                       tmp_path: Path) -> None:
    """serve execs the line init recorded (here: as k3ckpt serve-command writes it, a path with a
    space and a quote in it), then the extra flags - split on spaces, never globbed."""
    (tmp_path / "a-file").touch()
    dest = tmp_path / "nv me" / "kimi-k3's"
    dest.parent.mkdir()
    env = dict(base_env, SLURM_NODEID="0", SLURM_NNODES="1", K3_DEST=str(dest),
               K3_VLLM_ARGS="--max-model-len 131072  --x *")
    want = expected_serve(str(dest), 0, 1, 8, 8, None)
    Path(f"{dest}.serve").write_text(shlex.join(["vllm", *want]) + "\n")
    res = subprocess.run(["sh", str(NODE_INIT), "serve"], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    assert vllm_calls(env) == [{"argv": want + ["--max-model-len", "131072", "--x", "*"], "node": "0"}]


def test_serve_without_init_is_a_one_line_error(base_env: dict[str, str], tmp_path: Path) -> None:
    env = dict(base_env, SLURM_NODEID="0", SLURM_NNODES="1", K3_DEST=str(tmp_path / "kimi-k3"))
    assert_one_line_error(node_init(env, "serve"), 2, "no serve command recorded", "run 'node-init.sh init'")
    assert vllm_calls(env) == []


# ----------------------------------------------------------------------------------------------
# the examples run those command lines, with those variables
# ----------------------------------------------------------------------------------------------


def lws_documents() -> tuple[dict[str, Any], dict[str, Any]]:
    """(the settings ConfigMap, the LeaderWorkerSet) of the example manifest."""
    docs = list(yaml.safe_load_all(LWS_YAML.read_text()))
    lws = next(d for d in docs if d["kind"] == "LeaderWorkerSet")
    names = {c["configMapRef"]["name"] for tpl in ("leaderTemplate", "workerTemplate")
             for c in lws["spec"]["leaderWorkerTemplate"][tpl]["spec"]["containers"][0]["envFrom"]}
    assert len(names) == 1
    settings = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] in names)
    return settings, lws


def pod_command(container: dict[str, Any], volumes: list[dict[str, Any]], mounts: dict[str, Path]) -> list[str]:
    """A container's command with its mounted paths mapped to this machine (the ConfigMap that
    holds node-init.sh -> examples/)."""
    out = []
    for word in container["command"]:
        for m in container["volumeMounts"]:
            vol = next(v for v in volumes if v["name"] == m["name"])
            if word.startswith(m["mountPath"] + "/") and "configMap" in vol:
                word = str(mounts[vol["configMap"]["name"]]) + word[len(m["mountPath"]):]
        out.append(word)
    return out


def test_lws_manifest_runs_node_init_in_every_pod(served: Path, base_env: dict[str, str], tmp_path: Path) -> None:
    """Each pod of the example LeaderWorkerSet, as LWS creates it: the settings from its
    ConfigMap, LWS_WORKER_INDEX / LWS_GROUP_SIZE / LWS_LEADER_ADDRESS as LWS sets them, its own
    /nvme. The init container's command fetches and checks that pod's share; the main
    container's command starts vLLM (the stub) with that node's flags."""
    settings, lws = lws_documents()
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    size, name = tmpl["size"], lws["metadata"]["name"]
    gpus, tp = int(settings["data"]["K3_GPUS_PER_NODE"]), int(settings["data"]["K3_TP"])
    assert (size, gpus, tp) == (2, 8, 8)  # the docs' 2-node recipe: EP 16 = TP 8 x DP 2
    leader = f"{name}-0.{name}.default"  # LWS: <lws>-<group>.<headless service>.<namespace>
    for index in range(size):
        pod = tmpl["leaderTemplate" if index == 0 else "workerTemplate"]["spec"]
        disk = tmp_path / f"pod{index}"
        env = dict(base_env, LWS_WORKER_INDEX=str(index), LWS_GROUP_SIZE=str(size), LWS_LEADER_ADDRESS=leader)
        env.update({k: str(v) for k, v in settings["data"].items()})
        nvme = next(v for v in pod["volumes"] if "hostPath" in v)["hostPath"]["path"]
        env["K3_DEST"] = env["K3_DEST"].replace(nvme, str(disk), 1)
        assert env["K3_DEST"].startswith(str(disk))
        # the manifest where the example says each node has it (its own disk)
        assert env["K3_MANIFEST"].startswith(nvme + "/")
        env["K3_MANIFEST"] = env["K3_MANIFEST"].replace(nvme, str(disk), 1)
        disk.mkdir(parents=True, exist_ok=True)
        shutil.copy(base_env["K3_MANIFEST"], env["K3_MANIFEST"])
        mounts = {"k3ckpt-node-init": EXAMPLES}
        init, main = pod["initContainers"][0], pod["containers"][0]
        assert [f["configMapRef"]["name"] for f in init["envFrom"]] == [settings["metadata"]["name"]]
        assert init["envFrom"] == main["envFrom"]
        assert init["resources"]["limits"]["nvidia.com/gpu"] == main["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
        res = subprocess.run(pod_command(init, pod["volumes"], mounts), env=env, capture_output=True, text=True,
                             timeout=300, check=False)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "ready to load" in res.stdout
        want = expected_serve(env["K3_DEST"], index, size, gpus, tp, leader)
        assert res.stdout.splitlines()[-1] == shlex.join(["vllm", *want])
        assert_node_dir(Path(env["K3_DEST"]), served, index, size, gpus, tp)
        res = subprocess.run(pod_command(main, pod["volumes"], mounts), env=env, capture_output=True, text=True,
                             timeout=60, check=False)
        assert res.returncode == 0, res.stderr
        assert vllm_calls(env)[-1] == {"argv": want, "node": str(index)}
    assert len(vllm_calls(base_env)) == size


def test_lws_leader_and_worker_templates_differ_only_in_serving() -> None:
    """The init step, settings, GPUs and volumes are the same for the leader and the workers (the
    script tells them apart by LWS_WORKER_INDEX); only the leader exposes the API."""
    _, lws = lws_documents()
    tmpl = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = tmpl["leaderTemplate"]["spec"], tmpl["workerTemplate"]["spec"]
    assert leader["initContainers"] == worker["initContainers"]
    assert leader["volumes"] == worker["volumes"]
    strip = ("ports", "readinessProbe")
    assert {k: v for k, v in leader["containers"][0].items() if k not in strip} == worker["containers"][0]
    assert leader["containers"][0]["readinessProbe"]["httpGet"]["port"] == 8000
    assert [c["command"][-1] for c in (leader["initContainers"][0], leader["containers"][0])] == ["init", "serve"]


def sbatch_nodes() -> int:
    m = re.search(r"^#SBATCH --nodes=(\d+)$", SBATCH.read_text(), re.MULTILINE)
    assert m is not None
    return int(m.group(1))


def test_sbatch_runs_node_init_on_every_node(served: Path, base_env: dict[str, str], tmp_path: Path) -> None:
    """The sbatch script as SLURM runs it (the batch environment, then srun's per-task
    variables): every node fetches and checks its share, then vLLM starts on every node."""
    text = SBATCH.read_text()
    nodes = sbatch_nodes()
    assert nodes == 2 and "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --gpus-per-node=8" in text
    env = dict(base_env, SLURM_NNODES=str(nodes), SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_NODELIST="gpu[01-02]",
               SLURM_NODEID="0", SLURM_SUBMIT_DIR=str(ROOT), NODE_DISKS=str(tmp_path))
    res = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("ready to load") == nodes
    calls = vllm_calls(env)
    assert [c["node"] for c in calls] == [str(i) for i in range(nodes)]
    for i, call in enumerate(calls):
        dest = tmp_path / f"node{i}" / "kimi-k3"
        assert call["argv"] == expected_serve(str(dest), i, nodes, 8, 8, "gpu01")
        assert_node_dir(dest, served, i, nodes, 8, 8)


def test_sbatch_stops_when_a_node_fails_preflight(base_env: dict[str, str], stubs: Path, tmp_path: Path) -> None:
    small_gpus(stubs)
    env = dict(base_env, SLURM_NNODES="2", SLURM_JOB_NODELIST="gpu[01-02]", SLURM_SUBMIT_DIR=str(ROOT),
               NODE_DISKS=str(tmp_path))
    res = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 1, res.stdout + res.stderr
    assert vllm_calls(env) == []


def test_the_examples_all_call_the_tested_script() -> None:
    """Every step of both examples is node-init.sh (init, then serve), never a hand-written
    k3ckpt or vllm command line that the tests above would not cover."""
    _, lws = lws_documents()
    commands = [c["command"] for tpl in ("leaderTemplate", "workerTemplate")
                for key in ("initContainers", "containers")
                for c in lws["spec"]["leaderWorkerTemplate"][tpl]["spec"][key]]
    assert commands == [["sh", "/opt/k3ckpt/node-init.sh", m] for m in ("init", "serve")] * 2
    steps = [line.split() for line in SBATCH.read_text().splitlines() if line.startswith("srun ")]
    assert steps == [["srun", '--nodes="$SLURM_NNODES"', "--ntasks-per-node=1", "sh", '"$NODE_INIT"', m]
                     for m in ("init", "serve")]
    assert 'NODE_INIT="$SLURM_SUBMIT_DIR/examples/node-init.sh"' in SBATCH.read_text()
    for path in (LWS_YAML, SBATCH):
        code = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
        assert not [line for line in code if re.search(r"\b(k3ckpt (fetch|preflight)|vllm serve)\b", line)]


# ----------------------------------------------------------------------------------------------
# the serve flags are vLLM 0.33.0's
# ----------------------------------------------------------------------------------------------

#: Where vLLM 0.33.0 declares its serve flags, inside its wheel.
VLLM_ARG_FILES = ("vllm/engine/arg_utils.py", "vllm/entrypoints/common/cli_args.py")


def vllm_wheel() -> Path | None:
    """The pinned vLLM wheel in the engine cache that the conformance tests use
    (``$K3CKPT_ENGINE_CACHE``, else ``~/.cache/k3ckpt/engines``), or None."""
    cache = Path(os.environ.get("K3CKPT_ENGINE_CACHE") or Path.home() / ".cache" / "k3ckpt" / "engines")
    found = sorted(cache.glob("vllm-0.33.0-*.whl"))
    return found[0] if found else None


def vllm_declared_flags() -> set[str]:
    """Every ``add_argument`` flag of vLLM 0.33.0's serve command, read from its wheel (skips the
    test when the wheel is not cached)."""
    import zipfile

    wheel = vllm_wheel()
    if wheel is None:
        pytest.skip("vllm==0.33.0 wheel not in the engine cache (scripts/engines.sh downloads it)")
    with zipfile.ZipFile(wheel) as zf:
        source = "\n".join(zf.read(m).decode("utf-8") for m in VLLM_ARG_FILES)
    declared = set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", source))
    assert "--tensor-parallel-size" in declared  # the pattern reads the file as it is written
    return declared


def test_every_serve_flag_is_declared_by_vllm() -> None:
    """Each flag node-init.sh gives `vllm serve` (leader and worker of 2 nodes: the union of all
    cases) is an ``add_argument`` of vLLM 0.33.0, read from its wheel - a misspelt or renamed
    flag would make every node fail at start."""
    declared = vllm_declared_flags()
    flags = {a for node in (0, 1) for a in expected_serve("/d", node, 2, 8, 4, "leader") if a.startswith("--")}
    assert flags - declared == set()


@pytest.mark.parametrize(("tp", "dp", "gpus", "placement"), [
    (8, 1, 8, "linear"), (8, 2, 8, "linear"), (4, 4, 4, "round_robin"), (2, 8, 8, "linear"),
])
def test_every_flag_serve_command_emits_is_declared_by_vllm(tp: int, dp: int, gpus: int, placement: str) -> None:
    """The library's serve line (what preflight prints and node-init.sh runs), every node: each
    flag is vLLM 0.33.0's, and the line is the multi-node launch the recipes expect."""
    from k3ckpt.deploy import serve_command

    declared = vllm_declared_flags()
    nodes = tp * dp // gpus
    for node in range(nodes):
        argv = serve_command("/d", tp=tp, dp=dp, placement=placement, node=node, gpus_per_node=gpus,
                             leader_address="leader", served_model_name=REPO)
        guarded = serve_command("/d", tp=tp, dp=dp, placement=placement, node=node, gpus_per_node=gpus,
                                leader_address="leader", served_model_name=REPO, guard=True)
        assert guarded == [*argv, "--load-format", "k3ckpt"]
        assert {a for a in guarded if a.startswith("--")} - declared == set()
        if placement == "linear":
            assert argv == ["vllm", *expected_serve("/d", node, nodes, gpus, tp, "leader")]
        assert argv[argv.index("--expert-placement-strategy") + 1] == placement


def test_every_flag_of_the_sglang_line_is_sglangs() -> None:
    """The SGLang launch serve_command writes (preflight --engine sglang): every flag is one that
    SGLang 0.5.23 declares. Its server arguments are dataclass fields in
    ``sglang/srt/arg_groups/fields/*.py`` (``nnodes: A[int, ...]``), each the flag
    ``_field_to_cli_name`` makes of it (``--`` + the name with ``-`` for ``_``,
    ``arg_groups/arg_utils.py``), plus quoted ``aliases``; read from the wheel."""
    import zipfile

    from k3ckpt.deploy import serve_command

    cache = Path(os.environ.get("K3CKPT_ENGINE_CACHE") or Path.home() / ".cache" / "k3ckpt" / "engines")
    wheels = sorted(cache.glob("sglang-0.5.23-*.whl"))
    if not wheels:
        pytest.skip("sglang==0.5.23 wheel not in the engine cache (scripts/engines.sh downloads it)")
    with zipfile.ZipFile(wheels[0]) as zf:
        assert 'return "--" + name.replace("_", "-")' in zf.read("sglang/srt/arg_groups/arg_utils.py").decode()
        source = "\n".join(zf.read(m).decode("utf-8") for m in zf.namelist()
                           if m.startswith("sglang/srt/arg_groups/fields/") and m.endswith(".py"))
    declared = {"--" + f.replace("_", "-") for f in re.findall(r"^\s+(\w+): A\[", source, re.MULTILINE)}
    declared |= set(re.findall(r"\"(--[a-z0-9-]+)\"", source))
    assert "--tp-size" in declared and "--bogus-flag" not in declared  # the pattern reads the files as written
    flags = {a for node in (0, 1) for a in serve_command("/d", tp=8, dp=2, node=node, gpus_per_node=8,
                                                         served_model_name=REPO, engine="sglang")
             if a.startswith("--")}
    assert {"--ep-size", "--enable-dp-attention", "--nnodes", "--dist-init-addr"} <= flags
    assert flags - declared == set()
