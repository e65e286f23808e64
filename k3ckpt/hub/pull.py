"""``k3ckpt manifest pull``: a manifest from hub metadata alone, before anything is downloaded -
and with ``--tensor-hashes``, the tensor-hash manifest a node needs to verify its share, from
one streamed read of every weight file (nothing stored).

Tensor hashes are tied to what the hub publishes: each safetensors file is streamed once
(bounded memory: the downloader's pieces, never a file in memory), hashed whole and tensor by
tensor in the same pass, and the whole-file digest must equal the listing's sha256 (or git blob
id) - else :class:`~k3ckpt.errors.HubDigestMismatchError` and no manifest. ``verify --against``
on a share hashes only the tensors it holds, with ranged reads (:func:`remote_tensor_hashes`):
those are the hub's *current* bytes, not tied to a whole-file digest.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor

from ..errors import HubDigestMismatchError, HubError
from ..integrity.hashing import Span, StreamHasher
from ..integrity.manifest import FileEntry, Manifest, ManifestError, TensorEntry, tensors_from_headers
from . import _transfer, download
from .client import DEFAULT_RETRY, HubListing, auth_headers, fetch_headers, list_repo, read_range

#: Files without a published sha256 (small non-LFS files on Hugging Face: config, tokenizer)
#: are downloaded and hashed by ``pull`` when they are at most this big.
PULL_SMALL_FILE_BYTES = 64 * 1024 * 1024


def pull_manifest(
    hub: str,
    repo: str,
    revision: str | None = None,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    jobs: int = 8,
    tensor_hashes: bool = False,
    only: Collection[str] | None = None,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> Manifest:
    """Build a manifest from hub metadata alone, before downloading the checkpoint.

    With ``tensor_hashes``, every safetensors file is also streamed once (``jobs`` files at a
    time) and each tensor hashed, the whole file in the same pass; the manifest then equals
    ``manifest build --tensor-hashes`` of the same checkpoint but for its ``source``. With
    ``only`` as well, just those tensors are read (ranged reads, no whole-file check: the
    other tensors have no digest); ``verify --against`` on a share uses that.

    File sizes and sha256 come from the hub's API (through the real client library); each
    ``*.safetensors`` file's header is fetched with two HTTP Range requests (its 8-byte length,
    then the header) and validated by the strict parser; small files whose sha256 the hub does
    not publish are fetched and hashed. The source records the *resolved* commit.

    Raises:
        HubError (and subclasses): the hub cannot be reached, or the repo/revision is unknown.
        ManifestError: a file the hub lists has no sha256 and is too big to fetch here.
        HubDigestMismatchError: with ``tensor_hashes``, a streamed file's digest is not the listing's (exit 1).
    """
    listing = list_repo(hub, repo, revision, endpoint=endpoint, token=token)

    def small_sha(path: str) -> str:
        return hashlib.sha256(read_range(listing, path, 0, listing.files[path].size, token=token)).hexdigest()

    shards = sorted(p for p in listing.files if p.endswith(".safetensors"))
    unhashed = sorted(p for p, f in listing.files.items() if not f.sha256)
    too_big = [p for p in unhashed if listing.files[p].size > PULL_SMALL_FILE_BYTES]
    if too_big:
        raise ManifestError(f"{hub}:{repo}@{listing.revision}: {too_big[0]} has no published sha256 and is "
                            f"{listing.files[too_big[0]].size} bytes; build the manifest from a local copy instead")
    headers = [c.to_header() for c in fetch_headers(listing, shards, token=token, jobs=jobs)]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        shas = dict(zip(unhashed, ex.map(small_sha, unhashed)))
    data_start = {h.file: h.data_start for h in headers}
    files = {
        p: FileEntry(f.size, f.sha256 or shas[p], data_start.get(p))
        for p, f in listing.files.items()
    }
    source = {"hub": hub, "repo": listing.repo, "revision": listing.revision}
    tensors = tensors_from_headers(headers)
    if tensor_hashes:
        digests = remote_tensor_hashes(listing, tensors, only=only, token=token, jobs=jobs, progress=progress,
                                       on_plan=on_plan)
        tensors = {n: t._replace(sha256=digests.get(n)) for n, t in tensors.items()}
    return Manifest(files, tensors, source, tensor_hashes=tensor_hashes)


def pull_share_manifest(
    share: str | os.PathLike[str],
    hub: str,
    repo: str,
    revision: str | None = None,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    jobs: int = 8,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> Manifest:
    """The reference ``verify --against`` checks a share with: :func:`pull_manifest` with the
    digests of exactly the tensors the share's headers hold, read from the hub with ranged
    requests (the other tensors only count as other nodes' experts). These are the hub's
    current bytes; a pinned, signed tensor-hash manifest is the stronger reference.

    Raises:
        CheckpointNotFoundError: ``share`` is not a checkpoint directory.
        HubError: as :func:`pull_manifest`.
    """
    from ..format.checkpoint import open_checkpoint

    present = set(open_checkpoint(share, strict=False).tensors)
    return pull_manifest(hub, repo, revision, endpoint=endpoint, token=token, jobs=jobs, tensor_hashes=True,
                         only=present, progress=progress, on_plan=on_plan)


#: Tensors of one file closer than this are read by one ranged request (the gap is read and
#: discarded: cheaper than another request).
_GAP_BYTES = 1 << 20
#: Most bytes one ranged request of :func:`remote_tensor_hashes` covers (``only`` reads).
_RUN_BYTES = 64 << 20


def remote_tensor_hashes(
    listing: HubListing,
    tensors: dict[str, TensorEntry],
    *,
    only: Collection[str] | None = None,
    token: str | None = None,
    jobs: int = 8,
    progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int], None] | None = None,
) -> dict[str, str]:
    """sha256 of tensors' bytes as the hub serves them (``tensors``: the hub's headers' entries).

    ``only`` None: every safetensors file is streamed whole and its digest checked against the
    listing in the same pass. Otherwise only the tensors named are read, in ranged requests
    that cover runs of adjacent tensors.

    Raises:
        HubDigestMismatchError: a whole file's bytes are not the listing's sha256 / git blob id.
        HubError: a request failed after the downloader's retries.
    """
    by_file: dict[str, list[Span]] = {}
    for name, t in tensors.items():
        if only is None or name in only:
            by_file.setdefault(t.file, []).append(Span(name, *t.offsets))
    if only is None:
        runs = [(f, 0, listing.files[f].size, spans) for f, spans in by_file.items()]
    else:
        runs = [run for f, spans in by_file.items() for run in _runs(f, spans)]
    runs.sort(key=lambda r: r[1] - r[2])  # largest first: the last worker to finish idles least
    if on_plan is not None:
        on_plan(sum(stop - start for _, start, stop, _ in runs))
    headers = auth_headers(listing, token)
    cancel = threading.Event()
    count = progress or (lambda n: None)

    def one(run: tuple[str, int, int, list[Span]]) -> dict[str, str]:
        path, start, stop, spans = run
        entry = listing.files[path]
        whole = only is None
        hasher = StreamHasher(spans, start=start,
                              git_size=entry.size if whole and not entry.sha256 and entry.git_sha1 else None)
        _stream(listing, path, stop, hasher, headers, cancel, count)
        if whole:
            d = hasher.digest(path)
            want, got = (entry.sha256, d.sha256) if entry.sha256 else (entry.git_sha1, d.git_sha1)
            if want is not None and got != want:
                raise HubDigestMismatchError(
                    f"the streamed bytes hash to {got}, the listing says {want}: no tensor hashes from bytes "
                    "the hub does not publish", hub=listing.hub, repo=listing.repo, revision=listing.revision,
                    path=path, endpoint=listing.endpoint)
        return hasher.span_digests()

    out: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(runs) or 1))) as ex:
        try:
            for got in ex.map(one, runs):
                out.update(got)
        except BaseException:
            cancel.set()  # the other workers stop at their next piece
            raise
    return out


def _runs(path: str, spans: list[Span]) -> list[tuple[str, int, int, list[Span]]]:
    """Ranged reads covering ``spans`` of one file: adjacent tensors (gaps under
    :data:`_GAP_BYTES`) share a request of at most :data:`_RUN_BYTES` (a larger tensor gets
    one request of its own)."""
    out: list[tuple[str, int, int, list[Span]]] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and s.start - out[-1][2] <= _GAP_BYTES and s.stop - out[-1][1] <= _RUN_BYTES:
            _, start, _, group = out[-1]
            out[-1] = (path, start, max(out[-1][2], s.stop), [*group, s])
        else:
            out.append((path, s.start, s.stop, [s]))
    return out


def _stream(listing: HubListing, path: str, stop: int, hasher: StreamHasher, headers: dict[str, str],
            cancel: threading.Event, count: Callable[[int], None]) -> None:
    """Feed bytes ``[hasher.pos, stop)`` of ``path`` to ``hasher`` with ranged GETs, the
    downloader's response checks and retry rules; after a dropped connection the read resumes
    where the hasher stopped (it saw only whole received pieces)."""
    entry = listing.files[path]
    failures = 0
    while hasher.pos < stop:
        try:
            _transfer.hash_range(listing, entry, hasher.pos, stop - hasher.pos, headers,
                                   download.TIMEOUT, cancel, count, sink=hasher.feed)
        except _transfer.Retryable as e:
            failures += 1
            if failures >= DEFAULT_RETRY.attempts:
                raise _hub_error(listing, path, f"{e}; gave up after {failures} attempts") from None
            _transfer.back_off(DEFAULT_RETRY, failures, e.retry_after)
        except _transfer.Cancelled:
            raise _hub_error(listing, path, "cancelled") from None
        except _transfer.Fatal as e:
            raise _hub_error(listing, path, str(e)) from None


def _hub_error(listing: HubListing, path: str, problem: str) -> HubError:
    return HubError(problem, hub=listing.hub, repo=listing.repo, revision=listing.revision, path=path,
                    endpoint=listing.endpoint)
