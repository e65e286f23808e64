"""Hub to first token, served (#26 item 5, #27): ``scripts/serve_demo.py`` goes from an empty disk
to a completion twice - k3ckpt's route (``manifest pull`` -> ``fetch --node`` -> ``verify`` ->
``preflight --engine vllm --guard`` -> the serve line preflight printed, through ``--load-format
k3ckpt``) and the naive one (``hf download`` -> ``hf cache verify`` -> ``vllm serve REPO``
offline) - against the loopback hub serving ``k2-engine``, with the real ``vllm serve`` of the
engine environment. Both greedy completions must be real and equal, and the guarded load must
have checked every tensor of the node directory; the times are printed, never asserted. (~3.5
minutes: each route's server compiles the model once.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from enginelib import REPO_ROOT, Engine

pytestmark = pytest.mark.engine

SCRIPT = REPO_ROOT / "scripts" / "serve_demo.py"


def test_both_routes_serve_the_same_completion(engine: Engine, tmp_path: Path) -> None:
    out = tmp_path / "serve.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))  # this checkout's k3ckpt in the script's commands
    res = subprocess.run([sys.executable, str(SCRIPT), "--work", str(tmp_path / "work"), "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=1500)
    assert res.returncode == 0, (res.stdout + res.stderr)[-5000:]
    got = json.loads(out.read_text())
    k3, naive = got["k3ckpt"], got["naive"]
    assert [s for s, _ in k3["steps"]] == ["manifest pull --tensor-hashes", "fetch --node 0", "verify --manifest",
                                           "preflight --engine vllm --guard", "vllm serve until /health",
                                           "POST /v1/completions"], k3["steps"]
    assert [s for s, _ in naive["steps"]] == ["hf download", "hf cache verify", "vllm serve until /health",
                                              "POST /v1/completions"], naive["steps"]
    assert k3["text"].strip() and len(set(k3["text"])) >= 3, k3["text"]
    assert k3["text"] == naive["text"] and got["same"], (k3["text"], naive["text"])
    assert k3["ttft"] > 0 and naive["ttft"] > 0
    # the served line is preflight's, through the k3ckpt load format: the engine checked every tensor
    assert k3["serve"][:2] == ["vllm", "serve"] and k3["serve"][-2:] == ["--load-format", "k3ckpt"], k3["serve"]
    node = k3["serve"][2]
    held = len(json.loads(Path(node, "k3ckpt-node.json").read_text())["tensors"])
    assert k3["checked"] == [f"k3ckpt: checked: {node}: {held} tensors read, each matches its sha256 in "
                             f"{node}/k3ckpt-node.json"], k3["checked"]
    assert "time to first token: k3ckpt" in res.stdout
