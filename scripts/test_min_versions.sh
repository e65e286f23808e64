#!/usr/bin/env bash
# The minimum-versions job: install k3ckpt with every runtime dependency pinned at its declared
# floor (constraints/minimum.txt) into a venv of its own (.venv-min), then run a smoke subset of
# the suite: fetch (hf download's vocabulary, Xet redirects, the hub caches the real clients then
# read offline) and rank-aware fetch from both hubs (the loopback emulator), manifest pull,
# verify against a hub listing, signing, F8_E8M0/MXFP4 reading and the compressed-tensors golden
# vectors, mx dequant/quantize, reshard.
# A floor in pyproject.toml that no longer works fails here. Extra arguments go to pytest.
# Left out: what checks the emulator or `hf download` against the newest huggingface_hub rather
# than k3ckpt at its floors (the real `hf download` of 1.0 treats FILES "sub/" as a file; the
# emulator's Xet listing is checked with a helper huggingface_hub 1.0 does not have; its
# snapshot_download has no IncompleteSnapshotError for a partial cache).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
ensure_venv "test" "$PWD/.venv-min" -c constraints/minimum.txt

# The venv really holds the floors (pip could have been given a newer wheel by another constraint).
.venv-min/bin/python - constraints/minimum.txt <<'PY'
import sys
from importlib.metadata import version
pins = [line.split("#")[0].strip() for line in open(sys.argv[1])]
wrong = [f"{name} {version(name)} (pinned {want})" for name, _, want in (p.partition("==") for p in pins if p)
         if version(name) != want]
if wrong:
    sys.exit("k3ckpt: the minimum-versions venv does not hold the floors: " + ", ".join(wrong))
PY

export HF_HUB_DISABLE_XET=1 HF_HUB_OFFLINE=0 HF_HUB_DISABLE_TELEMETRY=1 PYTHONDONTWRITEBYTECODE=1
exec .venv-min/bin/python -m pytest -q -p no:cacheprovider \
  tests/test_dependencies.py \
  tests/test_fetch_cli.py \
  tests/test_vocabulary.py \
  tests/test_xet.py \
  tests/test_fetch_cache.py \
  tests/test_hubclient.py \
  tests/test_manifest_pull.py \
  tests/test_verify.py::test_verify_against_a_hub_listing \
  tests/test_rankfetch.py::test_node0_moves_only_its_share_and_reshards_identically \
  tests/test_rankfetch.py::test_modelscope_gives_the_same_bytes \
  tests/test_signing.py \
  tests/test_checkpoint.py \
  tests/test_mxfp4.py \
  tests/test_mx_convert.py \
  tests/test_mxfp4_golden.py \
  tests/test_reshard.py::test_k3_layouts_complete \
  tests/test_reshard.py::test_cli \
  -k "not bounded_memory and not positional_is_hf_download_files and not client_parses_for_xet_files \
    and not refuses_an_incomplete_cache_fetch_offline" "$@"
