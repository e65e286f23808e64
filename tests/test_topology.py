"""Topology math: rank-layout.md's examples, vLLM's expert placement, split completeness, block
rules for MXFP4 and FP8, rank selection, launcher environments, and per-rank inventories."""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3ckpt.errors import EXIT_CANNOT_RUN, K3ckptError
from k3ckpt.format.checkpoint import open_checkpoint
from k3ckpt.format.roles import Kind, Role, classify
from k3ckpt.format.topology import (
    ExpertSlice,
    RankSelection,
    Split,
    SplitError,
    Topology,
    TopologyError,
    index_of,
    parse_ranks,
    rank_from_env,
    ranks_of_node,
    require_engine_nodes,
    split_range,
    tensor_split,
    tensors_for_rank,
    tensors_for_ranks,
)

K3_EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.5.{}.{}"


def role_of(name: str) -> Role:
    r = classify(name)
    assert r.kind != Kind.UNKNOWN, name
    return r


# -- the contract's examples --------------------------------------------------------------------


def test_ep8_tp2_is_tp2_dp4_with_expert_parallel() -> None:
    topo = Topology.make(ep=8, tp=2, num_experts=896)
    assert (topo.world_size, topo.moe_tp, topo.dp) == (8, 1, 4)
    ranks = topo.ranks()
    assert [r.tp_rank for r in ranks] == [0, 1] * 4
    assert [r.dp_rank for r in ranks] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r.ep_rank for r in ranks] == list(range(8))
    assert all(len(r.experts) == 112 for r in ranks)
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    assert [tensor_split(name, role_of(name), (128, 256), topo, r) for r in ranks[:2]] == [
        Split(0, 0, 2), Split(0, 1, 2)]
    # experts are whole on their owner (moe_tp 1)
    w2 = K3_EXPERT.format("w2", "weight_packed")
    assert tensor_split(w2, role_of(w2), (7168, 1536), topo, ranks[0]) is None


def test_tp8_ep8() -> None:
    topo = Topology.make(ep=8, tp=8, num_experts=896)
    assert (topo.world_size, topo.moe_tp) == (8, 1)
    assert [r.tp_rank for r in topo.ranks()] == list(range(8))
    assert [r.experts[0] for r in topo.ranks()] == [112 * i for i in range(8)]


def test_tp16_ep8_splits_each_expert_two_ways() -> None:
    topo = Topology.make(ep=8, tp=16, num_experts=896)
    assert (topo.world_size, topo.moe_tp) == (16, 2)
    r0, r1 = topo.rank_info(0), topo.rank_info(1)
    assert (r0.ep_rank, r0.moe_tp_rank, r1.ep_rank, r1.moe_tp_rank) == (0, 0, 0, 1)
    assert r0.experts == r1.experts == tuple(range(112))
    assert topo.owner_ranks(112) == [2, 3]
    w1 = K3_EXPERT.format("w1", "weight_packed")
    w2 = K3_EXPERT.format("w2", "weight_packed")
    assert tensor_split(w1, role_of(w1), (3072, 1792), topo, r1, mxfp4=True) == Split(0, 1, 2)
    assert tensor_split(w2, role_of(w2), (3584, 1536), topo, r1, mxfp4=True) == Split(1, 1, 2)


def test_tp8_alone_slices_every_expert_eight_ways() -> None:
    topo = Topology.make(tp=8, num_experts=896)
    assert (topo.ep, topo.world_size, topo.moe_tp) == (1, 8, 8)
    w3 = K3_EXPERT.format("w3", "weight_scale")
    w2 = K3_EXPERT.format("w2", "weight_scale")
    for r in topo.ranks():
        assert r.experts == tuple(range(896))
        assert tensor_split(w3, role_of(w3), (3072, 112), topo, r, mxfp4=True) == Split(0, r.rank, 8)
        assert tensor_split(w2, role_of(w2), (3584, 96), topo, r, mxfp4=True) == Split(1, r.rank, 8)


def test_to_json_has_the_contract_fields() -> None:
    topo = Topology.make(ep=4, tp=2, num_experts=10, placement="round_robin")
    assert topo.to_json() == {
        "world_size": 4, "ep": 4, "tp": 2, "moe_tp": 1, "expert_placement": "round_robin",
        "num_experts": 10, "experts_by_rank": [[0, 4, 8], [1, 5, 9], [2, 6], [3, 7]]}


# -- expert placement ---------------------------------------------------------------------------


