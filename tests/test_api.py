"""The public API: what ``k3ckpt`` and its packages export, that it is documented, and that the
documentation's examples run.

The top-level ``__all__`` is pinned here on purpose (as httpx does): adding or removing a public
name is a decision, and this test is where it is made visible.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import k3ckpt

ROOT = Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "api.md"
PACKAGES = ["k3ckpt", "k3ckpt.format", "k3ckpt.integrity", "k3ckpt.hub", "k3ckpt.mx", "k3ckpt.deploy",
            "k3ckpt.testing", "k3ckpt.utils"]

TOP_LEVEL = [
    "Checkpoint",
    "K3ckptError",
    "Manifest",
    "RankSelection",
    "__version__",
    "build_manifest",
    "dequantize_mxfp4",
    "dequantize_to_file",
    "diff_manifests",
    "generate_key",
    "inspect_checkpoint",
    "inspect_mx",
    "list_repo",
    "load_signed_manifest",
    "open_checkpoint",
    "plan_fetch",
    "plan_rank_fetch",
    "plan_reshard",
    "plan_topology",
    "plan_unshard",
    "preflight",
    "pull_manifest",
    "quantization_error",
    "quantize_file",
    "quantize_mxfp4",
    "render_preflight",
    "reshard",
    "run_fetch",
    "run_rank_fetch",
    "run_reshard",
    "run_unshard",
    "sign_file",
    "spec_from_preset",
    "synthesize",
    "unshard",
    "verify_checkpoint",
]


def test_exported_members() -> None:
    assert sorted(k3ckpt.__all__) == TOP_LEVEL
    assert len(set(k3ckpt.__all__)) == len(k3ckpt.__all__)


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_resolves(package: str) -> None:
    mod = importlib.import_module(package)
    assert mod.__doc__ and mod.__doc__.strip(), f"{package} has no docstring"
    missing = [name for name in mod.__all__ if not hasattr(mod, name)]
    assert not missing, f"{package}.__all__ names what it does not have: {missing}"
    assert not [n for n in mod.__all__ if n.startswith("_") and not n.startswith("__")]


def test_top_level_names_are_the_same_objects_as_in_their_packages() -> None:
    for name in k3ckpt.__all__:
        if name == "__version__":
            continue
        obj = getattr(k3ckpt, name)
        home = importlib.import_module(obj.__module__)
        assert getattr(home, name) is obj, name


def test_the_type_checking_imports_match_the_lazy_names() -> None:
    """Type checkers see ``k3ckpt/__init__.py``'s ``if TYPE_CHECKING:`` imports; at run time the
    names load lazily. Both must give the same objects from the same modules."""
    tree = ast.parse((ROOT / "k3ckpt" / "__init__.py").read_text(encoding="utf-8"))
    block = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.dump(node)
        for alias in node.names:
            seen[alias.asname or alias.name] = f"k3ckpt.{node.module}"
    assert sorted(seen) == sorted(set(k3ckpt.__all__) - {"__version__"})
    for name, module in seen.items():
        assert getattr(importlib.import_module(module), name) is getattr(k3ckpt, name), name


def test_dir_lists_the_public_api() -> None:
    assert set(k3ckpt.__all__) <= set(dir(k3ckpt))
    with pytest.raises(AttributeError, match="no_such_name"):
        k3ckpt.no_such_name  # noqa: B018


def _documented_names() -> set[str]:
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", API_DOC.read_text(encoding="utf-8")))


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_is_documented(package: str) -> None:
    doc = _documented_names()
    text = API_DOC.read_text(encoding="utf-8")
    assert f"`{package}`" in text, f"docs/api.md has no section for {package}"
    undocumented = sorted(set(importlib.import_module(package).__all__) - doc)
    assert not undocumented, f"docs/api.md does not mention {package}: {undocumented}"


HEAVY = {"huggingface_hub", "modelscope_hub", "modelscope", "numpy", "ml_dtypes", "cryptography", "httpx", "requests",
         "tqdm", "matplotlib", "safetensors"}


def _modules_after(code: str) -> set[str]:
    code += "; import json, sys; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout
    return set(json.loads(out))


def test_importing_k3ckpt_is_light() -> None:
    """``import k3ckpt`` loads none of its subpackages and no third-party library."""
    loaded = _modules_after("import k3ckpt")
    assert not HEAVY & loaded, sorted(HEAVY & loaded)
    assert not {m for m in loaded if m.startswith("k3ckpt.")}, sorted(m for m in loaded if m.startswith("k3ckpt."))


#: What a command that contacts a hub imports, and only such a command.
HTTP_CLIENTS = {"requests", "urllib3", "huggingface_hub"}


@pytest.mark.parametrize("module", ["k3ckpt.deploy.preflight", "k3ckpt.deploy.plan", "k3ckpt.deploy.reshard",
                                    "k3ckpt.integrity.verify"])
def test_commands_that_never_contact_a_hub_do_not_import_an_http_client(module: str) -> None:
    """``preflight``, ``plan``, ``reshard`` and ``verify`` work on local files: ``requests`` and
    ``urllib3`` (tens of milliseconds of start-up, issue #28's fixed cost) are not theirs to load."""
    loaded = _modules_after(f"import {module}")
    assert not HTTP_CLIENTS & loaded, sorted(HTTP_CLIENTS & loaded)


def test_the_cli_starts_without_the_heavy_libraries() -> None:
    """``k3ckpt --help`` pays for click, not for the hub clients or numpy."""
    loaded = _modules_after("import k3ckpt.cli")
    assert not HEAVY & loaded, sorted(HEAVY & loaded)


_COMMAND_MODULES = """
import json, sys
from k3ckpt.cli import main
import click
loaded = sorted(sys.modules)
FIRST
loaded_first = sorted(sys.modules)
ctx = click.Context(main)
homes = {name: main.get_command(ctx, name).callback.__module__ for name in main.list_commands(ctx)}
print(json.dumps([loaded, loaded_first, homes]))
"""


def _command_modules(first: str = "") -> tuple[set[str], set[str], dict[str, str]]:
    """Modules loaded by ``import k3ckpt.cli``, then after running ``first``, and the module
    each command is defined in (read last: that loads them all)."""
    out = subprocess.run([sys.executable, "-c", _COMMAND_MODULES.replace("FIRST", first)], capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout
    loaded, loaded_first, homes = json.loads(out)
    return set(loaded), set(loaded_first), homes


def test_the_root_command_loads_no_command_module() -> None:
    """``k3ckpt --version`` (and any command's start) imports the root group only: each command's
    module, and the library behind it, is imported when that command is looked up."""
    loaded, _, homes = _command_modules()
    assert not set(homes.values()) & loaded, sorted(set(homes.values()) & loaded)
    assert not HEAVY & loaded, sorted(HEAVY & loaded)
    ours = {m for m in loaded if m.startswith("k3ckpt.")}
    assert not {m for m in ours if m.split(".")[1] not in ("cli", "errors", "utils")}, sorted(ours)
    assert "multiprocessing" not in loaded and "concurrent.futures.process" not in loaded


def test_verify_loads_only_what_it_uses() -> None:
    """The verify command's path (its CLI module and the library it calls) leaves out the other
    commands' modules, the topology math, the hubs, the deploy and MXFP4 packages,
    multiprocessing (a small checkpoint's headers are read in-process) and statistics:
    start-up is most of verify's fixed cost."""
    _, loaded, homes = _command_modules("main.get_command(click.Context(main), 'verify'); import k3ckpt.integrity.verify, "
                                        "k3ckpt.integrity.share, k3ckpt.format.inspect")
    assert {homes["verify"], "k3ckpt.integrity.verify", "k3ckpt.format.checkpoint"} <= loaded
    others = {m for name, m in homes.items() if m != homes["verify"]}
    assert others and not others & loaded, sorted(others & loaded)
    unwanted = {"k3ckpt.format.topology", "k3ckpt.format.nodedir", "k3ckpt.integrity.signing", "multiprocessing",
                "concurrent.futures.process", "statistics", "socket"}
    assert not unwanted & loaded, sorted(unwanted & loaded)
    assert not {m for m in loaded if m.split(".")[:2] in (["k3ckpt", "hub"], ["k3ckpt", "deploy"], ["k3ckpt", "mx"])}
    assert not HEAVY & loaded, sorted(HEAVY & loaded)


def test_lazy_package_namespaces_give_the_same_objects() -> None:
    """``k3ckpt.format``, ``k3ckpt.integrity`` and ``k3ckpt.hub`` load their names on first use:
    each exported name is the object its module defines, and ``dir()`` lists it."""
    for package in ("k3ckpt.format", "k3ckpt.integrity", "k3ckpt.hub"):
        mod = importlib.import_module(package)
        assert set(mod.__all__) <= set(dir(mod))
        for name in mod.__all__:
            value = getattr(mod, name)
            assert getattr(importlib.import_module(value.__module__), name) is value, (package, name)
        with pytest.raises(AttributeError, match="no_such_name"):
            mod.no_such_name  # noqa: B018


def test_first_use_loads_only_what_is_needed() -> None:
    loaded = _modules_after("import k3ckpt; k3ckpt.open_checkpoint")
    assert "k3ckpt.format.checkpoint" in loaded and not {"numpy", "huggingface_hub"} & loaded


def test_py_typed_is_shipped() -> None:
    assert (ROOT / "k3ckpt" / "py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()


# ----------------------------------------------------------------------------------------------
# the examples of docs/api.md run
# ----------------------------------------------------------------------------------------------


def test_the_module_docstring_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = k3ckpt.__doc__ or ""
    lines = []
    for line in doc[doc.index("::\n") + 3:].splitlines():
        if line.strip() and not line.startswith("    "):
            break
        lines.append(line[4:])
    assert 8 <= len([line for line in lines if line.strip()]) <= 12
    monkeypatch.chdir(tmp_path)
    exec(compile("\n".join(lines), "k3ckpt.__doc__", "exec"), {})


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(line, code)`` of every fenced ```python block."""
    return [(text.count("\n", 0, m.start()) + 2, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)]


def test_every_function_has_an_example() -> None:
    code = "\n".join(block for _, block in python_blocks(API_DOC.read_text(encoding="utf-8")))
    missing = []
    for package in PACKAGES:
        mod = importlib.import_module(package)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if callable(obj) and not isinstance(obj, type) and not re.search(rf"\b{name}\(", code):
                missing.append(f"{package}.{name}")
    assert not missing, f"no example calls {missing}"


@pytest.mark.usefixtures("isolated_hub_clients")
def test_the_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    namespace: dict[str, object] = {"__name__": "api_doc"}
    try:
        for line, block in python_blocks(API_DOC.read_text(encoding="utf-8")):
            try:
                exec(compile(block, f"docs/api.md:{line}", "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"the example at docs/api.md:{line} failed: {e!r}") from e
    finally:
        from k3ckpt.testing import LoopbackHub

        for value in namespace.values():
            if isinstance(value, LoopbackHub) and value.running:
                value.stop()
