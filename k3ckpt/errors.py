"""Every error a k3ckpt user can see, in one place (cf. ``huggingface_hub.errors``).

Each one is a :class:`K3ckptError`, so a caller can catch the whole family, and each carries
the ``exit_code`` the CLI exits with when it reaches the command line: the CLI prints
``k3ckpt: error: <message>`` on one line, never a traceback. Exit codes: 0 ok, 1 problems found
(:data:`EXIT_PROBLEMS`), 2 could not run (:data:`EXIT_CANNOT_RUN`, the default)::

    K3ckptError                        exit 2 unless noted
    ├── EnvError                       a K3CKPT_* environment variable holds an unusable value
    ├── CheckpointNotFoundError        no such path, or no index and no model.safetensors
    ├── SafetensorsHeaderError         a shard's header is malformed (names file and tensor)
    ├── IndexFileError                 model.safetensors.index.json unreadable or inconsistent
    ├── ConfigError                    config.json unreadable or lacking what is needed
    ├── EngineFilesError               a tokenizer file or the licence an engine needs is missing
    ├── LayoutError                    a rank/node layout marker file cannot be read
    ├── TopologyError                  a topology, rank selection or split that cannot work
    │   └── SplitError                 a tensor that cannot be split as the topology asks
    ├── HashError                      a file could not be read to the end while hashing
    │                                  (also an OSError: callers catching OSError still do)
    ├── ManifestError                  a manifest is unreadable, of another format, or unsafe
    ├── ManifestHashError              files could not be read while building a manifest
    ├── KeyFileError                   a key file is missing, unreadable or not an ed25519 key
    ├── SignatureError                 a signature does not verify (exit 1)
    ├── ShareReferenceError            a share's rewritten shards cannot be checked against this reference
    ├── HubError                       a hub could not give us what we asked for
    │   ├── HubUnreachableError        the endpoint cannot be connected to
    │   ├── HubAuthError               credentials refused or required (401/403, gated)
    │   ├── RepoNotFoundError          no such repo (or not visible with these credentials)
    │   ├── RevisionNotFoundError      the repo exists, the branch/tag/commit does not
    │   ├── EntryNotFoundError         the file is not in the listing, or answers 404
    │   ├── HubListingError            the listing is unusable (sizes, hashes, truncation)
    │   │   └── UnsafePathError        a listed path could escape a local directory
    │   ├── RangeNotSupportedError     the server ignores Range too far into the file
    │   ├── RangeMismatchError         the server answered another byte range
    │   ├── HubShortReadError          a response body ended early (after retries)
    │   └── HubDigestMismatchError     a file's bytes disagree with the listing's sha256 (exit 1)
    ├── OutputLockedError              another live run holds the output directory's lock
    │   └── FetchLockedError           ... a fetch, on its destination
    ├── OutputNotOwnedError            the output holds files k3ckpt did not write (or another command's)
    ├── DiskSpaceError                 the destination has less free space than needed
    ├── RankFetchError                 the repo or manifest does not allow a rank-aware fetch
    ├── EmptySelectionError            --include/--exclude leave no file: nothing to do
    ├── OfflineNoRecordError           HF_HUB_OFFLINE and no record of an earlier fetch to verify against
    ├── MxSelectionError               no MX tensor matches the selection
    ├── MxInspectError                 an input cannot be inspected or measured
    ├── MxPlotUnavailableError         --plot without matplotlib installed
    ├── MxConvertError                 a dequantize/quantize cannot run or finish
    ├── SourceShortReadError           a local source file ended before its header's promise
    ├── ReshardError                   the source or output cannot be resharded as asked
    ├── UnshardError                   a rank layout is incomplete, or the output unwritable
    ├── PreflightError                 preflight cannot run (no such directory, bad options)
    ├── EngineTopologyError            the engine's parallel state does not fit the node directory
    ├── TensorDigestError              a tensor the engine read differs from its digest (exit 1)
    └── SynthError                     a synthetic checkpoint cannot be made as requested

The modules that raise these re-export them (``from k3ckpt.hub.client import HubError`` works),
but this module is their one definition.

Every class also has a ``kind``, its stable name in the CLI's ``--json`` error object
(``{"error": {"kind", "path", "message"}}``): the class name without ``Error``, in snake case
(``CheckpointNotFoundError`` -> ``checkpoint_not_found``), derived for every subclass when it
is defined (:func:`kind_of_name`), so a new class never lacks one; and a ``path``, the file or
directory the error is about when it knows one (``None`` otherwise). ``docs/errors.md`` lists
the kinds.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "EXIT_CANNOT_RUN",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "CheckpointNotFoundError",
    "ConfigError",
    "DiskSpaceError",
    "EmptySelectionError",
    "EngineFilesError",
    "EngineTopologyError",
    "EntryNotFoundError",
    "EnvError",
    "FetchLockedError",
    "HashError",
    "HubAuthError",
    "HubDigestMismatchError",
    "HubError",
    "HubListingError",
    "HubShortReadError",
    "HubUnreachableError",
    "IndexFileError",
    "K3ckptError",
    "KeyFileError",
    "LayoutError",
    "ManifestError",
    "ManifestHashError",
    "MxConvertError",
    "MxInspectError",
    "MxPlotUnavailableError",
    "MxSelectionError",
    "OfflineNoRecordError",
    "OutputLockedError",
    "OutputNotOwnedError",
    "PreflightError",
    "RangeMismatchError",
    "RangeNotSupportedError",
    "RankFetchError",
    "RepoNotFoundError",
    "ReshardError",
    "RevisionNotFoundError",
    "SafetensorsHeaderError",
    "ShareReferenceError",
    "SignatureError",
    "SourceShortReadError",
    "SplitError",
    "SynthError",
    "TensorDigestError",
    "TopologyError",
    "UnsafePathError",
    "UnshardError",
]

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_CANNOT_RUN = 2


_WORD_START = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def kind_of_name(class_name: str) -> str:
    """An error class's ``kind``: its name without ``Error``, in snake case
    (``HubShortReadError`` -> ``hub_short_read``, ``K3ckptError`` -> ``k3ckpt``)."""
    return _WORD_START.sub("_", class_name.removesuffix("Error")).lower()


class K3ckptError(Exception):
    """Base class. ``exit_code`` is what the CLI exits with when this reaches it; ``kind`` the
    class's stable name in the CLI's JSON error object (derived from the class name for every
    subclass); ``path`` the file or directory the error is about, when known (pass ``path=``)."""

    exit_code: int = EXIT_CANNOT_RUN
    kind: str = "k3ckpt"
    path: str | None = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" not in cls.__dict__:  # a class may pin its own; every other one gets its name's
            cls.kind = kind_of_name(cls.__name__)

    def __init__(self, *args: object, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(*args)
        if path is not None:  # an instance attribute: pickling (worker processes) keeps it
            self.path = os.fspath(path)


# -- environment ---------------------------------------------------------------------------------


class EnvError(K3ckptError):
    """A ``K3CKPT_*`` environment variable holds a value that cannot be used. The message
    shows the assignment as the user wrote it and what was expected instead."""

    exit_code = EXIT_CANNOT_RUN

    def __init__(self, name: str, value: str, problem: str) -> None:
        self.name = name
        self.value = value
        self.problem = problem
        super().__init__(f"{name}={value!r} {problem}")

    def __reduce__(self) -> tuple:  # read in worker processes too: cross back intact
        return (type(self), (self.name, self.value, self.problem))


# -- checkpoint format -------------------------------------------------------------------------


class CheckpointNotFoundError(K3ckptError):
    """The path is missing, or holds no index and no single ``model.safetensors``."""


class SafetensorsHeaderError(K3ckptError):
    """A shard's header is malformed. The message names the file and, where known, the tensor."""

    def __init__(self, path: str, problem: str, tensor: str | None = None) -> None:
        self.path = path
        self.problem = problem
        self.tensor = tensor
        where = f"{path}: tensor {tensor!r}: " if tensor is not None else f"{path}: "
        super().__init__(where + problem)

    def __reduce__(self) -> tuple:  # so it crosses process boundaries intact
        return (type(self), (self.path, self.problem, self.tensor))


