"""scripts/venv.sh: interpreters probed without noise, and one venv serving the demo ("") and the
tests ("test,plot") without reinstalling when the two alternate. Run against a copy of the script
with a fake venv whose ``bin/python`` only records what it was asked to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "venv.sh"
#: What a pyenv shim prints for a version that is installed but not selected.
PYENV_SHIM = """#!/bin/sh
echo "pyenv: $(basename "$0"): command not found" >&2
echo "" >&2
echo "The \\`$(basename "$0")' command exists in these Python versions:" >&2
exit 127
"""
FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls.log"
"""


def bash(code: str, root: Path, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    env.pop("PYTHON", None)
    return subprocess.run(["bash", "-c", f"source {root}/scripts/venv.sh && {code}"], capture_output=True,
                          text=True, env=env, timeout=60)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A copy of the script next to a pyproject.toml, and a fake .venv."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "venv.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    fake = tmp_path / ".venv" / "bin" / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return tmp_path


def installs(root: Path) -> list[str]:
    """The `pip install -e` calls made so far (the pip self-upgrade and the import check left out)."""
    log = root / ".venv" / "calls.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [line.split(" -e ", 1)[1].replace(str(root), "ROOT") for line in lines if " -e " in line]


def test_pyenv_shims_are_probed_silently(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3.13", "python3.12"):
        (bin_dir / name).write_text(PYENV_SHIM)
        (bin_dir / name).chmod(0o755)
    (bin_dir / "python3.11").symlink_to(sys.executable)
    res = bash("find_python", REPO_ROOT, f"{bin_dir}:/usr/bin:/bin")
    assert (res.returncode, res.stdout, res.stderr) == (0, "python3.11\n", "")


def test_python_variable_is_the_only_candidate(tmp_path: Path) -> None:
    res = bash("PYTHON=/nonexistent/python find_python", REPO_ROOT, os.environ["PATH"])
    assert (res.returncode, res.stdout, res.stderr) == (1, "", "")


def test_demo_and_tests_alternate_without_reinstalling(root: Path) -> None:
    path = os.environ["PATH"]
    assert bash('ensure_venv "test,plot"', root, path).returncode == 0
    assert installs(root) == ["ROOT[plot,test]"]
    for extras in ("", "test,plot", "", "test", "plot,test"):  # demo, tests, demo, ...: nothing to do
        res = bash(f'ensure_venv "{extras}"', root, path)
        assert (res.returncode, res.stderr) == (0, "")
    assert installs(root) == ["ROOT[plot,test]"]


def test_more_extras_or_a_new_pyproject_installs_the_union(root: Path) -> None:
    path = os.environ["PATH"]
    bash('ensure_venv ""', root, path)
    bash('ensure_venv "test"', root, path)
    assert installs(root) == ["ROOT", "ROOT[test]"]
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\nversion = '2'\n")
    bash('ensure_venv ""', root, path)  # the demo after a change: the tests' extra stays installed
    bash('ensure_venv "test"', root, path)
    assert installs(root) == ["ROOT", "ROOT[test]", "ROOT[test]"]


def test_a_failed_install_leaves_no_stamp(root: Path) -> None:
    fake = root / ".venv" / "bin" / "python"
    fake.write_text(FAKE_PYTHON + 'case "$*" in *" -e "*) exit 1;; esac\n')
    res = bash('ensure_venv "test"', root, os.environ["PATH"])
    assert res.returncode == 2 and "k3ckpt: install failed" in res.stderr
    assert not (root / ".venv" / ".k3ckpt-installed").exists()