def vllm_determine_expert_map(ep_size: int, ep_rank: int, global_num_experts: int,
                              strategy: str = "linear") -> tuple[int, list[int] | None]:
    """vLLM's determine_expert_map, transcribed with lists for torch tensors."""
    assert ep_size > 0
    if ep_size == 1:
        return (global_num_experts, None)
    base_experts = global_num_experts // ep_size
    remainder = global_num_experts % ep_size
    local_num_experts = base_experts + 1 if ep_rank < remainder else base_experts
    expert_map = [-1] * global_num_experts
    if strategy == "linear":
        start_idx = ep_rank * base_experts + min(ep_rank, remainder)
        for i in range(local_num_experts):
            expert_map[start_idx + i] = i
    elif strategy == "round_robin":
        for i, e in enumerate(range(ep_rank, global_num_experts, ep_size)):
            expert_map[e] = i
    return (local_num_experts, expert_map)


def local_experts(expert_map: list[int]) -> list[int]:
    by_local = sorted((local, g) for g, local in enumerate(expert_map) if local >= 0)
    return [g for _, g in by_local]


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
@pytest.mark.parametrize(("n", "ep"), [(896, 8), (896, 7), (10, 4), (896, 896), (7, 3)])
def test_placement_matches_vllm(n: int, ep: int, strategy: str) -> None:
    topo = Topology.make(ep=ep, num_experts=n, placement=strategy)
    got = topo.experts_by_ep_rank()
    for e in range(ep):
        count, expert_map = vllm_determine_expert_map(ep, e, n, strategy)
        assert expert_map is not None
        assert got[e] == local_experts(expert_map)
        assert len(got[e]) == count


def test_linear_remainder_goes_to_the_first_ranks() -> None:
    assert Topology.make(ep=4, num_experts=10).experts_by_ep_rank() == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert Topology.make(ep=1, num_experts=3).experts_by_ep_rank() == [[0, 1, 2]]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 1200), data=st.data())
def test_every_expert_has_exactly_one_owner(n: int, data: st.DataObject) -> None:
    ep = data.draw(st.integers(1, n))
    placement = data.draw(st.sampled_from(["linear", "round_robin"]))
    topo = Topology.make(ep=ep, num_experts=n, placement=placement)
    lists = topo.experts_by_ep_rank()
    assert len(lists) == ep
    flat = [x for lst in lists for x in lst]
    assert sorted(flat) == list(range(n))
    assert max(map(len, lists)) - min(map(len, lists)) <= 1
    for e in data.draw(st.lists(st.integers(0, n - 1), max_size=20)):
        (owner,) = topo.owner_ep_ranks(e)
        assert e in lists[owner]


# -- splits and completeness --------------------------------------------------------------------


def test_split_range() -> None:
    assert [split_range(12, 3, i) for i in range(3)] == [(0, 4), (4, 8), (8, 12)]
    assert split_range(5, 1, 0) == (0, 5)
    with pytest.raises(SplitError, match=r"^tensor 'x\.weight': dim 1 of size 10 does not split 4 ways evenly$"):
        split_range(10, 4, 0, name="x.weight", dim=1)
    with pytest.raises(TopologyError, match="index 3 out of range 0..2"):
        split_range(12, 3, 3)


# Tensors of each split rule, with the dim their split uses (None: replicated).
RULE_TENSORS = {
    "language_model.model.layers.0.self_attn.q_proj.weight": 0,  # column
    "model.layers.0.self_attn.q_proj.bias": 0,  # 1-D column-parallel bias
    "language_model.model.layers.0.self_attn.o_proj.weight": 1,  # row
    "model.layers.0.self_attn.o_proj.bias": None,  # row-parallel bias: added once
    "language_model.model.embed_tokens.weight": 0,  # vocab
    "language_model.model.layers.0.self_attn.f_a_proj.weight": None,
    "language_model.model.layers.0.self_attn.dt_bias": None,
    "language_model.model.layers.0.self_attn.q_conv1d.weight": None,
    "language_model.model.layers.1.block_sparse_moe.gate.weight": None,
    "language_model.model.layers.1.block_sparse_moe.routed_expert_up_proj.weight": None,
    "language_model.model.layers.0.mlp_res_proj.weight": None,
    "vision_tower.encoder.blocks.0.wqkv.weight": None,
    "mm_projector.proj.0.weight": None,
}


@pytest.mark.parametrize(("name", "dim"), RULE_TENSORS.items())
def test_which_tensors_split(name: str, dim: int | None) -> None:
    topo = Topology.make(ep=2, tp=2, num_experts=8)
    shape = (64, 64) if dim != 0 or "bias" not in name else (64,)
    got = tensor_split(name, role_of(name), shape, topo, topo.rank_info(1))
    assert got == (None if dim is None else Split(dim, 1, 2))


