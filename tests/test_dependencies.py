"""pyproject.toml declares exactly the distributions the package imports, and constraints/minimum.txt
pins exactly their floors (the minimum-versions job, scripts/test_min_versions.sh, installs those)."""

from __future__ import annotations

import ast
import re
import sys
from functools import cache
from importlib.metadata import packages_distributions, requires
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG_DIR = ROOT / "k3ckpt"
CONSTRAINTS = ROOT / "constraints" / "minimum.txt"
_REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)(?:;(.*))?")


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it (``ML-Dtypes`` == ``ml_dtypes``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirement(text: str) -> tuple[str, str, str]:
    """``"numpy>=1.23.3; extra == 'test'"`` -> ``("numpy", ">=1.23.3", "extra == 'test'")``."""
    m = _REQUIREMENT.fullmatch(text)
    assert m, f"cannot read the requirement {text!r}"
    return normalize(m[1]), m[2].strip(), (m[3] or "").strip()


@cache
def declared() -> tuple[dict[str, str], dict[str, set[str]]]:
    """(runtime distribution -> version spec, extra -> its distributions), from pyproject.toml."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: the installed metadata (scripts/venv.sh reinstalls on any change)
        runtime, extras = {}, {}
        for text in requires("k3ckpt") or []:
            name, spec, marker = parse_requirement(text)
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", marker)
            if extra:
                extras.setdefault(extra[1], set()).add(name)
            else:
                runtime[name] = spec
        return runtime, extras
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = dict(parse_requirement(t)[:2] for t in project["dependencies"])
    extras = {k: {parse_requirement(t)[0] for t in v} for k, v in project["optional-dependencies"].items()}
    return runtime, extras


@cache
def third_party_imports() -> dict[str, list[str]]:
    """Top-level module -> "file:line" of every absolute import outside the standard library and
    k3ckpt, lazy ones (inside functions) included."""
    found: dict[str, list[str]] = {}
    for path in sorted(PKG_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.partition(".")[0] for n in names}:
                if top not in sys.stdlib_module_names and top not in ("k3ckpt", "__future__"):
                    found.setdefault(top, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


@cache
def installed_modules() -> dict[str, list[str]]:
    return packages_distributions()  # scans every installed distribution: once


def distributions_of(module: str) -> set[str]:
    """The distributions providing a top-level module: from what is installed, else (an optional
    dependency not installed here) the module's own name."""
    return {normalize(d) for d in installed_modules().get(module, [module])}


def test_every_third_party_import_is_a_declared_distribution() -> None:
    runtime, extras = declared()
    optional = set().union(*(dists for extra, dists in extras.items() if extra != "test"))
    undeclared = [f"{mod} ({', '.join(sorted(distributions_of(mod)))}) imported at {where[0]}"
                  for mod, where in sorted(third_party_imports().items())
                  if not distributions_of(mod) & (set(runtime) | optional)]
    assert not undeclared, "imported but not declared in pyproject.toml:\n" + "\n".join(undeclared)


def test_every_declared_runtime_distribution_is_imported() -> None:
    runtime, _ = declared()
    imported = set().union(*(distributions_of(m) for m in third_party_imports()))
    unused = sorted(set(runtime) - imported)
    assert not unused, f"declared in pyproject.toml's dependencies but never imported by k3ckpt: {unused}"


def test_module_level_imports_need_no_extra() -> None:
    # An import at the top of a module runs on `import k3ckpt.x`: only a runtime dependency may
    # sit there; an extra's package (matplotlib) is imported inside the function that needs it.
    runtime, _ = declared()
    offending = []
    for path in sorted(PKG_DIR.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for mod in mods:
                top = mod.partition(".")[0]
                if top in third_party_imports() and not distributions_of(top) & set(runtime):
                    offending.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {mod}")
    assert not offending, "module-level imports of optional packages:\n" + "\n".join(offending)


def _version(text: str) -> tuple[int, ...]:
    parts = [int(p) for p in text.split(".")]
    while parts and parts[-1] == 0:  # 1.0 == 1.0.0
        parts.pop()
    return tuple(parts)


def test_minimum_constraints_pin_exactly_the_declared_floors() -> None:
    runtime, _ = declared()
    floors = {}
    for name, spec in runtime.items():
        m = re.fullmatch(r">=\s*([0-9.]+)", spec)
        assert m, f"{name}: declare a plain floor '>=X' (got {spec!r}) so the minimum-versions job can pin it"
        floors[name] = _version(m[1])
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalize(name)] = _version(version)
    assert pins == floors, f"{CONSTRAINTS.relative_to(ROOT)} must pin each declared floor: {pins} != {floors}"
