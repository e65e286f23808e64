"""docs/architecture.md stays true: every module, function and test it names exists, every CLI
command has its row in the command map, every package its place in the code map, and the
README links it (issue #24)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import click
import pytest

from k3ckpt.cli import main
from test_structure import RANK  # the package order the structure test enforces

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
TEXT = DOC.read_text(encoding="utf-8")

DOTTED = re.compile(r"`(k3ckpt(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
TEST_REF = re.compile(r"`(tests/[A-Za-z0-9_]+\.py)(?:::([A-Za-z0-9_]+))?`")
# a command row's "`k3ckpt.pkg.module` (`fn`, `fn`)": the functions that do the work
MODULE_WITH_FUNCTIONS = re.compile(r"`(k3ckpt(?:\.[A-Za-z_][A-Za-z0-9_]*)+)` \(((?:`[A-Za-z_][A-Za-z0-9_]*`(?:, )?)+)\)")


def resolve(dotted: str) -> object:
    """The module, or the attribute of the longest importable prefix, that ``dotted`` names."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("dotted", sorted(set(DOTTED.findall(TEXT))))
def test_every_named_module_exists(dotted: str) -> None:
    try:
        resolve(dotted)
    except (ModuleNotFoundError, AttributeError) as e:
        pytest.fail(f"docs/architecture.md names {dotted}, which does not exist ({e})")


def test_the_names_are_found() -> None:
    # the patterns are not vacuous: the map names dozens of modules and the invariants their tests
    assert len(set(DOTTED.findall(TEXT))) > 60 and len(TEST_REF.findall(TEXT)) > 15


@pytest.mark.parametrize("path, name", sorted(set(TEST_REF.findall(TEXT))))
def test_every_named_test_exists(path: str, name: str) -> None:
    test_file = ROOT / path
    assert test_file.is_file(), f"docs/architecture.md names {path}, which does not exist"
    if name:
        assert re.search(rf"^def {name}\(", test_file.read_text(encoding="utf-8"), re.M), \
            f"docs/architecture.md names {path}::{name}, which is not a test there"


def test_every_function_of_the_command_map_is_in_its_module() -> None:
    found = MODULE_WITH_FUNCTIONS.findall(TEXT)
    assert len(found) >= 10
    for module, functions in found:
        for fn in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", functions):
            assert callable(getattr(resolve(module), fn, None)), f"{module} has no function {fn}"


def test_every_command_has_a_row_in_the_command_map() -> None:
    table = TEXT.split("### Where each command starts", 1)[1].split("\n### ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z-]+)` \| `k3ckpt\.cli\.(_[a-z]+)` \|", table, re.M)}
    ctx = click.Context(main)
    defined = {}
    for name in main.list_commands(ctx):
        command = main.get_command(ctx, name)
        callback = command.callback if command is not None and command.callback is not None else None
        if isinstance(command, click.Group):  # a group (manifest, mx): the module of its commands
            callback = next(iter(command.commands.values())).callback
        assert callback is not None, name
        defined[name] = callback.__module__.rsplit(".", 1)[1]
    assert rows == defined, "the command map must list each command with the CLI module that defines it"


def test_every_package_is_in_the_code_map() -> None:
    named = {d.split(".")[1] for d in DOTTED.findall(TEXT)}
    assert {p for p in RANK if p} <= named


def test_the_readme_links_it() -> None:
    assert "docs/architecture.md" in (ROOT / "README.md").read_text(encoding="utf-8")
