"""Shared fixtures: synthetic checkpoints of the three families, built once per session, and a
writer for deliberately malformed safetensors files.

The session fixtures are shared by many tests and must never be modified: a test that needs
to break something copies one first (``shutil.copytree``, or the ``clone_checkpoint`` fixture).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_edit import set_expert_groups
from enginelib import ckpts, engine, k2_hub, plugin  # noqa: F401  (the running-engine tests' session fixtures)
from k3ckpt.testing.synth import spec_from_preset, synthesize


def pytest_configure(config: pytest.Config) -> None:
    """No test writes into this machine's hub caches: ``fetch`` without ``--local-dir`` writes
    into the clients' own cache (``HF_HOME``, ``MODELSCOPE_CACHE``), so unless the caller chose
    them, they point into a directory of this run (child processes inherit them)."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="k3ckpt-test-caches-"))
    for var, sub in (("HF_HOME", "hf-home"), ("MODELSCOPE_CACHE", "ms-cache")):
        os.environ.setdefault(var, str(root / sub))


def write_raw_safetensors(
    path: str | os.PathLike[str],
    header_obj_or_bytes: Any,
    data: bytes = b"",
    *,
    length: int | None = None,
) -> Path:
    """Write ``<8-byte LE length><header bytes><data>`` to ``path``, whatever the header says.

    ``header_obj_or_bytes`` is written verbatim when it is ``bytes`` (UTF-8 encoded when it is a
    ``str``), otherwise serialized with ``json.dumps``. ``length`` overrides the length prefix
    (default: the real length of the header bytes), to fake oversized or truncated headers.
    """
    if isinstance(header_obj_or_bytes, (bytes, bytearray)):
        raw = bytes(header_obj_or_bytes)
    elif isinstance(header_obj_or_bytes, str):
        raw = header_obj_or_bytes.encode("utf-8")
    else:
        raw = json.dumps(header_obj_or_bytes).encode("utf-8")
    n = len(raw) if length is None else length
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(struct.pack("<Q", n) + raw + bytes(data))
    return p


@pytest.fixture(scope="session")
def write_raw() -> Callable[..., Path]:
    """:func:`write_raw_safetensors`, as a fixture (no import of ``conftest`` needed)."""
    return write_raw_safetensors


def _synth(preset: str, factory: pytest.TempPathFactory) -> Path:
    dest = factory.mktemp(preset.replace("-", "_")) / preset
    synthesize(spec_from_preset(preset), dest)
    return dest


@pytest.fixture(scope="session")
def k3_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``k3-tiny`` preset (read-only: copy before changing anything)."""
    return _synth("k3-tiny", tmp_path_factory)


@pytest.fixture(scope="session")
def k3_tiny_manifests(k3_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Manifests of the clean ``k3-tiny``, built once: ``"tensors"`` (with tensor hashes) and
    ``"files"`` (without) -> its path (read-only)."""
    from k3ckpt.integrity.manifest import build_manifest

    d = tmp_path_factory.mktemp("k3-tiny-manifests")
    out = {}
    for name, tensor_hashes in (("tensors", True), ("files", False)):
        build_manifest(k3_tiny, tensor_hashes=tensor_hashes).save(d / f"{name}.json")
        out[name] = d / f"{name}.json"
    return out


@pytest.fixture(scope="session")
def k3_full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The full K3 inventory with empty tensor data (the ``k3-full`` preset, headers only: ~10 s,
    130 MB on disk), once per session, for ``slow`` tests at K3 scale (read-only)."""
    return _synth("k3-full", tmp_path_factory)


@pytest.fixture(scope="session")
def gptoss_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``gptoss-tiny`` preset (read-only)."""
    return _synth("gptoss-tiny", tmp_path_factory)


