"""What one rank needs of its GPU's memory: the rule ``plan`` sizes with and ``preflight`` checks.

Its own module so that ``preflight`` reads the rule without importing the planner (and through
it the cost model and ``reshard``): every preflight starts faster by what it does not import.
"""

from __future__ import annotations

#: Rule of thumb for what a rank needs beyond its weights (activations, CUDA graphs, buffers).
WEIGHT_OVERHEAD = 1.15
#: KV-cache memory assumed per GPU when none is given.
DEFAULT_KV_BUDGET = 20 * 1024**3


def loaded_bytes(weights: int) -> int:
    """A rank's weights as they sit in GPU memory with the overhead: ``weights x WEIGHT_OVERHEAD``."""
    return int(weights * WEIGHT_OVERHEAD)
