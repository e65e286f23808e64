"""Getting a checkpoint from Hugging Face or ModelScope: listings and byte ranges through the real
client libraries, a parallel resumable verified downloader, the whole-repo and the rank-aware
fetch (a node directory, or a partial checkpoint), and a manifest pulled from hub metadata alone.

The client libraries are imported when a hub is first contacted, not when this package is.
"""

from .client import HubFile, HubListing, RetryPolicy, list_repo
from .download import FetchResult, fetch_files
from .fetch import FetchPlan, plan_fetch, run_fetch
from .nodefetch import NodeFetchPlan, plan_node_fetch, run_node_fetch
from .pull import pull_manifest
from .rankfetch import RankFetchPlan, RankFetchResult, plan_rank_fetch, run_rank_fetch

__all__ = [
    "FetchPlan",
    "FetchResult",
    "HubFile",
    "HubListing",
    "NodeFetchPlan",
    "RankFetchPlan",
    "RankFetchResult",
    "RetryPolicy",
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
