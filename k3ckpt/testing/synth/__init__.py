"""Deterministic synthetic checkpoints shaped like Kimi K3 (and, so nothing gets hard-wired to
one family, like gpt-oss and Kimi-K2/DeepSeek-V3 FP8).

A synthetic checkpoint has the real config structure, the real tensor names, dtypes and shard
naming; its MXFP4 experts are quantized from seeded random weights with compressed-tensors'
MXFP4 rule (the one that made K3's experts; see ``quantize_mxfp4``), and
each expert's six tensors are adjacent in one shard. Every tensor's data depends only on the
seed and its name, so shards can be written in parallel and any one tensor can be regenerated.

``headers_only`` writes real headers followed by a hole (``ftruncate``): the ``k3-full`` preset
is the real K3 inventory - 93 layers, 896 experts, 96 shards, ~497k tensors, ~1.56 TB apparent -
at almost no disk cost, so every metadata path can be exercised at true scale. Holes read as
zeros, which is valid MXFP4 (code 0, scale 2**-127).

Where things are: ``_spec`` (:class:`SynthSpec`, :data:`PRESETS`, :func:`spec_from_preset`),
``_plan`` (the tensors of a spec and how their bytes are made: :class:`Planner`), ``_files``
(shard names and grouping, ``config.json``, the side files), ``_write`` (:func:`synthesize`).
"""

from ._files import assign_shards, make_config, shard_name
from ._plan import Maker, PlannedTensor, Planner, Unit, tensor_rng
from ._spec import PRESETS, SynthSpec, spec_from_preset
from ._write import SYNTH_MARK, SynthResult, render_synth, synthesize

__all__ = [
    "PRESETS",
    "SYNTH_MARK",
    "Maker",
    "PlannedTensor",
    "Planner",
    "SynthResult",
    "SynthSpec",
    "Unit",
    "assign_shards",
    "make_config",
    "render_synth",
    "shard_name",
    "spec_from_preset",
    "synthesize",
    "tensor_rng",
]
