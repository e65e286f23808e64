"""What a checkpoint *is*, read from its files: the safetensors header reader and writer,
``config.json``, tensor roles, the checkpoint model, the TP/EP topology math, the inspect report,
the names of the rank/node layouts and the file plan of a node directory.

Everything here reads headers and JSON only (no tensor data) and imports nothing above it:
``integrity``, ``hub``, ``mx`` and ``deploy`` build on it.
"""

from .checkpoint import Checkpoint, open_checkpoint
from .config import ModelConfig, load_config
from .header import ShardHeader, TensorInfo, TensorSpec, build_header, read_header, tensor_nbytes
from .inspect import InspectReport, inspect_checkpoint
from .layout import read_node_marker
from .nodedir import NodeDir, NodeFile, plan_node_dir
from .roles import Kind, Role, classify
from .topology import RankSelection, RankTensors, Topology, tensors_for_ranks

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
