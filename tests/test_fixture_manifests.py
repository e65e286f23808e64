"""The committed manifests of the bundled fixtures: synth is byte-for-byte reproducible."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3ckpt.integrity.manifest import Manifest, build_manifest, diff_manifests

MANIFESTS = Path(__file__).resolve().parent.parent / "manifests"
HOW = "if synth changed on purpose, regenerate with the loop in manifests/README.md and review the diff"


@pytest.mark.parametrize("preset", ["k3-tiny", "gptoss-tiny", "k2-tiny"])
def test_fixture_matches_its_committed_manifest(request: pytest.FixtureRequest, preset: str) -> None:
    root = request.getfixturevalue(preset.replace("-", "_"))
    committed = Manifest.load(MANIFESTS / f"{preset}.json")
    built = build_manifest(root, tensor_hashes=True)
    changes = diff_manifests(committed, built)
    assert not changes, f"{preset}: {len(changes)} differences, first: {changes[0]} ({HOW})"
    assert built.to_json() == (MANIFESTS / f"{preset}.json").read_text(), HOW
