"""The package's shape, checked from the AST of every module (nothing is imported).

- No private name crosses a package boundary: across packages a module imports only public
  names (``_x`` is private, ``__x__`` is not) from public modules (no ``_x.py`` on the path),
  and reads no ``mod._x`` off another package's module, whatever alias it was imported under.
  Inside one package, private modules and names are shared freely.
- The tests and ``scripts/*.py`` are outside every package: they use public names only, and
  patch none by string (``monkeypatch.setattr("k3ckpt.x._y", ...)``, ``setattr(mod, "_y", ...)``).
- Data flows downward: ``errors`` <- ``utils`` <- ``env`` <- ``faults`` <- ``format`` <-
  ``integrity`` <- ``hub`` <- ``mx`` <- ``deploy`` <- ``engine`` <- ``testing`` <- ``cli``. No package imports
  from one to its right, and the packages' import graph has no cycle.
- No module inside the package imports the lazy top-level ``k3ckpt`` namespace (except
  ``__version__``): that is the facade for users, and importing it from inside invites cycles.
- No circle between modules either: counting every import, those inside functions and under
  ``TYPE_CHECKING`` too (a lazy import that dodges a circle at run time still ties the two
  modules together: neither can be read, changed or tested without the other). A type both
  sides need lives in the module that owns it.
- Rooms sized by responsibility: no module of the package is over :data:`MAX_MODULE_LINES`
  lines, and each opens with a docstring that says what it owns.

"Package" means a direct subpackage of ``k3ckpt`` (``k3ckpt.hub``, ``k3ckpt.utils``, ...) or a
top-level module (``k3ckpt.errors``, ``k3ckpt.env``): each is a unit of its own, so ``utils``
may raise ``errors``' classes while ``env`` parses with ``utils``. The facade ``k3ckpt`` (and
``python -m k3ckpt``) is the top package ``""``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG_DIR = ROOT / "k3ckpt"

# Lower rank = lower layer; a package may import from its own rank or below. The facade ("")
# is imported from only for ``__version__``.
RANK: dict[str, int] = {"": 0, "errors": 0, "utils": 1, "env": 2, "faults": 3, "format": 4, "integrity": 5, "hub": 6,
                        "mx": 7, "deploy": 8, "engine": 9, "testing": 10, "cli": 11}
# The entry points above everything: the lazy facade (its eager imports are under TYPE_CHECKING)
# and ``python -m k3ckpt``.
FACADES = {"k3ckpt", "k3ckpt.__main__"}
OUTSIDE = "<outside>"  # tests and scripts
#: The most lines a module of the package may have (issue #24: a room one can hold in one's head).
MAX_MODULE_LINES = 800


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(module: str, root: Path = ROOT) -> str:
    """``k3ckpt.hub.client`` -> ``hub``; ``k3ckpt.errors`` -> ``errors``; ``k3ckpt`` and
    ``k3ckpt.__main__`` -> ``""``."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] != "__main__":
        return parts[1]
    return ""


def is_module(dotted: str, root: Path = ROOT) -> bool:
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def private_module_part(module: str) -> str | None:
    return next((p for p in module.split(".")[1:] if is_private(p)), None)


@dataclass
class Offence:
    where: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.what}"


@dataclass
class Imports:
    """What one file imports: package edges and offences found on the way."""

    offences: list[Offence] = field(default_factory=list)
    targets: list[tuple[str, int]] = field(default_factory=list)  # k3ckpt modules imported, with line
    # ... and those imported under ``TYPE_CHECKING`` too: a module-level circle counts them
    all_targets: list[tuple[str, int]] = field(default_factory=list)


