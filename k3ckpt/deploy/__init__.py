"""Putting a checkpoint on a cluster: the topology plan (what each rank holds, which
accelerators fit, and with :class:`Limits` each node's time to ready), reshard into one
directory per rank (or per node), unshard back, and the preflight that says whether a node will
boot the model.

The one-call operations ``reshard``, ``unshard`` and ``preflight`` share their names with the
modules that hold them, so they are exported from the top-level :mod:`k3ckpt` (and live in
:mod:`k3ckpt.deploy.reshard`, :mod:`k3ckpt.deploy.unshard`, :mod:`k3ckpt.deploy.preflight`);
re-exporting them here would hide those modules behind functions.
"""

from .estimate import MEASURED_COSTS, CostPerGB, Limits, ReadyEstimate
from .plan import PlanReport, plan_topology, render_plan
from .preflight import PreflightReport, render_preflight
from .reshard import ReshardPlan, ReshardResult, plan_reshard, run_reshard
from .serve import serve_command
from .unshard import UnshardPlan, UnshardResult, plan_unshard, run_unshard

__all__ = [
    "MEASURED_COSTS",
    "CostPerGB",
    "Limits",
    "PlanReport",
    "PreflightReport",
    "ReadyEstimate",
    "ReshardPlan",
    "ReshardResult",
    "UnshardPlan",
    "UnshardResult",
    "plan_reshard",
    "plan_topology",
    "plan_unshard",
    "render_plan",
    "render_preflight",
    "run_reshard",
    "run_unshard",
    "serve_command",
]
