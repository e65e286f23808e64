"""The engine command line that serves one node's directory: one home for the flags, used by
``preflight`` (its ``serve`` line) and, through it, ``examples/node-init.sh``.

vLLM 0.33.0 (flags from ``vllm/engine/arg_utils.py``; ``tests/test_recipes.py`` checks each is an
``add_argument`` of the wheel): expert parallelism over every DP x TP rank, the weight filter that
skips other ranks' experts by name before reading them, the placement the directory was written
for. Several nodes use vLLM's multi-node data parallelism: every node gets the same DP size and
its local DP size, the leader's address and RPC port; node 0 serves the API (internal load
balancing), the others run their DP ranks ``--headless`` from their first DP rank.
``--trust-remote-code``: K3's tokenizer (``TikTokenTokenizer``) is code in the checkpoint's
repository, not in transformers.

SGLang 0.5.23 (flags are the fields of ``sglang/srt/arg_groups/fields/*.py``; the recipe tests
check them in the wheel): ``--tp-size W --ep-size W`` (its EP group is then
the TP group over all ranks, which is the node directory's placement), ``--enable-dp-attention
--dp-size D`` for data-parallel attention, and ``--nnodes``/``--node-rank``/``--dist-init-addr``
across nodes.

``--load-format k3ckpt`` (vLLM only, ``guard=True``): the loader k3ckpt's vLLM plugin registers
(:mod:`k3ckpt.engine`). In every rank, before the first weight byte, it refuses a launch the
directory was not written for, and before the first token bytes that differ from their digests.
It exists only where the plugin is installed beside vLLM (:func:`guard_installed`): a line that
names it elsewhere makes vLLM stop on an unknown load format, so callers add it when asked or
when the plugin is found, and say what the line lacks otherwise (:data:`UNGUARDED`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping

from ..errors import TopologyError
from ..format.topology import require_engine_nodes

ENGINES = ("vllm", "sglang")
#: Printed instead of the leader's address when neither ``--leader-address`` nor the launcher says it.
LEADER_PLACEHOLDER = "LEADER_ADDRESS"
#: Where the launchers put the leader's address: LeaderWorkerSet's, then the torchrun/SLURM convention.
LEADER_VARIABLES = ("LWS_LEADER_ADDRESS", "MASTER_ADDR")
#: vLLM's ``--data-parallel-rpc-port`` default is 29550; node-init.sh has always used this one.
DEFAULT_RPC_PORT = 13345
#: The port in SGLang's ``--dist-init-addr HOST:PORT``.
DEFAULT_SGLANG_PORT = 5000
#: The ``--load-format`` k3ckpt's vLLM plugin registers, and the plugin's entry point (pyproject.toml).
LOAD_FORMAT = "k3ckpt"
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_ENTRY = "k3ckpt.engine.vllm:register"
#: What a vLLM serve line without ``--load-format k3ckpt`` lacks, said where such a line is printed.
UNGUARDED = ("without --load-format k3ckpt vLLM checks neither the launch against this directory's topology nor "
             "the bytes it reads against their digests (install 'k3ckpt[vllm]' in the engine's environment, "
             "or --guard when the engine runs elsewhere with it)")


def guard_installed() -> bool:
    """True when vLLM started from this environment has the ``k3ckpt`` load format: vLLM is
    importable here and k3ckpt's entry point is in vLLM's plugin group (what its
    ``load_general_plugins`` loads in every process). Read from installed metadata, without
    importing vLLM (that takes seconds and imports torch)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from importlib.metadata import entry_points  # 15 ms to import: only where vLLM is installed

    return any(ep.value.replace(" ", "") == PLUGIN_ENTRY for ep in entry_points(group=PLUGIN_GROUP))


def resolve_guard(guard: bool | None, engine: str) -> bool:
    """Whether ``engine``'s serve line loads with ``--load-format k3ckpt``: ``guard`` as asked,
    else (None) when the plugin is installed here and the engine is vLLM.

    Raises:
        TopologyError: ``guard`` asked of an engine other than vLLM.
    """
    if guard and engine != "vllm":
        raise TopologyError(f"--guard is vLLM's --load-format {LOAD_FORMAT}: {engine} has no guarded load")
    return guard if guard is not None else engine == "vllm" and guard_installed()


