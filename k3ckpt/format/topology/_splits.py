"""How a rank holds one tensor: whole (``None``), a :class:`Split` of one dimension, or an
:class:`ExpertSlice` of a stacked expert tensor - with the block rules of its quantization
(MXFP4 32-element blocks, FP8 scale blocks) that a split must not cut (:func:`tensor_split`,
:func:`split_range`, :func:`is_mxfp4`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import SplitError, TopologyError
from ..roles import TP, Kind, Role
from ._ranks import RankInfo, Topology, is_int

#: Elements per MXFP4 block (OCP MX): one E8M0 scale per 32 values, two values per byte.
MX_BLOCK = 32

# Per-tensor (scalar) quantization parameters: identical for every slice of the weight.
_WHOLE_PARTS = frozenset({"input_scale", "weight_global_scale", "input_global_scale"})
_MX_SCALE_DTYPES = frozenset({"U8", "F8_E8M0"})


@dataclass(frozen=True)
class Split:
    """Part ``index`` of ``parts`` of dimension ``dim`` (``parts > 1`` always: a whole tensor
    is ``None``, never ``Split(parts=1)``)."""

    dim: int
    index: int
    parts: int

    def range(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """``(start, stop)`` along :attr:`dim` of a tensor of ``shape``."""
        return split_range(shape[self.dim], self.parts, self.index, dim=self.dim)

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The sliced shape."""
        s = list(shape)
        s[self.dim] //= self.parts
        return tuple(s)

    def to_json(self) -> dict:
        return {"dim": self.dim, "index": self.index, "parts": self.parts}


@dataclass(frozen=True)
class ExpertSlice:
    """A stacked expert tensor (all experts along dim 0, gpt-oss): the rank keeps the rows of
    :attr:`experts` (contiguous only for ``linear`` placement), each further cut by
    :attr:`split` when ``moe_tp > 1`` (its ``dim`` counts in the stacked tensor's dims)."""

    experts: tuple[int, ...]
    split: Split | None = None
    dim: int = field(default=0, init=False)

    @property
    def contiguous(self) -> bool:
        e = self.experts
        return bool(e) and e[-1] - e[0] == len(e) - 1

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        s = (len(self.experts),) + tuple(shape[1:])
        return self.split.shape(s) if self.split else s

    def to_json(self) -> dict:
        return {"dim": 0, "experts": list(self.experts), "split": self.split.to_json() if self.split else None}


Placement = Split | ExpertSlice | None


def split_range(n: int, parts: int, index: int, *, name: str | None = None, dim: int | None = None) -> tuple[int, int]:
    """``[index*n/parts, (index+1)*n/parts)``. Uneven splits are errors (no padding, no silent
    unevenness), naming ``name`` when given."""
    if not is_int(parts) or parts < 1:
        raise TopologyError(f"split into {parts!r} parts: must be a positive integer")
    if not 0 <= index < parts:
        raise TopologyError(f"split index {index} out of range 0..{parts - 1}")
    if n % parts:
        where = f"dim {dim} " if dim is not None else "dimension "
        raise SplitError(name, f"{where}of size {n} does not split {parts} ways evenly")
    step = n // parts
    return index * step, (index + 1) * step


def is_mxfp4(dtype: str, part: str) -> bool:
    """Whether a tensor is the packed data or E8M0 scales of an MXFP4 weight (K3's
    ``weight_packed`` U8 [out, in/2] / ``weight_scale`` U8 [out, in/32]). An int4
    ``pack-quantized`` I32 ``weight_packed`` or a float per-channel scale is not."""
    return (part == "weight_packed" and dtype in ("U8", "I8")) or (part == "weight_scale" and dtype in _MX_SCALE_DTYPES)


