"""What an engine needs beside the weights before it can load a checkpoint directory: a readable
``config.json``, the tokenizer files, and the licence. One rule, used by ``preflight`` (each
finding is a FAIL row) and ``reshard`` (a finding in the source is a refusal before anything is
written), so that "ready to load" and "resharded" mean the same thing.

The rule, from what vLLM / transformers read for the Kimi family (K3 and K2 ship a tiktoken
tokenizer as remote code: ``tokenizer_config.json`` whose ``auto_map`` names
``tokenization_kimi.TikTokenTokenizer``, the module ``tokenization_kimi.py`` and its vocabulary
``tiktoken.model``; gpt-oss ships ``tokenizer.json``):

- ``config.json`` exists and parses as a config (:func:`~k3ckpt.format.config.load_config`); the
  module files its ``auto_map`` names for ``AutoConfig`` exist (``AutoConfig`` with
  ``trust_remote_code`` imports them; the modeling code is not read by an engine with its own
  model class, so ``AutoModel*`` entries are not required);
- ``tokenizer_config.json`` exists and parses as a JSON object; the module files its
  ``auto_map`` names for ``AutoTokenizer`` exist; the vocabulary files exist: those the module's
  ``VOCAB_FILES_NAMES`` literal names (read with :mod:`ast`, never imported), and those named
  by ``*_file`` keys of the config; when nothing names one, at least one of
  :data:`VOCAB_FILES` must be there;
- a licence: one of :data:`LICENSE_NAMES`, or a ``license:`` in the metadata block of
  ``README.md`` (how the hubs record a model's licence on its card).

Every check follows symlinks (a Hugging Face cache snapshot holds symlinks into ``../../blobs``):
a symlink whose blob is missing is reported as such.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, EngineFilesError
from .config import ModelConfig, load_config

CONFIG_NAME = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
README_NAME = "README.md"
#: Accepted names of a licence file (the hubs' and GitHub's conventions).
LICENSE_NAMES = ("LICENSE", "LICENSE.md", "LICENSE.txt", "LICENCE", "LICENCE.md", "LICENCE.txt", "COPYING",
                 "COPYING.md", "COPYING.txt", "license", "license.md", "license.txt")
#: Vocabulary files some tokenizer reads: tokenizers' JSON, sentencepiece, tiktoken, BPE / WordPiece.
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "spiece.model", "vocab.json", "vocab.txt")

#: The kinds of finding, in report order.
KINDS = ("config", "tokenizer", "license")


@dataclass(frozen=True)
class Finding:
    """One thing an engine needs that is missing or unreadable. ``str()`` is the one-line message,
    beginning with the path of the file concerned."""

    kind: str  # config | tokenizer | license
    path: Path  # the file that is missing or bad
    problem: str

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"

    def error(self) -> ConfigError | EngineFilesError:
        """The error a command that cannot go on raises: :class:`ConfigError` for config.json (as
        every command reading it does), :class:`EngineFilesError` for the tokenizer or licence."""
        return (ConfigError if self.kind == "config" else EngineFilesError)(str(self))


def _missing(path: Path) -> str:
    """Why ``path`` is not a readable file: a dangling symlink (an HF cache blob gone) or absent."""
    if path.is_symlink():
        return f"not found (a symlink to {path.readlink()}, which does not exist)"
    if path.exists():
        return "not a regular file"
    return "not found"


def _module_files(root: Path, auto_map: Any, key: str) -> list[Path]:
    """The local ``.py`` files ``auto_map[key]`` names (``"module.Class"`` or ``[slow, fast]``);
    ``"org/repo--module.Class"`` lives in another repository and is not required here."""
    if not isinstance(auto_map, dict):
        return []
    value = auto_map.get(key)
    refs = value if isinstance(value, list) else [value]
    out = []
    for ref in refs:
        if isinstance(ref, str) and "--" not in ref and "." in ref:
            module = ref.rsplit(".", 1)[0]
            out.append(root / (module.replace(".", "/") + ".py"))
    return list(dict.fromkeys(out))


def config_findings(root: Path) -> tuple[ModelConfig | None, list[Finding]]:
    """``config.json`` of ``root``: the parsed config (``None`` when it cannot be read) and what is
    wrong with it. The message is :class:`ConfigError`'s, so every command words it alike."""
    path = root / CONFIG_NAME
    if not path.is_file():
        return None, [Finding("config", path, _missing(path))]
    try:
        cfg = load_config(path)
    except ConfigError as e:
        text = str(e)
        problem = text[len(f"{path}: "):] if text.startswith(f"{path}: ") else text
        return None, [Finding("config", path, problem)]
    found = [Finding("config", f, f"{_missing(f)} ({CONFIG_NAME} auto_map names it for AutoConfig)")
             for f in _module_files(root, cfg.raw.get("auto_map"), "AutoConfig") if not f.is_file()]
    return cfg, found


