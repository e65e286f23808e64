"""``k3ckpt reshard``: write a checkpoint as the directories each node (``--format node``, the
default) or each rank (``--format rank``) of a topology loads.

``--format rank`` is the rank-layout contract (``docs/layout.md``): ``OUT/topology.json``, the
source's non-weight files, and ``OUT/rank-NNNNN/{model-rank-R-part-K.safetensors,
rank-manifest.json, READY}``. What each rank holds comes from
:func:`k3ckpt.format.topology.tensors_for_ranks`.

``--format node`` (the CLI's default; ``hf-node`` is its older name) writes node directories
for engines that read ordinary checkpoints and filter experts themselves (vLLM
``--enable-expert-parallel --enable-ep-weight-filter``): per node of ``--gpus-per-node`` GPUs
(all nodes, or ``--node N``; without ``--gpus-per-node`` one node holds the whole world),
``OUT/node-NNNNN/`` holds every non-expert tensor whole plus the routed experts of the node's
ranks, whole, under their source names, in the files :mod:`k3ckpt.format.nodedir` plans
(dense files, then per rank files holding only that rank's experts), a
``model.safetensors.index.json`` listing exactly those tensors, and the source's non-weight
files. The topology has vLLM's expert-parallel meaning (``ep = tp x dp`` = the world size,
experts never cut; anything else is refused with the nearest valid command). Whole tensors are
contiguous runs, so everything is copied kernel-side. ``k3ckpt-node.json`` (the plan's marker
plus per-tensor and per-file sha256) is written after the index and ``READY`` last; the marker
plays the rank manifest's part for resuming, and ``k3ckpt verify`` checks the node's experts
against it instead of the config's full count. ``OUT/topology.json`` then has format
``k3ckpt-node-layout`` (plus ``dp`` and ``gpus_per_node``), so neither a rank-layout run into
the same directory nor ``unshard`` mistakes it for a rank layout.

A run streams: memory is a few bounded buffers per worker, whatever the size, and what is
copied is hashed in the same pass (nothing is read back). Where each step lives:

- :mod:`~k3ckpt.deploy.reshard.plan` decides every output file, no data read
  (:func:`plan_reshard`: which tensors, in which parts, as which source byte runs);
- :mod:`~k3ckpt.deploy.reshard.run` is the entry point (:func:`run_reshard`, :func:`reshard`):
  it checks and claims ``OUT``, holds its lock, checks free space, skips complete units and
  turns a full disk into the shortfall;
- :mod:`~k3ckpt.deploy.reshard.write` writes the files in parallel under temporary names,
  hashing them in the same pass, and hands each unit to its finisher as its last file lands;
- :mod:`~k3ckpt.deploy.reshard.units` finishes a unit (renames, manifest, stat record,
  ``READY``) and decides on a re-run which units are complete;
- :mod:`~k3ckpt.deploy.reshard.result` is what a run returns and prints.

The copying machinery (kernel-side copies, strided gathers, fd caches, atomic files) lives in
:mod:`k3ckpt.deploy.bytecopy`, shared with ``unshard``. The writers reach the fault point
``reshard.file_written`` (:mod:`k3ckpt.faults`) as each file is written.
"""

from ...errors import ReshardError as ReshardError  # (raised by every step; importable from here too)
from ...format.topology import TopologyError as TopologyError
from .plan import ALIGN, DEFAULT_MAX_FILE_SIZE, NodePlan, OutFile, OutTensor, RankPlan, ReshardPlan, plan_reshard
from .result import ReshardResult, render_reshard
from .run import reshard, run_reshard
from .units import STAT_RECORD_DIR
from .write import MAX_DEFAULT_WRITERS, manifest_digests

__all__ = [
    "ALIGN",
    "DEFAULT_MAX_FILE_SIZE",
    "MAX_DEFAULT_WRITERS",
    "STAT_RECORD_DIR",
    "NodePlan",
    "OutFile",
    "OutTensor",
    "RankPlan",
    "ReshardPlan",
    "ReshardResult",
    "manifest_digests",
    "plan_reshard",
    "render_reshard",
    "reshard",
    "run_reshard",
]