def rank_pieces(name: str, shape: tuple[int, ...], topo: Topology, placement: str) -> list:
    """(rank, split) for every rank holding (a piece of) ``name``, a tensor of expert 3 when
    per-expert."""
    role = role_of(name)
    out = []
    for r in topo.ranks():
        if role.expert is not None and role.expert not in r.experts:
            continue
        out.append((r.rank, tensor_split(name, role, shape, topo, r)))
    return out


SPLIT_NAMES = [
    "language_model.model.layers.0.self_attn.q_proj.weight",
    "language_model.model.layers.0.self_attn.o_proj.weight",
    "language_model.lm_head.weight",
    "language_model.model.layers.0.input_layernorm.weight",
    "language_model.model.layers.1.block_sparse_moe.experts.3.w1.weight",
    "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight",
    "model.layers.1.mlp.experts.3.down_proj.weight",
]


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(SPLIT_NAMES),
    ep=st.sampled_from([1, 2, 3, 4]),
    tp=st.sampled_from([1, 2, 3, 4, 6]),
    mult=st.sampled_from([1, 2, 3]),
    shape=st.tuples(st.integers(1, 48), st.integers(1, 48)),
    placement=st.sampled_from(["linear", "round_robin"]),
)
def test_splits_reassemble_every_tensor(name: str, ep: int, tp: int, mult: int,
                                        shape: tuple[int, int], placement: str) -> None:
    """Concatenating the distinct pieces the ranks hold along the split dim gives the tensor
    back exactly, with no overlap; an uneven split is an error, never a silent loss."""
    import math

    topo = Topology.make(ep=ep, tp=tp, world_size=math.lcm(ep, tp) * mult, placement=placement, num_experts=12)
    data = np.arange(math.prod(shape)).reshape(shape)
    try:
        pieces = rank_pieces(name, shape, topo, placement)
    except SplitError as e:
        assert name in str(e)
        parts = topo.moe_tp if ".experts." in name else topo.tp
        assert shape[0] % parts or shape[1] % parts
        return
    assert pieces, "someone must hold every tensor"
    splits = {s for _, s in pieces}
    if splits == {None}:
        return
    assert None not in splits
    (dim,) = {s.dim for s in splits}
    (parts,) = {s.parts for s in splits}
    assert parts > 1 and sorted(s.index for s in splits) == list(range(parts))
    ranges = sorted(s.range(shape) for s in splits)
    assert ranges[0][0] == 0 and ranges[-1][1] == shape[dim]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    slices = [np.take(data, range(*s.range(shape)), axis=dim) for s in sorted(splits, key=lambda s: s.index)]
    assert all(x.shape == s.shape(shape) for x, s in zip(slices, sorted(splits, key=lambda s: s.index)))
    assert np.array_equal(np.concatenate(slices, axis=dim), data)
    # every piece index is held by the same number of ranks (replicas), none is missing
    holders = defaultdict(int)
    for _, s in pieces:
        holders[s.index] += 1
    assert len(set(holders.values())) == 1


# -- block rules --------------------------------------------------------------------------------


def test_mxfp4_down_split_keeps_32_element_blocks() -> None:
    topo = Topology.make(tp=4, num_experts=8)  # moe_tp 4
    r = topo.rank_info(3)
    packed = K3_EXPERT.format("w2", "weight_packed")
    scale = K3_EXPERT.format("w2", "weight_scale")
    # in = 256: 8 blocks, 2 per part -> fine
    assert tensor_split(packed, role_of(packed), (128, 128), topo, r, mxfp4=True) == Split(1, 3, 4)
    assert tensor_split(scale, role_of(scale), (128, 8), topo, r, mxfp4=True) == Split(1, 3, 4)
    # in = 64: 32 packed bytes split 4 ways evenly (8 bytes = 16 values), but that cuts blocks
    with pytest.raises(SplitError, match=r"MXFP4 packed dim 1 of 32 bytes \(64 values\) does not split 4 ways "
                                         r"on 32-element block boundaries: needs a multiple of 64 bytes") as ei:
        tensor_split(packed, role_of(packed), (128, 32), topo, r, mxfp4=True)
    assert ei.value.tensor == packed and packed in str(ei.value)
    with pytest.raises(SplitError, match=r"MXFP4 scale dim 1 of 2 blocks does not split 4 ways"):
        tensor_split(scale, role_of(scale), (128, 2), topo, r, mxfp4=True)
    # without the MXFP4 flag the same packed bytes would split (an I32 int4 packing has no such rule)
    assert tensor_split(packed, role_of(packed), (128, 32), topo, r, mxfp4=False) == Split(1, 3, 4)
    # gate/up split on output rows: blocks run along the input dim, so rows need only divide
    w1 = K3_EXPERT.format("w1", "weight_packed")
    assert tensor_split(w1, role_of(w1), (64, 8), topo, r, mxfp4=True) == Split(0, 3, 4)