class IndexFileError(K3ckptError):
    """``model.safetensors.index.json`` is unreadable or names shards that are not there."""


class ConfigError(K3ckptError):
    """``config.json`` is unreadable or lacks what is needed."""


class EngineFilesError(K3ckptError):
    """A file an engine reads beside the weights (tokenizer, licence) is missing or unreadable:
    the rule of :mod:`k3ckpt.format.loadable`. Names the file."""


class LayoutError(K3ckptError):
    """A layout marker file exists but cannot be read."""


class TopologyError(K3ckptError):
    """A topology, rank selection or split that cannot work. One line, names what to change."""

    exit_code = EXIT_CANNOT_RUN


class SplitError(TopologyError):
    """A tensor that cannot be split as the topology asks. The message names the tensor."""

    def __init__(self, tensor: str | None, problem: str) -> None:
        self.tensor = tensor
        self.problem = problem
        super().__init__(f"tensor {tensor!r}: {problem}" if tensor is not None else problem)

    def __reduce__(self) -> tuple:  # so it crosses process boundaries intact
        return (type(self), (self.tensor, self.problem))


# -- integrity ---------------------------------------------------------------------------------


class HashError(K3ckptError, OSError):
    """A file could not be read to the end (vanished, truncated while reading, I/O error).

    Built like an ``OSError`` (``HashError(errno, strerror, filename)``) and still one: code
    that catches ``OSError`` around hashing, or reads ``strerror``/``filename``, keeps working.
    """

    exit_code = EXIT_CANNOT_RUN

    def __init__(self, *args: object) -> None:
        super().__init__(*args)  # OSError's own arguments: (errno, strerror, filename)
        if self.filename is not None:
            self.path = os.fsdecode(self.filename)