class Checker(ast.NodeVisitor):
    """Walk one file; ``module`` is its dotted name (``None`` for a file outside the package)."""

    def __init__(self, where: str, module: str | None, is_pkg: bool, root: Path = ROOT) -> None:
        self.where = where
        self.module = module
        self.is_pkg = is_pkg
        self.root = root
        self.package = OUTSIDE if module is None else package_of(module, root)
        self.aliases: dict[str, str] = {}  # local name -> k3ckpt module it is bound to
        self.found = Imports()
        self.type_checking = 0

    # -- helpers ---------------------------------------------------------------------------

    def offence(self, node: ast.AST, what: str) -> None:
        self.found.offences.append(Offence(self.where, getattr(node, "lineno", 0), what))

    def foreign(self, target_module: str) -> bool:
        """Is ``target_module`` across a package boundary from this file?"""
        return self.package == OUTSIDE or package_of(target_module, self.root) != self.package

    def check_module(self, node: ast.AST, target: str) -> None:
        """This file uses the k3ckpt module ``target``."""
        self.found.all_targets.append((target, getattr(node, "lineno", 0)))
        if self.type_checking:
            return
        self.found.targets.append((target, getattr(node, "lineno", 0)))
        if self.foreign(target) and private_module_part(target):
            self.offence(node, f"imports private module {target} of package {package_of(target, self.root)!r}")

    def check_name(self, node: ast.AST, target: str, name: str) -> None:
        """This file uses ``target.name`` where ``name`` is not a module."""
        if is_private(name) and self.foreign(target):
            self.offence(node, f"uses private name {target}.{name}")
        if (self.module is not None and target == "k3ckpt" and self.module not in FACADES
                and name != "__version__" and not self.type_checking):
            self.offence(node, f"imports {name!r} from the top-level k3ckpt namespace (import it from its module)")

    def resolve_from(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        assert self.module is not None, "relative import outside the package"
        base = self.module.split(".")
        if not self.is_pkg:
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def dotted(self, node: ast.AST) -> list[str] | None:
        parts: list[str] = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name):
            parts.append(node.id)
            return parts[::-1]
        return None

    # -- visitors --------------------------------------------------------------------------

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"):
            self.type_checking += 1
            for child in node.body:
                self.visit(child)
            self.type_checking -= 1
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name != "k3ckpt" and not alias.name.startswith("k3ckpt."):
                continue
            self.check_module(node, alias.name)
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:
                self.aliases["k3ckpt"] = "k3ckpt"

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        target = self.resolve_from(node)
        if target != "k3ckpt" and not target.startswith("k3ckpt."):
            return
        self.check_module(node, target)
        for alias in node.names:
            if alias.name == "*":
                self.offence(node, f"star import from {target}")
                continue
            sub = f"{target}.{alias.name}"
            if is_module(sub, self.root):
                self.check_module(node, sub)
                self.aliases[alias.asname or alias.name] = sub
            else:
                self.check_name(node, target, alias.name)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        parts = self.dotted(node)
        if parts and parts[0] in self.aliases:
            mod = self.aliases[parts[0]]
            for p in parts[1:]:
                if is_module(f"{mod}.{p}", self.root):
                    mod = f"{mod}.{p}"
                    self.check_module(node, mod)
                    continue
                self.check_name(node, mod, p)
                break
            return  # the chain is handled as a whole
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        fname = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        args = node.args
        # setattr(mod, "_x", ...), monkeypatch.setattr(mod, "_x", ...), getattr/delattr/hasattr
        if fname in ("setattr", "delattr", "getattr", "hasattr") and len(args) >= 2:
            owner = self.dotted(args[0])
            if owner and owner[0] in self.aliases and isinstance(args[1], ast.Constant) \
                    and isinstance(args[1].value, str):
                mod = self.aliases[owner[0]]
                if all(is_module(f"{mod}.{p}", self.root) for p in owner[1:]):
                    mod = ".".join([mod, *owner[1:]])
                    self.check_name(node, mod, args[1].value)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        # monkeypatch.setattr("k3ckpt.hub.client._x", ...), mock.patch("k3ckpt...._x")
        v = node.value
        if isinstance(v, str) and v.startswith("k3ckpt.") and " " not in v and all(
                p.isidentifier() for p in v.split(".")):
            parts = v.split(".")
            mod = "k3ckpt"
            for p in parts[1:]:
                if is_module(f"{mod}.{p}", self.root):
                    mod = f"{mod}.{p}"
                    if self.foreign(mod) and is_private(p):
                        self.offence(node, f"names private module {mod} in a string")
                    continue
                if is_private(p) and self.foreign(mod):
                    self.offence(node, f"names private {mod}.{p} in a string")
                break


def check_file(path: Path, *, inside: bool, root: Path = ROOT) -> Imports:
    module = module_name(path, root) if inside else None
    c = Checker(str(path.relative_to(root)), module, path.name == "__init__.py", root)
    c.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return c.found


def package_files() -> list[Path]:
    return sorted(PKG_DIR.rglob("*.py"))


def outside_files() -> list[Path]:
    return sorted((ROOT / "tests").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))


def report(offences: list[Offence]) -> str:
    return "\n".join(map(str, offences))


# ----------------------------------------------------------------------------------------------
# the package
# ----------------------------------------------------------------------------------------------


def test_no_private_name_crosses_a_package_boundary() -> None:
    offences = [o for p in package_files() for o in check_file(p, inside=True).offences]
    assert not offences, "private names across package boundaries:\n" + report(offences)


def test_tests_and_scripts_use_only_public_names() -> None:
    offences = [o for p in outside_files() for o in check_file(p, inside=False).offences]
    assert not offences, "tests/scripts using private k3ckpt names:\n" + report(offences)