def test_fp8_block_scales_stay_whole() -> None:
    topo = Topology.make(tp=2, num_experts=8)
    r = topo.rank_info(1)
    w = "model.layers.0.self_attn.o_proj.weight"
    s = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    assert tensor_split(w, role_of(w), (256, 512), topo, r, fp8_block=(128, 128)) == Split(1, 1, 2)
    assert tensor_split(s, role_of(s), (2, 4), topo, r) == Split(1, 1, 2)
    with pytest.raises(SplitError, match=r"^tensor 'model.layers.0.self_attn.o_proj.weight': FP8 block-quantized "
                                         r"dim 1 of size 384 split 2 ways gives parts of 192, not a multiple of "
                                         r"the 128-element scale block$"):
        tensor_split(w, role_of(w), (256, 384), topo, r, fp8_block=(128, 128))
    with pytest.raises(SplitError, match=r"FP8 block scale dim 1 of 3 blocks does not split 2 ways"):
        tensor_split(s, role_of(s), (2, 3), topo, r)
    # a per-channel scale broadcasts along the input dim: replicated, not an error
    ws = "model.layers.0.self_attn.o_proj.weight_scale"
    assert tensor_split(ws, role_of(ws), (256, 1), topo, r) is None


# -- invalid topologies -------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ep": 3, "world_size": 8}, "--ep 3 does not divide world size 8"),
    ({"ep": 2, "tp": 3}, "--ep 2 does not divide world size 3 (the default max(ep, tp)); --world-size 6 would work"),
    ({"tp": 3, "world_size": 8}, "--tp 3 does not divide world size 8"),
    ({"ep": 1024, "num_experts": 896}, "ep 1024 exceeds 896 experts: ep ranks 896..1023 would hold no experts"),
    ({"placement": "random"}, "unknown expert placement 'random'; choose linear or round_robin"),
    ({"num_experts": 0}, "num_experts 0 must be at least 1: a model without routed experts has nothing to place"),
    ({"ep": 0}, "--ep 0 must be at least 1"),
    ({"tp": -2}, "--tp -2 must be at least 1"),
    ({"world_size": 0}, "--world-size 0 must be at least 1"),
    ({"ep": 2.0}, "--ep 2.0 is not an integer"),
])
def test_invalid_topologies(kwargs: dict, message: str) -> None:
    args = {"num_experts": 896, **kwargs}
    with pytest.raises(TopologyError) as ei:
        Topology.make(**args)
    assert str(ei.value) == message
    assert isinstance(ei.value, K3ckptError) and ei.value.exit_code == EXIT_CANNOT_RUN


def test_direct_construction_validates_too() -> None:
    with pytest.raises(TopologyError, match="--ep 3 does not divide world size 8"):
        Topology(ep=3, tp=1, world_size=8, placement="linear", num_experts=896)


def test_rank_out_of_range() -> None:
    topo = Topology.make(ep=8, num_experts=16)
    with pytest.raises(TopologyError, match=r"rank 8 out of range 0..7"):
        topo.rank_info(8)
    with pytest.raises(TopologyError, match=r"expert 16 out of range 0..15"):
        topo.owner_ep_ranks(16)


# -- rank selection -----------------------------------------------------------------------------


def test_parse_ranks() -> None:
    assert parse_ranks("0-3,8", 16) == [0, 1, 2, 3, 8]
    assert parse_ranks(" 5 , 2-3,3,2 ", 8) == [2, 3, 5]
    assert parse_ranks("7", 8) == [7]


@pytest.mark.parametrize(("spec", "message"), [
    ("", "--ranks is empty; give ranks like 0-3,8"),
    ("0-3,x", "--ranks '0-3,x': 'x' is not a rank or a range a-b"),
    ("1,,2", "--ranks '1,,2': '' is not a rank or a range a-b"),
    ("-1", "--ranks '-1': '-1' is not a rank or a range a-b"),
    ("3-1", "--ranks '3-1': range 3-1 is reversed"),
    ("0-99999999999", "--ranks '0-99999999999': rank 99999999999 out of range 0..7 (world size 8)"),
    ("٣", "--ranks '٣': '٣' is not a rank or a range a-b"),
])
def test_parse_ranks_errors(spec: str, message: str) -> None:
    with pytest.raises(TopologyError) as ei:
        parse_ranks(spec, 8)
    assert str(ei.value) == message


