"""ParameterPartition (both rules, validation) and the state-dict helpers of ZeroRedundancyOptimizer."""

from __future__ import annotations

import itertools

import pytest
import torch

from ddp import ParameterPartition
from ddp.zero.partition import FlatLayout, ParamSlot
from ddp.zero.state import exchange_objects, merge_payloads, piece_state
from tests._fakes import run_threads


def tensors(*numels: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.empty(n, dtype=dtype) for n in numels]


def owners(partition: ParameterPartition) -> dict[int, list[tuple[int, int, int]]]:
    """Parameter index -> [(rank, start, end)] over all ranks."""
    result: dict[int, list[tuple[int, int, int]]] = {}
    for rank in range(partition.world_size):
        for piece in partition.pieces(rank):
            result.setdefault(piece.index, []).append((rank, piece.start, piece.end))
    return result


# ------------------------------------------------------------------ balanced
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("seed", range(5))
def test_balanced_owns_every_parameter_whole_once_within_the_bound(world, seed):
    gen = torch.Generator().manual_seed(seed)
    numels = torch.randint(0, 300, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
    params = tensors(*numels)
    partition = ParameterPartition.balanced(params, world)
    assert partition.is_whole
    by_index = owners(partition)
    assert sorted(by_index) == list(range(len(params)))
    assert all(len(v) == 1 and v[0][1:] == (0, numels[i]) for i, v in by_index.items())
    loads = [partition.owned_numel(r) for r in range(world)]
    assert sum(loads) == sum(numels)
    assert max(loads) <= sum(numels) / world + max(numels)
    # The same input gives the same partition (every rank computes it alone).
    again = ParameterPartition.balanced(tensors(*numels), world)
    assert again.fingerprint() == partition.fingerprint()
    assert [again.pieces(r) for r in range(world)] == [partition.pieces(r) for r in range(world)]


def test_balanced_largest_first_to_the_least_loaded_rank():
    # 10 -> rank 0; 6 -> rank 1; 5 -> rank 1 (6 < 10); 4 -> rank 0 (10 < 11); 1 -> rank 1 (11 < 14)
    partition = ParameterPartition.balanced(tensors(4, 10, 1, 6, 5), 2)
    assert [p.index for p in partition.pieces(0)] == [0, 1]  # in parameter order within the shard
    assert [p.index for p in partition.pieces(1)] == [2, 3, 4]
    (layout,) = partition.layouts
    assert layout.shard_numel == 14 and partition.padding_numel() == 2
    assert [(s.index, s.offset) for s in layout.slots] == [(0, 0), (1, 4), (2, 14), (3, 15), (4, 21)]


def test_balanced_one_parameter_larger_than_all_others():
    partition = ParameterPartition.balanced(tensors(1600, 40, 80, 2), 3)
    assert [p.index for p in partition.pieces(0)] == [0]
    assert partition.owned_numel(0) == 1600
    assert partition.layouts[0].shard_numel == 1600
    assert partition.padding_numel() == 3 * 1600 - 1722


def test_balanced_more_ranks_than_parameters():
    partition = ParameterPartition.balanced(tensors(3, 5), 4)
    assert [len(partition.pieces(r)) for r in range(4)] == [1, 1, 0, 0]
    assert partition.layouts[0].shard_numel == 5


def test_balanced_adding_a_group_keeps_the_earlier_owners():
    first = tensors(7, 3, 9, 1, 4)
    second = tensors(20, 2, 2)
    before = owners(ParameterPartition.balanced([first], 3))
    after = owners(ParameterPartition.balanced([first, second], 3))
    assert {i: v[0][0] for i, v in before.items()} == {i: after[i][0][0] for i in before}


def test_balanced_one_layout_per_dtype_by_bytes():
    params = [
        torch.empty(10),
        torch.empty(10, dtype=torch.float64),
        torch.empty(4),
        torch.empty(6, dtype=torch.bfloat16),
    ]
    partition = ParameterPartition.balanced(params, 2)
    assert [(la.dtype, len(la.slots)) for la in partition.layouts] == [
        (torch.float32, 2),
        (torch.float64, 1),
        (torch.bfloat16, 1),
    ]
    # The float64 parameter (80 bytes) goes first, to rank 0; then the float32 one of 40 bytes to rank 1.
    assert owners(partition)[1][0][0] == 0 and owners(partition)[0][0][0] == 1


def test_empty_parameters_belong_to_one_rank():
    partition = ParameterPartition.balanced(tensors(0, 5, 0, 3), 2)
    by_index = owners(partition)
    assert len(by_index[0]) == len(by_index[2]) == 1
    assert by_index[0][0][1:] == (0, 0)


# -------------------------------------------------------------- from_buckets
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_from_buckets_cuts_each_bucket_into_equal_shards(world):
    params = tensors(7, 5, 11, 2, 9, 13)
    buckets = [[5, 4], [3, 2, 1]]  # parameter 0 is in no bucket: partitioned whole
    partition = ParameterPartition.from_buckets(params, buckets, world)
    first, second, rest = partition.layouts
    assert [s.index for s in first.slots] == [5, 4] and [s.offset for s in first.slots] == [0, 13]
    assert first.shard_numel == -(-22 // world) and second.shard_numel == -(-18 // world)
    assert [s.index for s in rest.slots] == [0]
    # Every element of every parameter is owned exactly once, and no piece crosses its rank's shard.
    for index, pieces in owners(partition).items():
        spans = sorted((start, end) for _, start, end in pieces)
        assert spans[0][0] == 0 and spans[-1][1] == params[index].numel()
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for rank in range(world):
        for piece in partition.pieces(rank):
            layout = partition.layouts[piece.layout]
            low = rank * layout.shard_numel
            assert low <= piece.offset and piece.offset + piece.numel <= low + layout.shard_numel
    assert partition.is_whole is (world == 1)
    assert partition.is_whole == all(p.is_whole for r in range(world) for p in partition.pieces(r))
    with pytest.raises(ValueError, match=f"rank {world} is not in 0..{world - 1}"):
        partition.pieces(world)


def test_from_buckets_rejects_mixed_dtypes_and_repeats():
    params = [torch.empty(3), torch.empty(3, dtype=torch.float64), torch.empty(2)]
    with pytest.raises(ValueError, match="bucket 0 mixes float32 on cpu, float64 on cpu"):
        ParameterPartition.from_buckets(params, [[0, 1], [2]], 2)
    with pytest.raises(ValueError, match="bucket 1 names parameter 0, which is out of range"):
        ParameterPartition.from_buckets(params, [[0], [0, 2]], 2)
    with pytest.raises(ValueError, match="parameter 7, which is out of range \\(0..2\\)"):
        ParameterPartition.from_buckets(params, [[7]], 2)
    with pytest.raises(
        ValueError, match="bucket 0 names parameter 2, which is out of range .* or in an earlier"
    ):
        ParameterPartition.from_buckets(params, [[2, 2]], 2)
    with pytest.raises(ValueError, match="bucket 0 holds a tensor that is not one of the 3 parameters"):
        ParameterPartition.from_buckets(params, [[params[0], torch.empty(3)]], 2)


def test_from_buckets_takes_tensors_as_well_as_indices():
    params = tensors(4, 6, 3)
    by_tensor = ParameterPartition.from_buckets(params, [[params[2], params[1]], [params[0]]], 2)
    by_index = ParameterPartition.from_buckets(params, [[2, 1], [0]], 2)
    assert by_tensor.fingerprint() == by_index.fingerprint()


# ---------------------------------------------------------------- validation
def layout(shard: int, *slots: tuple[int, int, int]) -> FlatLayout:
    return FlatLayout(torch.float32, "cpu", shard, tuple(ParamSlot(*s) for s in slots))


@pytest.mark.parametrize(
    ("layouts", "numels", "message"),
    [
        ([layout(4, (0, 0, 3))], [3, 2], "parameters \\[1\\] have no slot"),
        ([layout(4, (0, 0, 3), (1, 2, 2))], [3, 2], "overlaps the previous slot"),
        ([layout(2, (0, 0, 3), (1, 3, 2))], [3, 2], "runs past the buffer's 4 elements"),
        ([layout(4, (0, 0, 3)), layout(4, (0, 0, 3))], [3], "has slots in buffers 0 and 1"),
        ([layout(4, (0, 0, 4))], [3], "parameter 0 has 3 elements but its slot in buffer 0 has 4"),
        ([layout(4, (5, 0, 3))], [3], "slot for parameter 5, but there are 1 parameters"),
    ],
)
def test_partition_validation(layouts, numels, message):
    with pytest.raises(ValueError, match=message):
        ParameterPartition(2, layouts, numels)


def test_check_params_names_the_parameter():
    partition = ParameterPartition.balanced(tensors(3, 4), 2)
    partition.check_params(tensors(3, 4))
    with pytest.raises(ValueError, match="covers 2 parameters, but the optimizer has 3"):
        partition.check_params(tensors(3, 4, 5))
    with pytest.raises(ValueError, match=r"parameter 1 \(float64 \(4,\) on cpu\) does not fit its slot"):
        partition.check_params([torch.empty(3), torch.empty(4, dtype=torch.float64)])


def test_fingerprint_tells_layouts_apart():
    a = ParameterPartition.balanced(tensors(3, 4, 5), 2)
    b = ParameterPartition.balanced(tensors(3, 5, 4), 2)
    c = ParameterPartition.from_buckets(tensors(3, 4, 5), [[2, 1, 0]], 2)
    assert len({a.fingerprint(), b.fingerprint(), c.fingerprint()}) == 3
    assert "whole" in repr(a) and "split" in repr(c)


# ------------------------------------------------------------- state helpers
def test_piece_state_and_merge_round_trip():
    shape = torch.Size([3, 4])
    whole = {"step": torch.tensor(5.0), "exp_avg": torch.arange(12.0).view(shape), "flag": True}
    cuts = [(0, 5), (5, 11), (11, 12)]
    payloads = [{7: [(a, b, piece_state(whole, a, b, shape))]} for a, b in cuts]
    assert payloads[1][7][0][2]["exp_avg"].tolist() == [5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert payloads[1][7][0][2]["step"] is whole["step"]
    merged = merge_payloads(list(reversed(payloads)), [torch.Size([1])] * 7 + [shape])
    assert torch.equal(merged[7]["exp_avg"], whole["exp_avg"]) and merged[7]["flag"] is True
    assert piece_state(whole, 0, 12, shape)["exp_avg"] is whole["exp_avg"]


def test_merge_refuses_pieces_that_do_not_cover_the_parameter():
    shape = torch.Size([6])
    state = {"momentum_buffer": torch.zeros(6)}
    partial = [{0: [(0, 2, piece_state(state, 0, 2, shape)), (4, 6, piece_state(state, 4, 6, shape))]}]
    with pytest.raises(ValueError, match=r"comes in pieces \[\(0, 2\), \(4, 6\)\]"):
        merge_payloads(partial, [shape])


def _exchange(group, dst):
    obj = {"rank": group.rank, "data": torch.arange(group.rank * 3 + 1), "text": "x" * (group.rank * 5)}
    return exchange_objects(group, obj, dst)


@pytest.mark.parametrize("dst", [None, 0, 2])
def test_exchange_objects(dst):
    results = run_threads(_exchange, 3, dst)
    for rank, got in enumerate(results):
        if dst is not None and rank != dst:
            assert got is None
            continue
        assert [o["rank"] for o in got] == [0, 1, 2]
        assert [o["data"].tolist() for o in got] == [[0], [0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]]
        assert [len(o["text"]) for o in got] == [0, 5, 10]