class ManifestError(K3ckptError):
    """A manifest file is unreadable, of another format or version, or unsafe."""


class ManifestHashError(K3ckptError):
    """Files could not be read while building a manifest."""


class KeyFileError(K3ckptError):
    """A key file is missing, unreadable, of another algorithm or not a key at all (exit 2)."""


class SignatureError(K3ckptError):
    """A signature does not verify, or is not an ed25519 signature at all (exit 1)."""

    exit_code = EXIT_PROBLEMS


class ShareReferenceError(K3ckptError):
    """A node directory or rank-aware copy (a share) has rewritten shards, and the reference
    (a manifest without tensor hashes, a hub listing) knows only whole source files: nothing
    content-level could be checked (exit 2)."""


# -- hubs --------------------------------------------------------------------------------------


class HubError(K3ckptError):
    """A hub could not give us what we asked for. The message is one line naming hub, repo,
    revision and (where there is one) the file path.

    Args:
        problem (`str`):
            What went wrong.
        hub (`str`):
            ``"hf"`` or ``"modelscope"``.
        repo (`str`, *optional*):
            The repo id.
        revision (`str`, *optional*):
            The revision as requested, or the resolved commit once there is a listing.
        path (`str`, *optional*):
            The repo-relative file path.
        endpoint (`str`, *optional*):
            The endpoint talked to.
    """

    def __init__(
        self,
        problem: str,
        *,
        hub: str,
        repo: str | None = None,
        revision: str | None = None,
        path: str | None = None,
        endpoint: str | None = None,
    ) -> None:
        # Client messages span several lines; ours are one line for the CLI.
        self.problem = " ".join(str(problem).split())
        self.hub = hub
        self.repo = repo
        self.revision = revision
        self.path = path
        self.endpoint = endpoint
        where = hub
        if repo is not None:
            where += f":{repo}@{revision if revision is not None else '(default)'}"
        if path is not None:
            where += f" {path!r}"
        super().__init__(f"{where}: {self.problem}")

    def __reduce__(self) -> tuple:  # keep the keyword arguments across process boundaries
        return (
            _rebuild_hub_error,
            (type(self), self.problem, self.hub, self.repo, self.revision, self.path, self.endpoint),
        )


def _rebuild_hub_error(cls: type[HubError], problem: str, hub: str, repo: str | None, revision: str | None,
                       path: str | None, endpoint: str | None) -> HubError:
    return cls(problem, hub=hub, repo=repo, revision=revision, path=path, endpoint=endpoint)


class HubUnreachableError(HubError):
    """The endpoint could not be connected to (refused, DNS failure, no route)."""


class HubAuthError(HubError):
    """The hub refused our credentials, or wants some (401/403, gated repo)."""