def test_ranks_of_node() -> None:
    assert ranks_of_node(1, 8, 16) == list(range(8, 16))
    assert ranks_of_node(0, 8, 4) == [0, 1, 2, 3]  # --tp 4 on one 8-GPU node: a partial node
    assert ranks_of_node(2, 4, 10) == [8, 9]
    with pytest.raises(TopologyError) as ei:
        ranks_of_node(2, 8, 16)
    assert str(ei.value) == "--node 2 out of range: world size 16 with 8 GPUs per node has nodes 0..1"
    with pytest.raises(TopologyError, match="has node 0$"):
        ranks_of_node(1, 8, 8)
    with pytest.raises(TopologyError, match="--gpus-per-node 0 must be a positive integer"):
        ranks_of_node(0, 0, 8)
    topo = Topology.make(ep=16, tp=8, num_experts=896)
    assert [r.node for r in topo.ranks(gpus_per_node=8)] == [0] * 8 + [1] * 8


def test_rank_selection_defaults_and_resolution() -> None:
    sel = RankSelection()
    assert not sel.names_topology
    topo = sel.topology(16)
    assert (topo.ep, topo.tp, topo.world_size, topo.placement) == (1, 1, 1, "linear")
    assert sel.select(topo) == [0]
    sel = RankSelection(ep=4, tp=2, placement="round_robin", ranks=[3, 1])
    assert sel.names_topology and sel.ranks == (3, 1) and hash(sel) == hash(RankSelection(ep=4, tp=2,
                                                                                            placement="round_robin",
                                                                                            ranks=(3, 1)))
    topo = sel.topology(16)
    assert (topo.world_size, topo.placement) == (4, "round_robin") and sel.select(topo) == [1, 3]
    assert RankSelection(ep=8, node=1, gpus_per_node=4).select(RankSelection(ep=8).topology(16)) == [4, 5, 6, 7]
    assert RankSelection(world_size=2).names_topology


