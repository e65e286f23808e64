"""``k3ckpt manifest pull``: a manifest from hub metadata alone, before anything is downloaded."""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

from ..integrity.manifest import FileEntry, Manifest, ManifestError, tensors_from_headers
from .client import fetch_headers, list_repo, read_range

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
) -> Manifest:
    """Build a manifest from hub metadata alone, before downloading the checkpoint.

    File sizes and sha256 come from the hub's API (through the real client library); each
    ``*.safetensors`` file's header is fetched with two HTTP Range requests (its 8-byte length,
    then the header) and validated by the strict parser; small files whose sha256 the hub does
    not publish are fetched and hashed. The source records the *resolved* commit.

    Raises:
        HubError (and subclasses): the hub cannot be reached, or the repo/revision is unknown.
        ManifestError: a file the hub lists has no sha256 and is too big to fetch here.
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
    return Manifest(files, tensors_from_headers(headers), source, tensor_hashes=False)