@pytest.fixture(scope="session")
def k2_tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``k2-tiny`` preset (read-only)."""
    return _synth("k2-tiny", tmp_path_factory)


@pytest.fixture(scope="session")
def k3_tiny_grouped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``k3-tiny`` whose router has 2 expert groups (``text_config.n_group``): a model vLLM
    serves round_robin node directories of, which reshard writes only for such a model (read-only)."""
    return set_expert_groups(_synth("k3-tiny", tmp_path_factory), 2)


@pytest.fixture(scope="session")
def k2_tiny_grouped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``k2-tiny`` with 2 expert groups (``n_group`` 2; the preset has 1, as Kimi-K2): see
    ``k3_tiny_grouped`` (read-only)."""
    return set_expert_groups(_synth("k2-tiny", tmp_path_factory), 2)


@pytest.fixture
def clone_checkpoint(tmp_path: Path) -> Callable[[Path], Path]:
    """``clone(src) -> copy``: a private copy of a session checkpoint that a test may break."""
    counter = iter(range(1_000_000))

    def clone(src: Path) -> Path:
        dest = tmp_path / f"clone-{next(counter)}-{src.name}"
        shutil.copytree(src, dest)
        return dest

    return clone


def _serve_copy(src: Path, tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    from k3ckpt.testing.hub import LoopbackHub

    served = tmp_path / "served"
    shutil.copytree(src, served)
    with LoopbackHub({"moonshotai/Kimi-K3": served}, cache_dir=tmp_path / "hub-cache") as h:
        yield h, served


@pytest.fixture()
def served_hub(k3_tiny: Path, tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    """``(hub, served_dir)``: a private copy of k3-tiny served as ``moonshotai/Kimi-K3`` on a
    loopback hub (fresh per test, so faults and counters never leak between tests)."""
    yield from _serve_copy(k3_tiny, tmp_path)


@pytest.fixture()
def grouped_hub(k3_tiny_grouped: Path, tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    """``served_hub`` of ``k3_tiny_grouped`` (2 expert groups: round_robin node fetches)."""
    yield from _serve_copy(k3_tiny_grouped, tmp_path)


@pytest.fixture()
def isolated_hub_clients(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No credentials, endpoints or caches from the machine leak into a test that talks to a hub
    through the real clients (use with ``pytest.mark.usefixtures`` or an autouse wrapper)."""
    import huggingface_hub.constants as hfc
    import modelscope_hub.config as msc

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_ENDPOINT", "MODELSCOPE_API_TOKEN",
                "MODELSCOPE_ENDPOINT", "MODELSCOPE_DOMAIN", "K3CKPT_TEST_PAUSE_AT", "K3CKPT_LOCK_STALE_SECONDS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(hfc, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(hfc, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf" / "stored_tokens"))
    monkeypatch.setattr(hfc, "HF_HUB_DISABLE_IMPLICIT_TOKEN", False)
    monkeypatch.setattr(hfc, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("MODELSCOPE_HOME", str(tmp_path / "ms-home"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms-cache"))
    monkeypatch.setattr(msc, "_default_config", None)


@pytest.fixture(scope="module")
def hash_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A loopback hub's hash cache, shared by one test module's hubs (each file hashed once)."""
    return tmp_path_factory.mktemp("hub-hash-cache")


@pytest.fixture(scope="module")
def module_hub(served: Path, hash_cache: Path) -> Iterator[Any]:
    """One loopback hub per test module, serving that module's ``served`` directory (the module
    defines the ``served`` fixture) as ``helpers.REPO``. Tests use it through ``hub``."""
    from helpers import REPO
    from k3ckpt.testing.hub import LoopbackHub

    with LoopbackHub({REPO: served}, cache_dir=hash_cache) as h:
        yield h


@pytest.fixture
def hub(module_hub: Any) -> Iterator[Any]:
    """A test module's shared loopback hub (the module defines ``module_hub``) with no armed
    faults and zeroed counters, so nothing leaks between its tests."""
    module_hub.faults.clear()
    module_hub.reset_counters()
    yield module_hub
    module_hub.faults.clear()
