"""Putting a checkpoint on a cluster: the topology plan (what each rank holds, which
accelerators fit, and with :class:`Limits` each node's time to ready), reshard into one
directory per rank (or per node), unshard back, and the preflight that says whether a node will
boot the model.

The one-call operations ``reshard``, ``unshard`` and ``preflight`` share their names with the
modules that hold them, so they are exported from the top-level :mod:`k3ckpt` (and live in
:mod:`k3ckpt.deploy.reshard`, :mod:`k3ckpt.deploy.unshard`, :mod:`k3ckpt.deploy.preflight`);
re-exporting them here would hide those modules behind functions.
"""

from typing import TYPE_CHECKING

from ..utils.lazy import lazy_exports

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

# Each name is imported from its module on first use (see lazy_exports): ``reshard`` does not
# import the planner, preflight or the cost model (~70 ms of every run's start-up).
__getattr__, __dir__ = lazy_exports(__name__, {
    "CostPerGB": ".estimate",
    "Limits": ".estimate",
    "MEASURED_COSTS": ".estimate",
    "PlanReport": ".plan",
    "PreflightReport": ".preflight",
    "ReadyEstimate": ".estimate",
    "ReshardPlan": ".reshard",
    "ReshardResult": ".reshard",
    "UnshardPlan": ".unshard",
    "UnshardResult": ".unshard",
    "plan_reshard": ".reshard",
    "plan_topology": ".plan",
    "plan_unshard": ".unshard",
    "render_plan": ".plan",
    "render_preflight": ".preflight",
    "run_reshard": ".reshard",
    "run_unshard": ".unshard",
    "serve_command": ".serve",
})

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from .estimate import MEASURED_COSTS, CostPerGB, Limits, ReadyEstimate
    from .plan import PlanReport, plan_topology, render_plan
    from .preflight import PreflightReport, render_preflight
    from .reshard import ReshardPlan, ReshardResult, plan_reshard, run_reshard
    from .serve import serve_command
    from .unshard import UnshardPlan, UnshardResult, plan_unshard, run_unshard
