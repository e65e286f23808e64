"""What the launcher's environment says about this process: rank, world size, local rank,
ranks per node and node index, read from torchrun, Slurm, Open MPI or a Kubernetes Indexed Job
(:data:`ENV_VARIABLES`, :func:`rank_from_env`, :class:`RankEnv`); never raises - preflight
reports the problems.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: field -> variables that carry it, highest priority first. torchrun (and most launchers built
#: on torch.distributed) set RANK & co.; Slurm's srun sets SLURM_*; Open MPI's mpirun (TRT-LLM)
#: sets OMPI_COMM_WORLD_*; a Kubernetes Indexed Job gives each pod (one per node) its index.
ENV_VARIABLES: dict[str, tuple[str, ...]] = {
    "rank": ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"),
    "world_size": ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"),
    "local_rank": ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "local_world_size": ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "node": ("GROUP_RANK", "SLURM_NODEID", "JOB_COMPLETION_INDEX"),
}


@dataclass(frozen=True)
class RankEnv:
    """What the launcher's environment says about this process. Each field is the value of its
    highest-priority variable that is set and valid (``None`` if none is); ``sources`` names
    that variable and ``candidates`` keeps every variable seen, so preflight can check them
    against each other and against the topology.

    Candidates may legitimately differ: torchrun started once per node under ``sbatch`` sees
    SLURM_PROCID = node index while RANK is the worker's rank. So differences are data here,
    not errors.
    """

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    local_world_size: int | None = None
    node: int | None = None
    sources: dict[str, str] = field(default_factory=dict)  # field -> variable it came from
    candidates: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    problems: tuple[str, ...] = ()  # malformed values, rank >= world size, ...

    @property
    def found(self) -> bool:
        return bool(self.sources)


def rank_from_env(environ: Mapping[str, str]) -> RankEnv:
    """Read rank, world size, local rank, ranks per node and node index from ``environ``
    (``os.environ`` or a dict) - see :data:`ENV_VARIABLES`. Never raises: problems are
    collected in :attr:`RankEnv.problems` for preflight to report."""
    values: dict[str, int | None] = {}
    sources: dict[str, str] = {}
    candidates: dict[str, tuple[tuple[str, int], ...]] = {}
    problems: list[str] = []
    for fld, variables in ENV_VARIABLES.items():
        seen: list[tuple[str, int]] = []
        for var in variables:
            raw = environ.get(var)
            if raw is None or raw.strip() == "":
                continue
            text = raw.strip()
            if not (text.isascii() and text.isdigit()):
                problems.append(f"{var}={raw!r} is not a non-negative integer")
                continue
            seen.append((var, int(text)))
        if seen:
            sources[fld] = seen[0][0]
            candidates[fld] = tuple(seen)
        values[fld] = seen[0][1] if seen else None
    rank, world, local, local_world = (values[k] for k in ("rank", "world_size", "local_rank", "local_world_size"))
    if world is not None and world < 1:
        problems.append(f"{sources['world_size']}={world}: world size must be at least 1")
    elif rank is not None and world is not None and rank >= world:
        problems.append(f"{sources['rank']}={rank} is not below {sources['world_size']}={world}")
    if local_world is not None and local_world < 1:
        problems.append(f"{sources['local_world_size']}={local_world}: ranks per node must be at least 1")
    elif local is not None and local_world is not None and local >= local_world:
        problems.append(f"{sources['local_rank']}={local} is not below {sources['local_world_size']}={local_world}")
    return RankEnv(rank, world, local, local_world, values["node"], sources, candidates, tuple(problems))
