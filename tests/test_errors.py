"""The error hierarchy: every exception a user can see is a ``K3ckptError`` defined in
``k3ckpt/errors.py``, named ``...Error``, with its exit code; the module docstring draws all of it.

Found by walking the package, so a class added anywhere else fails here."""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
import re

import pytest

import k3ckpt
from k3ckpt import errors
from k3ckpt.errors import EXIT_CANNOT_RUN, EXIT_PROBLEMS, K3ckptError

#: Exceptions that never reach a user: the crash harness's failed invariant is an AssertionError
#: for pytest (a bug report about k3ckpt itself), not an error a command reports.
NOT_USER_VISIBLE = {"k3ckpt.testing.crash.InvariantViolation"}

#: Exit codes other than "could not run" (2). Pinned: changing one changes the CLI's contract.
EXIT_CODES = {"SignatureError": EXIT_PROBLEMS, "HubDigestMismatchError": EXIT_PROBLEMS,
              "TensorDigestError": EXIT_PROBLEMS}


def _package_exceptions() -> dict[str, type[BaseException]]:
    """``module.qualname`` -> class, for every exception class a k3ckpt module defines."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(k3ckpt.__path__, "k3ckpt."):
        if info.name.endswith("__main__"):  # importing it runs the CLI
            continue
        module = importlib.import_module(info.name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("k3ckpt"):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def _is_private(cls: type) -> bool:
    """A private class, or any class of a private module (``k3ckpt.hub._transfer.Cancelled``: a
    worker's control signal, never raised to a caller)."""
    return any(part.startswith("_") and not part.startswith("__") for part in (*cls.__module__.split("."), cls.__name__))


def _user_visible() -> dict[str, type[BaseException]]:
    return {k: c for k, c in _package_exceptions().items() if not _is_private(c) and k not in NOT_USER_VISIBLE}


def test_every_user_visible_exception_lives_in_errors_and_derives_from_the_base() -> None:
    visible = _user_visible()
    assert len(visible) > 30  # the walk found the package's errors, not nothing
    elsewhere = sorted(k for k, c in visible.items() if c.__module__ != "k3ckpt.errors")
    assert elsewhere == [], "define user-visible errors in k3ckpt/errors.py"
    outside = sorted(k for k, c in visible.items() if not issubclass(c, K3ckptError))
    assert outside == [], "user-visible errors derive from K3ckptError"


def test_names_exit_codes_and_exports() -> None:
    classes = {c.__name__: c for c in _user_visible().values()}
    assert sorted(n for n in classes if n != "K3ckptError" and not n.endswith("Error")) == []
    for name, cls in classes.items():
        assert cls.exit_code == EXIT_CODES.get(name, EXIT_CANNOT_RUN), name
    exported = {n for n in errors.__all__ if not n.startswith("EXIT_")}
    assert exported == set(classes)


def test_the_docstring_draws_every_class_under_its_parent() -> None:
    doc = errors.__doc__ or ""
    drawn = re.findall(r"^    ([│ ]*)(?:[├└]── )?(\w+Error)\b", doc, re.M)
    assert {name for _, name in drawn} == {n for n in errors.__all__ if not n.startswith("EXIT_")}
    # Each class sits under the nearest less-indented class above it: its direct base.
    stack: list[tuple[int, str]] = []
    for indent, name in drawn:
        depth = len(indent) // 4 + (name != "K3ckptError")
        while stack and stack[-1][0] >= depth:
            stack.pop()
        cls = getattr(errors, name)
        if stack:
            assert cls.__bases__[0].__name__ == stack[-1][1], name
        stack.append((depth, name))


def test_hash_error_is_still_an_os_error() -> None:
    # Code around hashing catches OSError and reads strerror/filename; joining the hierarchy
    # must not change that, nor how the error prints.
    e = errors.HashError(0, "read 3 bytes but the file is 9", "/x")
    assert isinstance(e, OSError) and isinstance(e, K3ckptError)
    assert (e.strerror, e.filename) == ("read 3 bytes but the file is 9", "/x")
    assert str(e) == str(OSError(0, "read 3 bytes but the file is 9", "/x"))


@pytest.mark.parametrize("make", [
    lambda: errors.EnvError("K3CKPT_HASH_BUFFER", "16Q", "is not a byte count"),
    lambda: errors.SafetensorsHeaderError("a.safetensors", "bad", tensor="t"),
    lambda: errors.SplitError("t", "odd"),
    lambda: errors.RangeMismatchError("a\nb", hub="hf", repo="o/r", revision="c" * 40, path="x", endpoint="h"),
    lambda: errors.HashError(5, "read failed", "/x"),
])
def test_errors_cross_process_boundaries(make) -> None:
    e = make()
    again = pickle.loads(pickle.dumps(e))
    assert type(again) is type(e) and str(again) == str(e)


def test_every_class_has_a_unique_kind_derived_from_its_name() -> None:
    # the kind is the JSON error object's stable name: a class added later (in any module, by
    # anyone) gets one without doing anything, and no two classes share one
    classes = [c for c in _user_visible().values() if issubclass(c, K3ckptError)]
    kinds = {c.kind: c.__name__ for c in classes}
    assert len(kinds) == len(classes), sorted(c.kind for c in classes)
    for cls in classes:
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", cls.kind), cls.kind
        assert cls.kind == errors.kind_of_name(cls.__name__), cls.__name__
    assert errors.CheckpointNotFoundError.kind == "checkpoint_not_found"
    assert errors.HubShortReadError.kind == "hub_short_read"

    class LaterAddedError(errors.HubError):
        pass

    assert LaterAddedError.kind == "later_added"


def test_the_docs_list_every_kind() -> None:
    from pathlib import Path

    page = (Path(__file__).parent.parent / "docs" / "errors.md").read_text()
    missing = sorted(c.kind for c in _user_visible().values() if f"`{c.kind}`" not in page)
    assert missing == [], "docs/errors.md lists every kind"


@pytest.mark.parametrize("make, path", [
    (lambda: errors.ConfigError("x: bad", path="/a/config.json"), "/a/config.json"),
    (lambda: errors.SafetensorsHeaderError("/a/m.safetensors", "bad", tensor="t"), "/a/m.safetensors"),
    (lambda: errors.HashError(5, "read failed", "/x"), "/x"),
    (lambda: errors.TopologyError("--ep 3 does not divide 8"), None),
])
def test_path_is_known_where_the_error_has_one_and_survives_pickling(make, path) -> None:
    e = make()
    assert e.path == path
    assert pickle.loads(pickle.dumps(e)).path == path
