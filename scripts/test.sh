#!/usr/bin/env bash
# Create .venv if missing, install k3ckpt with its test extra, check the code (ruff on the
# repository, mypy on the package), then run the whole suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k header -x
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv "test,plot"

# The checks run first and stop the script: a lint or type error is cheaper to see than a
# 5-minute suite. Their settings (and mypy's file list) are in pyproject.toml.
if ! .venv/bin/ruff check --quiet .; then
  echo "k3ckpt: ruff check failed (see above; 'ruff check --fix .' fixes some)" >&2
  exit 1
fi
if ! .venv/bin/mypy; then
  echo "k3ckpt: mypy failed on the package (see above)" >&2
  exit 1
fi

# The pinned vLLM/SGLang wheels the engine conformance tests read (a cache outside the
# repository; instant when cached; a failed download makes those tests skip, never this script).
bash scripts/engines.sh .venv/bin/python

export HF_HUB_DISABLE_XET=1 HF_HUB_OFFLINE=0 HF_HUB_DISABLE_TELEMETRY=1 PYTHONDONTWRITEBYTECODE=1
exec .venv/bin/python -m pytest -q "$@"
