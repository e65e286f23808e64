"""A loopback Hugging Face + ModelScope hub emulator for tests, benchmarks and demos.

:class:`LoopbackHub` serves one or more local checkpoint directories on 127.0.0.1 over the
HTTP APIs that the *real* clients use, so ``huggingface_hub`` (2.x) and ``modelscope`` /
``modelscope_hub`` download through it unmodified.  Standard library only.

Quick start::

    from k3ckpt.testing.hub import LoopbackHub

    with LoopbackHub({"moonshotai/Kimi-K3": "/data/k3-mini"}) as hub:
        huggingface_hub.snapshot_download("moonshotai/Kimi-K3", endpoint=hub.url, local_dir=...)
        modelscope.snapshot_download("moonshotai/Kimi-K3", endpoint=hub.url, cache_dir=...)
        hub.inject("drop_after", "model-*.safetensors", after=4096, times=1)
        hub.bytes_sent("config.json"), hub.requests("config.json")

From a shell::

    python -m k3ckpt.testing.hub /data/k3-mini --repo moonshotai/Kimi-K3 --port 8765 [--xet]

Fault injection: ``hub.inject(kind, path_glob="*", *, repo="*", times=1, methods=("GET",),
**params)`` arms a :class:`Fault` for the next ``times`` matching requests; the kinds (error
statuses, cut, stalled or corrupted bodies, ignored ranges, hostile answers, expired Xet URLs)
and their parameters are listed in ``_faults``.

Counters: ``hub.bytes_sent(path)``, ``hub.requests(path)`` (body bytes handed to the socket and
requests, per (repo, path), summed over repos unless ``repo=`` is given), ``hub.reset_counters()``;
``hub.request_log`` lists every request with its route name as soon as its answer starts.
Counters and log cover the requests that arrived since the last reset: a body still being sent
from before it (say, an earlier test's stall waking up) is counted nowhere.

Where things are (each module's docstring says what it emulates and which client quirks it
answers):

- ``_repo``: the repository model - the files a directory serves, their hashes (cached across
  runs), the commit sha and refs (:class:`RepoSpec`, :class:`FileEntry`, :class:`RepoSnapshot`);
- ``_hub``: :class:`LoopbackHub` (lifecycle, Xet URL signing, the counters and log) and the
  request handler that routes each request;
- ``_server``: the HTTP core - sockets and threads, the request log (:class:`RequestRecord`),
  counters and their epochs, auth and the error formats every route shares;
- ``_hf``: the Hugging Face API and ``resolve`` (what huggingface_hub 2.4 calls);
- ``_ms``: the ModelScope API (what modelscope 1.40 -> modelscope_hub 0.5 calls);
- ``_xet``: Xet mode - the 302 of a Xet-backed ``resolve`` and the bridge host behind it;
- ``_bodies``: file bodies (Range, sendfile) and the faults that act on them;
- ``_faults``: :class:`Fault`, :class:`FaultSet`, :data:`FAULT_KINDS`;
- ``_cli`` (``python -m k3ckpt.testing.hub``): :func:`main`.
"""

from ._cli import main
from ._faults import FAULT_KINDS, Fault, FaultSet
from ._hub import LoopbackHub
from ._repo import DEFAULT_EXCLUDE, LFS_THRESHOLD, FileEntry, HashStats, RepoSnapshot, RepoSpec
from ._server import RequestRecord
from ._xet import XET_URL_TTL

__all__ = [
    "DEFAULT_EXCLUDE",
    "FAULT_KINDS",
    "LFS_THRESHOLD",
    "Fault",
    "FaultSet",
    "FileEntry",
    "HashStats",
    "LoopbackHub",
    "RepoSnapshot",
    "RepoSpec",
    "RequestRecord",
    "XET_URL_TTL",
    "main",
]
