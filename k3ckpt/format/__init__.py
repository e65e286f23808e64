"""What a checkpoint *is*, read from its files: the safetensors header reader and writer,
``config.json``, tensor roles, the checkpoint model, the TP/EP topology math, the inspect report,
the names of the rank/node layouts and the file plan of a node directory.

Everything here reads headers and JSON only (no tensor data) and imports nothing above it:
``integrity``, ``hub``, ``mx`` and ``deploy`` build on it.
"""

from typing import TYPE_CHECKING

from ..utils.lazy import lazy_exports

__all__ = [
    "Checkpoint",
    "InspectReport",
    "Kind",
    "ModelConfig",
    "NodeDir",
    "NodeFile",
    "RankSelection",
    "RankTensors",
    "Role",
    "ShardHeader",
    "TensorInfo",
    "TensorSpec",
    "Topology",
    "build_header",
    "classify",
    "inspect_checkpoint",
    "load_config",
    "open_checkpoint",
    "plan_node_dir",
    "read_header",
    "read_node_marker",
    "tensor_nbytes",
    "tensors_for_ranks",
]

# Each name is imported from its module on first use (see lazy_exports): ``import
# k3ckpt.format.<module>`` does not import the rest of the package.
__getattr__, __dir__ = lazy_exports(__name__, {
    "Checkpoint": ".checkpoint",
    "InspectReport": ".inspect",
    "Kind": ".roles",
    "ModelConfig": ".config",
    "NodeDir": ".nodedir",
    "NodeFile": ".nodedir",
    "RankSelection": ".topology",
    "RankTensors": ".topology",
    "Role": ".roles",
    "ShardHeader": ".header",
    "TensorInfo": ".header",
    "TensorSpec": ".header",
    "Topology": ".topology",
    "build_header": ".header",
    "classify": ".roles",
    "inspect_checkpoint": ".inspect",
    "load_config": ".config",
    "open_checkpoint": ".checkpoint",
    "plan_node_dir": ".nodedir",
    "read_header": ".header",
    "read_node_marker": ".layout",
    "tensor_nbytes": ".header",
    "tensors_for_ranks": ".topology",
})

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from .checkpoint import Checkpoint, open_checkpoint
    from .config import ModelConfig, load_config
    from .header import ShardHeader, TensorInfo, TensorSpec, build_header, read_header, tensor_nbytes
    from .inspect import InspectReport, inspect_checkpoint
    from .layout import read_node_marker
    from .nodedir import NodeDir, NodeFile, plan_node_dir
    from .roles import Kind, Role, classify
    from .topology import RankSelection, RankTensors, Topology, tensors_for_ranks