@pytest.mark.parametrize(("sel", "message"), [
    (RankSelection(ep=0), "--ep 0 must be at least 1"),
    (RankSelection(ep=3, tp=2), "--tp 2 does not divide world size 3"),
    (RankSelection(placement="random"), "unknown expert placement 'random'"),
    (RankSelection(ep=2, ranks="0-1", node=0, gpus_per_node=2), "give --ranks or --node, not both"),
    (RankSelection(ep=2, node=0), "--node needs --gpus-per-node"),
    (RankSelection(ep=2, ranks=[]), "no ranks selected"),
    # ranks of no topology: the world would be one rank holding everything - refused, not guessed
    (RankSelection(ranks="0"), "--ranks 0 selects ranks of a topology but none was given"),
    (RankSelection(node=0, gpus_per_node=4), "--node 0 selects ranks of a topology but none was given"),
])
def test_rank_selection_errors(sel: RankSelection, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        sel.select(sel.topology(16))


@pytest.mark.parametrize(("sel", "engine", "message"), [
    (RankSelection(ranks="0"), False, "--ranks 0 selects ranks of a topology but none was given"),
    (RankSelection(ranks=[0, 1]), False, "--ranks 0,1 selects ranks"),
    (RankSelection(node=1), True, "--node 1 selects ranks of a topology but none was given"),
    (RankSelection(ep=8, ranks="8"), False, r"rank 8 out of range 0\.\.7"),
    (RankSelection(tp=2, dp=2, node=1), True, "--node 1 out of range"),  # one node of 4 GPUs by default
    (RankSelection(ep=8, node=2, gpus_per_node=4), False, "--node 2 out of range"),
    (RankSelection(ep=8, tp=3), False, "--tp 3 does not divide world size 8"),
    (RankSelection(ep=4, tp=2, ranks="0", node=0), False, "give --ranks or --node, not both"),
    (RankSelection(ep=2, tp=2, world_size=4), True, "the engine format needs --ep equal to the world size"),
    (RankSelection(tp=4, dp=2, node=0, gpus_per_node=3), True, "a tensor-parallel group would span two nodes"),
])
def test_check_refuses_before_the_checkpoint_is_read(sel: RankSelection, engine: bool, message: str) -> None:
    # check() needs no expert count: fetch calls it before its first request
    with pytest.raises(TopologyError, match=message):
        sel.check(engine=engine)


@pytest.mark.parametrize(("sel", "engine"), [
    (RankSelection(), False),  # nothing selected: everything, the ordinary whole fetch/reshard
    (RankSelection(ep=1, ranks="0"), False),  # an explicit --ep 1 is a topology (the default, said aloud)
    (RankSelection(tp=2, ranks="1"), False),  # --tp alone is one too
    (RankSelection(world_size=4, ranks="3"), False),
    (RankSelection(tp=2, dp=2, node=0), True),
    (RankSelection(tp=2, dp=4, node=1, gpus_per_node=4), True),
    (RankSelection(ep=8, tp=2, node=1, gpus_per_node=4), False),
    (RankSelection(ep=8, tp=4, node=1, gpus_per_node=3), False),  # the rank layout's custom loaders: any grouping
    (RankSelection(tp=4, dp=1, node=0, gpus_per_node=8), True),  # one node, partly used: always runs
    (RankSelection(ep=1 << 20), False),  # more ep ranks than any real model's experts: checked later
])
def test_check_accepts_what_can_work(sel: RankSelection, engine: bool) -> None:
    sel.check(engine=engine)


@pytest.mark.parametrize(("sel", "rank_layout", "engine"), [
    # (ep, tp, world_size) under the rank layout's reading, and under vLLM's expert parallel
    (RankSelection(tp=8), (1, 8, 8), (8, 8, 8)),
    (RankSelection(tp=8, dp=2), (1, 8, 16), (16, 8, 16)),  # --dp: world size tp x dp
    (RankSelection(ep=16, tp=8), (16, 8, 16), (16, 8, 16)),
    (RankSelection(ep=8, tp=2, dp=4), (8, 2, 8), (8, 2, 8)),
    (RankSelection(tp=2, world_size=8), (1, 2, 8), (8, 2, 8)),
    (RankSelection(ep=4), (4, 1, 4), (4, 1, 4)),
    (RankSelection(), (1, 1, 1), (1, 1, 1)),
])
def test_dp_and_the_engine_reading(sel: RankSelection, rank_layout: tuple, engine: tuple) -> None:
    for eng, want in ((False, rank_layout), (True, engine)):
        topo = sel.topology(16, engine=eng)
        assert (topo.ep, topo.tp, topo.world_size) == want, eng
    assert sel.names_topology == (sel != RankSelection())
    assert RankSelection(dp=2).names_topology


@pytest.mark.parametrize(("sel", "message"), [
    (RankSelection(ep=4, tp=2, world_size=8), "the engine format needs --ep equal to the world size (vLLM's expert "
     "parallel uses ep = tp x dp = 8, not 4); use --ep 8 --tp 2, or --format rank for pre-split experts"),
    (RankSelection(ep=2, tp=2, dp=2), "ep = tp x dp = 4, not 2); use --tp 2 --dp 2, or --format rank"),
    (RankSelection(ep=8, tp=2, dp=2), "ep = tp x dp = 4, not 8); use --tp 2 --dp 2, or --tp 2 --dp 4 for ep 8"),
    (RankSelection(ep=8, tp=2, world_size=4), "use --ep 4 --tp 2, or --ep 8 --tp 2 --world-size 8 for ep 8"),
    (RankSelection(ep=3, tp=2, world_size=4), "ep = tp x dp = 4, not 3); use --ep 4 --tp 2$"),
    (RankSelection(tp=2, dp=2, world_size=8), "--world-size 8 is not tp x dp = 2 x 2 = 4"),
    (RankSelection(dp=0), "--dp 0 must be a positive integer"),
    (RankSelection(ep=32), "ep 32 exceeds 16 experts"),
])
def test_engine_refusals_name_the_nearest_valid_command(sel: RankSelection, message: str) -> None:
    with pytest.raises(TopologyError, match=re.escape(message).replace(r"\$", "$")):
        sel.topology(16, engine=True)


@pytest.mark.parametrize(("tp", "world", "gpus", "message"), [
    (4, 8, 3, "--gpus-per-node 3 with L: a tensor-parallel group would span two nodes (3 is not a multiple of --tp 4), "
              "which vLLM cannot launch; use L --gpus-per-node 4 (or 8)"),
    (4, 12, 8, "--gpus-per-node 8 with L: the last node would run 4 of its 8 GPUs, and vLLM runs the same number of "
               "data-parallel ranks on every node (--data-parallel-size-local); use L --gpus-per-node 4 (or 12)"),
    (2, 16, 6, "use L --gpus-per-node 4 (or 2, 8, 16)"),  # the largest that fits in the nodes given
    (8, 16, 4, "use L --gpus-per-node 8 (or 16)"),  # none that small: the smallest that works
    (4, 8, 4, None), (4, 8, 8, None), (4, 8, 16, None), (4, 4, 6, None), (1, 3, 1, None), (2, 6, 2, None),
])
def test_the_nodes_an_engine_launch_can_run(tp: int, world: int, gpus: int, message: str | None) -> None:
    """Issue #25: one rule (require_engine_nodes) for plan, reshard, fetch --node and serve-command:
    one node always runs; over several, GPUs per node a multiple of --tp dividing the world size."""
    if message is None:
        require_engine_nodes(tp, world, gpus, "L")
    else:
        with pytest.raises(TopologyError, match=re.escape(message) + "$"):
            require_engine_nodes(tp, world, gpus, "L")
    sel = RankSelection(tp=tp, dp=world // tp, gpus_per_node=gpus)
    for engine, refused in ((True, message is not None), (False, False)):
        if refused:
            with pytest.raises(TopologyError, match=f"--gpus-per-node {gpus} with --tp {tp} --dp {world // tp}: "):
                sel.check(engine=engine)
        else:
            sel.check(engine=engine)


# -- launcher environments ----------------------------------------------------------------------


def test_env_torchrun() -> None:
    env = rank_from_env({"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                         "GROUP_RANK": "1", "PATH": "/bin"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node) == (11, 16, 3, 8, 1)
    assert env.sources == {"rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK",
                           "local_world_size": "LOCAL_WORLD_SIZE", "node": "GROUP_RANK"}
    assert env.found and env.problems == ()


def test_env_slurm() -> None:
    env = rank_from_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                         "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "8"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node) == (9, 16, 1, 8, 1)
    assert env.sources["rank"] == "SLURM_PROCID" and env.sources["node"] == "SLURM_NODEID"


def test_env_torchrun_under_sbatch_keeps_both_candidates() -> None:
    # one torchrun per node under sbatch: SLURM_PROCID is the node, RANK the worker
    env = rank_from_env({"RANK": "13", "WORLD_SIZE": "16", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                         "SLURM_NODEID": "1"})
    assert (env.rank, env.world_size, env.node) == (13, 16, 1)
    assert env.candidates["rank"] == (("RANK", 13), ("SLURM_PROCID", 1))
    assert env.problems == ()


def test_env_kubernetes_indexed_job() -> None:
    env = rank_from_env({"JOB_COMPLETION_INDEX": "3"})
    assert env.node == 3 and env.rank is None and env.sources == {"node": "JOB_COMPLETION_INDEX"}


def test_env_nothing_and_problems() -> None:
    assert not rank_from_env({}).found
    env = rank_from_env({"RANK": "x", "SLURM_PROCID": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "8",
                         "LOCAL_WORLD_SIZE": "8"})
    assert env.rank == 4 and env.sources["rank"] == "SLURM_PROCID"
    assert env.problems == ("RANK='x' is not a non-negative integer", "SLURM_PROCID=4 is not below WORLD_SIZE=4",
                            "LOCAL_RANK=8 is not below LOCAL_WORLD_SIZE=8")


# -- what each rank holds -----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"ep": 2, "tp": 2}, {"ep": 4, "tp": 2}, {"tp": 2}, {"ep": 2, "tp": 4}, {"ep": 3, "tp": 2, "world_size": 6},
    {"ep": 16, "tp": 4, "placement": "round_robin"}, {"ep": 5, "placement": "round_robin"},
])
def test_tensors_for_rank_covers_k3_tiny(k3_tiny: Path, kwargs: dict) -> None:
    ckpt = open_checkpoint(k3_tiny)
    topo = Topology.make(**kwargs, num_experts=ckpt.config.num_experts)
    per_rank = tensors_for_ranks(ckpt, topo)
    assert set().union(*(r.tensors for r in per_rank.values())) == set(ckpt.tensors)
    holders: dict[str, list[int]] = defaultdict(list)
    for r, held in per_rank.items():
        for name in held.tensors:
            holders[name].append(r)
    routed = 0
    for name, role in ckpt.roles.items():
        if role.kind == Kind.ROUTED_EXPERT:
            assert holders[name] == topo.owner_ranks(role.expert), name
            routed += ckpt.tensors[name].nbytes
        else:
            assert holders[name] == list(range(topo.world_size)), name
    # each routed byte is held once (split moe_tp ways or whole); replicated bytes are equal
    assert sum(r.routed_bytes for r in per_rank.values()) == routed
    assert len({r.replicated_bytes for r in per_rank.values()}) == 1
    total = sum(t.nbytes for t in ckpt.tensors.values())
    r0 = per_rank[0]
    assert r0.split_bytes * topo.tp + r0.replicated_bytes + routed == total
    # the same index answers like the Checkpoint did
    assert tensors_for_rank(index_of(ckpt), topo, 0) == r0


def test_k3_tiny_experts_too_narrow_for_four_way_moe_tp(k3_tiny: Path) -> None:
    # k3-tiny's w2 input is 64 = two MXFP4 blocks: a 4-way expert split would cut them
    ckpt = open_checkpoint(k3_tiny)
    with pytest.raises(SplitError, match=r"experts\.\d+\.w2\.weight_packed'.*needs a multiple of 64 bytes"):
        tensors_for_rank(ckpt, Topology.make(tp=4, num_experts=16), 0)


def test_tensors_for_rank_k3_tiny_split_choices(k3_tiny: Path) -> None:
    ckpt = open_checkpoint(k3_tiny)
    topo = Topology.make(ep=2, tp=4, num_experts=16)  # W=4, moe_tp 2
    held = tensors_for_rank(ckpt, topo, 3).tensors
    pre = "language_model.model.layers."
    assert held[pre + "0.self_attn.q_proj.weight"] == Split(0, 3, 4)
    assert held[pre + "0.self_attn.o_proj.weight"] == Split(1, 3, 4)
    assert held[pre + "0.self_attn.dt_bias"] is None
    assert held[pre + "1.block_sparse_moe.experts.8.w1.weight_packed"] == Split(0, 1, 2)
    assert held[pre + "1.block_sparse_moe.experts.8.w2.weight_scale"] == Split(1, 1, 2)
    assert pre + "1.block_sparse_moe.experts.7.w1.weight_packed" not in held
    assert held["vision_tower.encoder.blocks.0.wqkv.weight"] is None


def test_tensors_for_rank_stacked_gptoss(gptoss_tiny: Path) -> None:
    ckpt = open_checkpoint(gptoss_tiny)
    rr = Topology.make(ep=4, num_experts=8, placement="round_robin")
    held = tensors_for_rank(ckpt, rr, 1)
    s = held.tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert s == ExpertSlice((1, 5)) and not s.contiguous
    assert s.to_json() == {"dim": 0, "experts": [1, 5], "split": None}
    stacked = sum(t.nbytes for n, t in ckpt.tensors.items() if ckpt.roles[n].kind == Kind.ROUTED_EXPERT)
    assert held.routed_bytes * 4 == stacked
    tp2 = Topology.make(tp=2, num_experts=8)  # experts whole-stacked, each cut 2 ways
    held = tensors_for_rank(ckpt, tp2, 1).tensors
    shape = ckpt.tensors["model.layers.0.mlp.experts.down_proj_blocks"].shape
    down = held["model.layers.0.mlp.experts.down_proj_blocks"]
    assert down == ExpertSlice(tuple(range(8)), Split(2, 1, 2)) and down.contiguous
    assert down.shape(shape) == (8, shape[1], shape[2] // 2, 16)
    assert held["model.layers.0.mlp.experts.down_proj_bias"] is None  # all experts, row bias: whole
    assert held["model.layers.0.mlp.experts.gate_up_proj_bias"] == ExpertSlice(tuple(range(8)), Split(1, 1, 2))
    assert tensors_for_rank(ckpt, Topology.make(num_experts=8), 0).tensors[
        "model.layers.0.mlp.experts.down_proj_blocks"] is None


def test_tensors_for_rank_fp8_blocks(k2_tiny: Path) -> None:
    ckpt = open_checkpoint(k2_tiny)
    # o_proj is [256, 128] with 128x128 scale blocks: a 2-way input split would cut a block
    with pytest.raises(SplitError, match="o_proj"):
        tensors_for_rank(ckpt, Topology.make(tp=2, num_experts=8), 0)
    held = tensors_for_rank(ckpt, Topology.make(ep=4, num_experts=8), 2)
    assert "model.layers.1.mlp.experts.4.gate_proj.weight_scale_inv" in held.tensors
    assert "model.layers.1.mlp.experts.3.gate_proj.weight_scale_inv" not in held.tensors


def test_tensors_for_rank_rejects_unplaced_experts(k3_tiny: Path) -> None:
    ckpt = open_checkpoint(k3_tiny)
    with pytest.raises(TopologyError, match=r"the checkpoint has expert 15 but the topology places 8 experts"):
        tensors_for_rank((ckpt.tensors, ckpt.roles), Topology.make(ep=2, num_experts=8), 0)