def package_edges(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> where, for every import between two packages."""
    edges: dict[tuple[str, str], list[str]] = {}
    for p in sorted((root / "k3ckpt").rglob("*.py")):
        module = module_name(p, root)
        if module in FACADES:
            continue
        for target, line in check_file(p, inside=True, root=root).targets:
            a, b = package_of(module, root), package_of(target, root)
            if a != b:
                edges.setdefault((a, b), []).append(f"{p.relative_to(root)}:{line} ({target})")
    return edges


def upward_imports(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    return [f"{a or 'k3ckpt'} -> {b or 'k3ckpt'}: {w}" for (a, b), where in sorted(edges.items())
            if RANK[b] > RANK[a] for w in where]


def package_cycles(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    cycles: set[tuple[str, ...]] = set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt):]
                i = cycle.index(min(cycle))
                cycles.add(tuple(cycle[i:] + cycle[:i]))
            else:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return [" -> ".join(p or "k3ckpt" for p in (*c, c[0])) for c in sorted(cycles)]


def test_every_package_has_a_place_in_the_order() -> None:
    packages = {package_of(module_name(p)) for p in package_files()}
    assert packages <= set(RANK), f"add {sorted(packages - set(RANK))} to RANK (and to the docstring's order)"


def test_no_upward_imports() -> None:
    upward = upward_imports(package_edges())
    assert not upward, "imports against the dependency order:\n" + "\n".join(upward)


def test_no_import_cycles_between_packages() -> None:
    cycles = package_cycles(package_edges())
    assert not cycles, "package import cycles: " + "; ".join(cycles)


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the k3ckpt modules it imports, at any depth of the file (in functions, under
    ``TYPE_CHECKING``). A module's own ancestor packages are left out: Python imports them
    before the module anyway, so ``from . import sibling`` ties a module to its sibling only."""
    graph: dict[str, set[str]] = {}
    for p in sorted((root / "k3ckpt").rglob("*.py")):
        module = module_name(p, root)
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        graph[module] = {t for t, _ in check_file(p, inside=True, root=root).all_targets
                         if t != module and t not in ancestors}
    return graph


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative:
    each is a set of modules that import each other, directly or around a circle), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def test_no_import_cycles_between_modules() -> None:
    cycles = module_cycles(module_graph())
    assert not cycles, "modules that import each other (move what both need to its owner):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def oversized_modules(root: Path = ROOT) -> list[str]:
    sizes = {p: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted((root / "k3ckpt").rglob("*.py"))}
    return [f"{p.relative_to(root)}: {n} lines" for p, n in sizes.items() if n > MAX_MODULE_LINES]


def test_no_module_is_over_the_size_limit() -> None:
    over = oversized_modules()
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split by responsibility):\n" + "\n".join(over)


