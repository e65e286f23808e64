#!/usr/bin/env bash
# Create .venv if missing, install k3ckpt with its test extra, run the whole suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k header -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv "test,plot"
export HF_HUB_DISABLE_XET=1 HF_HUB_OFFLINE=0 HF_HUB_DISABLE_TELEMETRY=1 PYTHONDONTWRITEBYTECODE=1
exec .venv/bin/python -m pytest -q "$@"
