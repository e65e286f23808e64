"""Getting a checkpoint from Hugging Face or ModelScope: listings and byte ranges through the real
client libraries, a parallel resumable verified downloader, the whole-repo and the rank-aware
fetch (a node directory, or a partial checkpoint), and a manifest pulled from hub metadata alone.

The client libraries are imported when a hub is first contacted, not when this package is.
"""

from typing import TYPE_CHECKING

from ..utils.lazy import lazy_exports

__all__ = [
    "FetchPlan",
    "FetchResult",
    "HubFile",
    "HubListing",
    "NodeFetchPlan",
    "RankFetchPlan",
    "RankFetchResult",
    "RetryPolicy",
    "default_requests",
    "fetch_files",
    "list_repo",
    "plan_fetch",
    "plan_node_fetch",
    "plan_rank_fetch",
    "pull_manifest",
    "run_fetch",
    "run_node_fetch",
    "run_rank_fetch",
]

# Each name is imported from its module on first use (see lazy_exports): ``import
# k3ckpt.hub.<module>`` does not import the rest of the package.
__getattr__, __dir__ = lazy_exports(__name__, {
    "FetchPlan": ".fetch",
    "FetchResult": ".download",
    "HubFile": ".client",
    "HubListing": ".client",
    "NodeFetchPlan": ".nodefetch",
    "RankFetchPlan": ".rankfetch",
    "RankFetchResult": ".rankfetch",
    "RetryPolicy": ".client",
    "default_requests": "._concurrency",
    "fetch_files": ".download",
    "list_repo": ".client",
    "plan_fetch": ".fetch",
    "plan_node_fetch": ".nodefetch",
    "plan_rank_fetch": ".rankfetch",
    "pull_manifest": ".pull",
    "run_fetch": ".fetch",
    "run_node_fetch": ".nodefetch",
    "run_rank_fetch": ".rankfetch",
})

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from ._concurrency import default_requests
    from .client import HubFile, HubListing, RetryPolicy, list_repo
    from .download import FetchResult, fetch_files
    from .fetch import FetchPlan, plan_fetch, run_fetch
    from .nodefetch import NodeFetchPlan, plan_node_fetch, run_node_fetch
    from .pull import pull_manifest
    from .rankfetch import RankFetchPlan, RankFetchResult, plan_rank_fetch, run_rank_fetch