def _vocab_names(module: Path) -> list[str]:
    """The file names a tokenizer module's ``VOCAB_FILES_NAMES = {...}`` literal lists."""
    try:
        tree = ast.parse(module.read_text(errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return []
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, expr = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, expr = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "VOCAB_FILES_NAMES" for t in targets):
            try:
                value = ast.literal_eval(expr)
            except ValueError:
                return []
            if isinstance(value, dict):
                return [v for v in value.values() if isinstance(v, str)]
    return []


def tokenizer_files(root: Path) -> tuple[list[Path], list[Finding]]:
    """The tokenizer an engine loads from ``root`` (see the module docstring): the files it reads
    that are present, and what is missing or unreadable."""
    path = root / TOKENIZER_CONFIG
    if not path.is_file():
        return [], [Finding("tokenizer", path, _missing(path) + " (the engine loads the tokenizer from it)")]
    try:
        tc = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return [], [Finding("tokenizer", path, f"not valid JSON ({e})")]
    if not isinstance(tc, dict):
        return [], [Finding("tokenizer", path, "not a JSON object")]
    present, found = [path], []
    named: list[str] = []
    for module in _module_files(root, tc.get("auto_map"), "AutoTokenizer"):
        if not module.is_file():
            found.append(Finding("tokenizer", module, f"{_missing(module)} ({TOKENIZER_CONFIG} auto_map names it "
                                                      f"for AutoTokenizer)"))
        else:
            present.append(module)
            named += _vocab_names(module)
    named += [v for k, v in tc.items() if k.endswith("_file") and isinstance(v, str) and v and "/" not in v]
    for name in dict.fromkeys(named):
        f = root / name
        if f.is_file():
            present.append(f)
        else:
            found.append(Finding("tokenizer", f, f"{_missing(f)} (the tokenizer's vocabulary file)"))
    if not named:
        vocab = [root / n for n in VOCAB_FILES if (root / n).is_file()]
        present += vocab
        if not vocab:
            found.append(Finding("tokenizer", path, f"names no vocabulary file and none is present "
                                                    f"({', '.join(VOCAB_FILES)}): no tokenizer can be built"))
    return present, found


def tokenizer_findings(root: Path) -> list[Finding]:
    """What is missing of the tokenizer an engine loads from ``root``."""
    return tokenizer_files(root)[1]


def license_source(root: Path) -> Path | None:
    """The licence file of ``root``, else its ``README.md`` when the card's metadata declares a
    ``license:``, else ``None``."""
    lic = next((root / n for n in LICENSE_NAMES if (root / n).is_file()), None)
    if lic is not None:
        return lic
    readme = root / README_NAME
    return readme if readme_license(readme) else None


def readme_license(readme: Path) -> str | None:
    """The ``license:`` of a model card's metadata block (``---`` ... ``---`` at the top)."""
    try:
        text = readme.read_text(errors="replace")[:20000]
    except OSError:
        return None
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    for line in lines[1:]:
        if line.strip() == "---":
            return None
        if line.startswith("license:") and line.split(":", 1)[1].strip():
            return line.split(":", 1)[1].strip().strip("'\"")
    return None


def license_findings(root: Path) -> list[Finding]:
    if license_source(root) is not None:
        return []
    dangling = [root / n for n in LICENSE_NAMES if (root / n).is_symlink()]
    if dangling:
        return [Finding("license", dangling[0], _missing(dangling[0]))]
    return [Finding("license", root / LICENSE_NAMES[0],
                    f"not found (nor {', '.join(LICENSE_NAMES[1:4])}..., nor a license: in {README_NAME}'s "
                    f"metadata): the weights must travel with their licence")]


def loadable_findings(root: Path) -> tuple[ModelConfig | None, list[Finding]]:
    """The config of ``root`` (``None`` when unreadable) and every finding of the rule, config
    first, then tokenizer, then licence."""
    cfg, found = config_findings(root)
    return cfg, [*found, *tokenizer_findings(root), *license_findings(root)]


def require_config(root: Path) -> ModelConfig:
    """The config of ``root``.

    Raises:
        ConfigError: ``config.json`` missing or invalid, or a module its ``auto_map`` names
            for ``AutoConfig`` missing (naming the file).
    """
    cfg, found = config_findings(root)
    if found:
        raise found[0].error()
    assert cfg is not None  # no finding means it parsed
    return cfg


def require_loadable(root: Path) -> ModelConfig:

    """The config of ``root``, when an engine could load the directory's non-weight files.

    Raises:
        ConfigError: ``config.json`` missing or invalid (naming it).
        EngineFilesError: a tokenizer file or the licence is missing (naming the file).
    """
    cfg, found = loadable_findings(root)
    if found:
        raise found[0].error()
    assert cfg is not None  # no config finding means it parsed
    return cfg
