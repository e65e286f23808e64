"""How many requests a fetch runs at once by default.

Its own module, importing nothing heavy, because ``plan`` and ``preflight`` size their estimate
with it: reaching it through :mod:`k3ckpt.hub.client` would import ``requests`` and ``urllib3``
(tens of milliseconds of start-up, issue #28's fixed cost) into commands that never contact a hub.
"""

from __future__ import annotations

import os

#: Concurrent requests of a fetch on a small node: huggingface_hub's own ``max_workers`` default.
MIN_DEFAULT_REQUESTS = 8
#: The most a fetch opens by default, however many cores: a hub's CDN serves each connection at
#: its own pace, and more than this many at once from one host only invites rate limits.
MAX_DEFAULT_REQUESTS = 32


def default_requests(cores: int | None = None) -> int:
    """How many requests a fetch runs at once by default on a node of ``cores`` cores (None:
    this machine's): one per two cores, at least :data:`MIN_DEFAULT_REQUESTS`, at most
    :data:`MAX_DEFAULT_REQUESTS`. Each request's thread hashes the bytes it receives (about one
    CPU-second per GB, ``k3ckpt.deploy.estimate.CostPerGB``), so the requests' cores, not the
    link, bound a fetch on a fast link with few of them (docs/deploy.md, "Time to ready"). Half
    the cores keeps such links full on the nodes that have them and leaves the rest to the
    machine."""
    n = cores if cores is not None else (os.cpu_count() or 1)
    return max(MIN_DEFAULT_REQUESTS, min(MAX_DEFAULT_REQUESTS, n // 2))