def _dim_split(
    name: str, part: str, shape: tuple[int, ...], dim: int, parts: int, index: int,
    mxfp4: bool, fp8_block: tuple[int, ...] | None,
) -> Split | None:
    """Split ``dim`` of a tensor ``parts`` ways, with the block rules of its quantization."""
    if parts == 1 or part in _WHOLE_PARTS or dim >= len(shape):
        return None  # scalars and per-tensor parameters are the same for every slice
    n = shape[dim]
    last = dim == len(shape) - 1  # the input dim of a 2-D [out, in] weight and its scales
    if part == "weight_scale" and not mxfp4 and n == 1:
        return None  # a per-channel scale broadcasts along the input dim
    if mxfp4 and last and dim > 0:
        if part == "weight_packed" and n % (parts * (MX_BLOCK // 2)):
            raise SplitError(name, (
                f"MXFP4 packed dim {dim} of {n} bytes ({2 * n} values) does not split {parts} ways on "
                f"{MX_BLOCK}-element block boundaries: needs a multiple of {parts * MX_BLOCK // 2} bytes"))
        if part == "weight_scale" and n % parts:
            raise SplitError(name, (
                f"MXFP4 scale dim {dim} of {n} blocks does not split {parts} ways: "
                f"{MX_BLOCK}-element blocks must stay whole"))
    if part == "weight_scale_inv" and n % parts:
        raise SplitError(name, (
            f"FP8 block scale dim {dim} of {n} blocks does not split {parts} ways: "
            f"the weight's scale blocks must stay whole"))
    split_range(n, parts, index, name=name, dim=dim)
    if fp8_block and part == "weight" and dim < len(fp8_block) and (n // parts) % fp8_block[dim]:
        raise SplitError(name, (
            f"FP8 block-quantized dim {dim} of size {n} split {parts} ways gives parts of {n // parts}, "
            f"not a multiple of the {fp8_block[dim]}-element scale block"))
    return Split(dim, index, parts)


# gpt-oss stacked tensors: blocks [E, out, in/32, 16], scales [E, out, in/32], bias [E, out],
# plain weight [E, in, out] (transposed, as transformers stores it).
_STACKED_TP_DIM: dict[tuple[str | None, str], int | None] = {
    ("gate_up", "blocks"): 1, ("gate_up", "scales"): 1, ("gate_up", "bias"): 1, ("gate_up", "weight"): 2,
    ("down", "blocks"): 2, ("down", "scales"): 2, ("down", "bias"): None, ("down", "weight"): 1,
}


def tensor_split(
    name: str,
    role: Role,
    shape: tuple[int, ...],
    topo: Topology,
    rank: RankInfo,
    *,
    mxfp4: bool = False,
    fp8_block: tuple[int, ...] | None = None,
) -> Placement:
    """How rank ``rank`` holds tensor ``name`` (assuming it holds it at all - routed experts
    live only on their owners; :func:`tensors_for_rank` decides that).

    Args:
        mxfp4: the tensor is MXFP4 packed data / E8M0 scales (see :func:`is_mxfp4`), so a split
            of its input dim must keep 32-element blocks whole.
        fp8_block: the (out, in) block size of a block-quantized FP8 weight (one that has a
            ``weight_scale_inv``), whose split boundaries must fall on block boundaries.

    Returns:
        ``None`` for a whole tensor, a :class:`Split`, or an :class:`ExpertSlice` for a stacked
        expert tensor.

    Raises:
        SplitError: the split is uneven or would cut a quantization block.
    """
    if role.kind == Kind.ROUTED_EXPERT:
        if role.expert is None:
            return _stacked_split(name, role, shape, topo, rank)
        if topo.moe_tp == 1:
            return None
        if role.proj == "down":
            if role.part == "bias":
                return None  # row-parallel: added once after the reduction
            dim = 1
        else:  # gate / up / fused gate_up: output rows
            dim = 0
        return _dim_split(name, role.part, shape, dim, topo.moe_tp, rank.moe_tp_rank, mxfp4, fp8_block)
    if topo.tp == 1 or role.tp not in (TP.COLUMN, TP.ROW, TP.VOCAB):
        return None
    dim = 1 if role.tp == TP.ROW else 0
    return _dim_split(name, role.part, shape, dim, topo.tp, rank.tp_rank, mxfp4, fp8_block)


def _stacked_split(name: str, role: Role, shape: tuple[int, ...], topo: Topology, rank: RankInfo) -> Placement:
    if not shape or shape[0] != topo.num_experts:
        raise SplitError(name, f"stacked expert tensor of shape {list(shape)} does not have {topo.num_experts} experts in dim 0")
    inner = None
    if topo.moe_tp > 1:
        dim = _STACKED_TP_DIM.get((role.proj, role.part))
        if dim is not None:
            # blocks/scales count whole 32-element blocks, so an even split keeps blocks whole
            inner = _dim_split(name, role.part, shape, dim, topo.moe_tp, rank.moe_tp_rank, False, None)
    if inner is None and len(rank.experts) == topo.num_experts:
        return None
    return ExpertSlice(rank.experts, inner)