class RepoNotFoundError(HubError):
    """The repo does not exist (or is private and not visible with these credentials)."""


class RevisionNotFoundError(HubError):
    """The repo exists but the branch, tag or commit does not."""


class EntryNotFoundError(HubError):
    """The file is not in the listing, or the hub answers 404 for it."""


class HubListingError(HubError):
    """The hub's listing is unusable (missing sizes, malformed hashes, duplicates, truncation)."""


class UnsafePathError(HubListingError):
    """The listing names a path that could escape a local directory (absolute, ``..``, ``\\``, NUL)."""


class RangeNotSupportedError(HubError):
    """The server ignored ``Range`` and the requested offset is too far in to skip to."""


class RangeMismatchError(HubError):
    """The server answered a different byte range (or representation) than the one requested."""


class HubShortReadError(HubError):
    """A hub's response body ended before the requested bytes were all received (after retries).
    Not :class:`SourceShortReadError`, which is a local file ending early."""


class HubDigestMismatchError(HubError):
    """The bytes a hub served for a file do not hash to the sha256 (or git blob id) its own
    listing publishes (exit 1: what was read is not what the hub says it holds)."""

    exit_code = EXIT_PROBLEMS


class OutputLockedError(K3ckptError):
    """Another live run (reshard, unshard, fetch) holds the output directory's lock (the message
    names the lock file and its holder's host and pid)."""


class OutputNotOwnedError(K3ckptError):
    """The output directory (or file) holds something k3ckpt did not write, or another command's
    output: nothing is written, ``--force`` included (the message names the first such file)."""


class FetchLockedError(OutputLockedError):
    """Another live fetch holds the destination's lock (the message names its host and pid)."""


class DiskSpaceError(K3ckptError):
    """The destination's filesystem has less free space than the download needs."""


class RankFetchError(K3ckptError):
    """The repo, its headers or the manifest do not allow a rank-aware fetch (the message says why)."""


class EmptySelectionError(K3ckptError):
    """``--include``/``--exclude`` leave none of the files they filter: the command would do
    nothing (or only part of what was meant), so it is refused before any byte moves. The
    message names the patterns."""


class OfflineNoRecordError(K3ckptError):
    """``fetch`` under ``HF_HUB_OFFLINE=1`` found no record of an earlier fetch of that repo (and
    revision) where it was pointed, or the record of another kind of fetch (a node fetch checked
    as a whole one), or a node directory or partial checkpoint of another node or ranks: there
    is nothing to verify against, and the hub may not be asked (the message names the directory)."""


# -- MX (microscaling) tensors -----------------------------------------------------------------


class MxSelectionError(K3ckptError):
    """Nothing matches the selection, or a pair is malformed."""


class MxInspectError(K3ckptError):
    """An input cannot be inspected or measured (not float, wrong shape, nothing to do)."""


class MxPlotUnavailableError(K3ckptError):
    """``--plot`` was asked for and matplotlib is not installed."""


class MxConvertError(K3ckptError):
    """A conversion cannot run or cannot finish: bad input, no space, NaN/Inf in a weight."""


# -- deployment --------------------------------------------------------------------------------


class SourceShortReadError(K3ckptError):
    """A local source file ended before the bytes its header promised (truncated under us).
    Not :class:`HubShortReadError`, which is a hub's response ending early."""


class ReshardError(K3ckptError):
    """The output directory or the source cannot be resharded as asked."""


class UnshardError(K3ckptError):
    """The rank layout is incomplete or inconsistent, or the output cannot be written."""


class PreflightError(K3ckptError):
    """Preflight cannot run: no such directory, not a layout nor a checkpoint, bad options."""

    exit_code = EXIT_CANNOT_RUN


# -- engine ------------------------------------------------------------------------------------


class EngineTopologyError(K3ckptError):
    """The engine (``--load-format k3ckpt``) runs with a parallel state the node directory was not
    written for: one line naming the mismatch and the launch that fits."""

    exit_code = EXIT_CANNOT_RUN


class TensorDigestError(K3ckptError):
    """A tensor the engine read differs from its digest, or one it had to read never came."""

    exit_code = EXIT_PROBLEMS


# -- testing -----------------------------------------------------------------------------------


class SynthError(K3ckptError):
    """A synthetic checkpoint cannot be made with the requested options."""