def leader_from_env(environ: Mapping[str, str]) -> str | None:
    """The leader's address the launcher set (:data:`LEADER_VARIABLES`, first found), else None:
    the default of ``--leader-address`` in ``preflight`` and ``serve-command`` alike, so both
    print the same line."""
    return next((environ[v].strip() for v in LEADER_VARIABLES if environ.get(v, "").strip()), None)


def serve_command(
    path: str | os.PathLike[str],
    *,
    tp: int,
    dp: int = 1,
    placement: str = "linear",
    node: int = 0,
    gpus_per_node: int | None = None,
    leader_address: str | None = None,
    rpc_port: int = DEFAULT_RPC_PORT,
    served_model_name: str | None = None,
    engine: str = "vllm",
    guard: bool = False,
) -> list[str]:
    """The argv that serves node ``node``'s directory ``path`` with ``engine``'s expert parallelism
    over ``tp x dp`` ranks, ``gpus_per_node`` of them per node (default: all on one node);
    ``guard``: with ``--load-format k3ckpt`` (vLLM only).

    Example::

        >>> serve_command("/nvme/k3", tp=8, dp=2, node=1, gpus_per_node=8, leader_address="gpu01")[:4]
        ['vllm', 'serve', '/nvme/k3', '--trust-remote-code']

    Raises:
        TopologyError: several nodes that the node format's launch cannot run
            (:func:`~k3ckpt.format.topology.require_engine_nodes`: a TP group across two nodes, a
            partial last node), the node is out of range, an engine other than :data:`ENGINES`,
            ``guard`` for SGLang (it has no load format of k3ckpt's).
    """
    if engine not in ENGINES:
        raise TopologyError(f"unknown engine {engine!r}: use {' or '.join(ENGINES)}")
    if guard and engine != "vllm":
        raise TopologyError(f"--load-format {LOAD_FORMAT} is a vLLM plugin: {engine} has no guarded load")
    world = tp * dp
    per_node = gpus_per_node or world
    nodes = -(-world // per_node)
    if not 0 <= node < nodes:
        raise TopologyError(f"node {node} out of range 0..{nodes - 1} ({world} ranks, {per_node} per node)")
    require_engine_nodes(tp, world, per_node, f"--tp {tp} --dp {dp}")  # the rule plan, reshard and fetch apply
    leader = leader_address or LEADER_PLACEHOLDER
    if engine == "sglang":
        return _sglang(str(path), tp, dp, node, nodes, leader, served_model_name)
    argv = ["vllm", "serve", str(path)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    argv += ["--trust-remote-code", "--tensor-parallel-size", str(tp), "--enable-expert-parallel",
             "--enable-ep-weight-filter", "--expert-placement-strategy", placement]
    if dp > 1:
        argv += ["--data-parallel-size", str(dp)]
    if nodes > 1:
        dp_local = per_node // tp
        argv += ["--data-parallel-size-local", str(dp_local), "--data-parallel-address", leader,
                 "--data-parallel-rpc-port", str(rpc_port)]
        if node > 0:
            argv += ["--headless", "--data-parallel-start-rank", str(node * dp_local)]
    if guard:
        argv += ["--load-format", LOAD_FORMAT]
    return argv


def _sglang(path: str, tp: int, dp: int, node: int, nodes: int, leader: str, name: str | None) -> list[str]:
    world = tp * dp
    argv = ["python", "-m", "sglang.launch_server", "--model-path", path]
    if name:
        argv += ["--served-model-name", name]
    argv += ["--trust-remote-code", "--tp-size", str(world), "--ep-size", str(world)]
    if dp > 1:  # SGLang's TP group spans every rank; DP applies to attention only
        argv += ["--enable-dp-attention", "--dp-size", str(dp)]
    if nodes > 1:
        argv += ["--nnodes", str(nodes), "--node-rank", str(node), "--dist-init-addr", f"{leader}:{DEFAULT_SGLANG_PORT}"]
    return argv