def test_every_module_says_what_it_owns() -> None:
    silent = [str(p.relative_to(ROOT)) for p in package_files()
              if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert not silent, "modules without a docstring saying what they own: " + ", ".join(silent)


def private_parameters(root: Path = ROOT) -> list[str]:
    """Public functions and methods (module level or in a class) of the package that take a
    parameter named ``_x``: a test hook in a library signature (issue #24: ``run_reshard(...,
    _fail_before=)``). Tests reach into a run through :mod:`k3ckpt.faults` instead."""
    found = []
    for p in sorted((root / "k3ckpt").rglob("*.py")):
        tree = ast.parse(p.read_text(encoding="utf-8"))
        scopes = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
        for body in scopes:
            for fn in body:
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and not is_private(fn.name):
                    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
                    found += [f"{p.relative_to(root)}:{fn.lineno}: {fn.name}({a.arg}=...)" for a in args
                              if is_private(a.arg)]
    return found


def test_no_test_hook_in_a_library_signature() -> None:
    hooks = private_parameters()
    assert not hooks, "private parameters of public functions (use k3ckpt.faults):\n" + "\n".join(hooks)


# ----------------------------------------------------------------------------------------------
# the checker itself catches what it should
# ----------------------------------------------------------------------------------------------


def _offences_in(tmp_path: Path, files: dict[str, str], check: str, *, inside: bool = True) -> list[str]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return [o.what for o in check_file(tmp_path / check, inside=inside, root=tmp_path).offences]


FAKE = {
    "k3ckpt/__init__.py": "__version__ = '0'\n",
    "k3ckpt/errors.py": "",
    "k3ckpt/hub/__init__.py": "",
    "k3ckpt/hub/_http.py": "def get(): pass\n",
    "k3ckpt/hub/client.py": "def _retry(): pass\ndef list_repo(): pass\n",
    "k3ckpt/deploy/__init__.py": "",
}


@pytest.mark.parametrize("source, expected", [
    ("from ..hub.client import _retry\n", "uses private name k3ckpt.hub.client._retry"),
    ("from k3ckpt.hub.client import _retry as r\n", "uses private name k3ckpt.hub.client._retry"),
    ("from ..hub import _http\n", "imports private module k3ckpt.hub._http of package 'hub'"),
    ("import k3ckpt.hub._http as h\n", "imports private module k3ckpt.hub._http of package 'hub'"),
    ("from ..hub import client as c\nc._retry()\n", "uses private name k3ckpt.hub.client._retry"),
    ("import k3ckpt.hub.client\nk3ckpt.hub.client._retry()\n", "uses private name k3ckpt.hub.client._retry"),
    ("from .. import hub\nhub.client._retry()\n", "uses private name k3ckpt.hub.client._retry"),
    ("from ..hub import client\nsetattr(client, '_retry', None)\n", "uses private name k3ckpt.hub.client._retry"),
    ("x = 'k3ckpt.hub.client._retry'\n", "names private k3ckpt.hub.client._retry in a string"),
    ("from .. import list_repo\n",
     "imports 'list_repo' from the top-level k3ckpt namespace (import it from its module)"),
])
def test_the_checker_finds_offences(tmp_path: Path, source: str, expected: str) -> None:
    found = _offences_in(tmp_path, {**FAKE, "k3ckpt/deploy/run.py": source}, "k3ckpt/deploy/run.py")
    assert expected in found, found


@pytest.mark.parametrize("source", [
    "from ..hub.client import list_repo\nfrom .. import __version__\n",
    "from ..hub import client\nclient.list_repo()\nclient.__name__\n",
    "import k3ckpt.hub.client as c\nc.list_repo()\n",
])
def test_the_checker_allows_public_use(tmp_path: Path, source: str) -> None:
    assert _offences_in(tmp_path, {**FAKE, "k3ckpt/deploy/run.py": source}, "k3ckpt/deploy/run.py") == []


def test_inside_one_package_private_names_are_shared(tmp_path: Path) -> None:
    source = "from ._http import get\nfrom .client import _retry\nfrom . import _http\n_http.get()\n"
    assert _offences_in(tmp_path, {**FAKE, "k3ckpt/hub/fetch.py": source}, "k3ckpt/hub/fetch.py") == []


def test_outside_the_package_nothing_private_is_shared(tmp_path: Path) -> None:
    source = ("from k3ckpt.hub import client\n"
              "def test(monkeypatch):\n"
              "    monkeypatch.setattr(client, '_retry', None)\n"
              "    monkeypatch.setattr('k3ckpt.hub.client._retry', None)\n")
    found = _offences_in(tmp_path, {**FAKE, "tests/test_x.py": source}, "tests/test_x.py", inside=False)
    assert found == ["uses private name k3ckpt.hub.client._retry", "names private k3ckpt.hub.client._retry in a string"]


def test_the_checker_finds_upward_imports_and_cycles(tmp_path: Path) -> None:
    files = {**FAKE, "k3ckpt/format/__init__.py": "", "k3ckpt/format/header.py": "from ..hub.client import list_repo\n",
             "k3ckpt/hub/fetch.py": "from ..format.header import x\n"}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    edges = package_edges(tmp_path)
    assert upward_imports(edges) == ["format -> hub: k3ckpt/format/header.py:1 (k3ckpt.hub.client)"]
    assert package_cycles(edges) == ["format -> hub -> format"]


def test_the_checker_finds_module_cycles_and_oversized_modules(tmp_path: Path) -> None:
    files = {**FAKE,
             "k3ckpt/hub/fetch.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .plan import P\n",
             "k3ckpt/hub/plan.py": "def f():\n    from .fetch import run\n",
             "k3ckpt/hub/pull.py": "from . import plan\n",  # one way only, and the parent is no edge
             "k3ckpt/hub/big.py": "x = 1\n" * (MAX_MODULE_LINES + 1)}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert module_cycles(module_graph(tmp_path)) == [["k3ckpt.hub.fetch", "k3ckpt.hub.plan"]]
    assert oversized_modules(tmp_path) == [f"k3ckpt/hub/big.py: {MAX_MODULE_LINES + 1} lines"]


def test_the_checker_finds_a_test_hook_in_a_signature(tmp_path: Path) -> None:
    files = {**FAKE, "k3ckpt/hub/run.py": ("def run(plan, *, _fail_before=None):\n    def inner(_n):\n        pass\n"
                                         "class R:\n    def go(self, _x=1):\n        pass\n"
                                         "def _private(_y):\n    pass\n")}
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert private_parameters(tmp_path) == ["k3ckpt/hub/run.py:1: run(_fail_before=...)",
                                            "k3ckpt/hub/run.py:5: go(_x=...)"]
