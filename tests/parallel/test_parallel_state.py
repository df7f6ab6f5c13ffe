"""parallel_state: Megatron-LM's rank layout, one clear error for bad sizes, defaults without set-up."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron.parallel import parallel_state as ps
from tests.launch import run_distributed

# Expected groups for a world of 4, written out from Megatron-Core's order "tp-cp-ep-dp-pp"
# (tensor parallel fastest, pipeline slowest; expert parallel carved from data parallel).
WORLD_4_LAYOUTS = {
    # (tp, pp, ep): groups
    (2, 2, 1): {
        "tensor": [[0, 1], [2, 3]],
        "pipeline": [[0, 2], [1, 3]],
        "data": [[0], [1], [2], [3]],
        "model": [[0, 1, 2, 3]],
        "embedding": [[0, 2], [1, 3]],
        "expert": [[0], [1], [2], [3]],
        "expert_data": [[0], [1], [2], [3]],
    },
    (1, 4, 1): {
        "tensor": [[0], [1], [2], [3]],
        "pipeline": [[0, 1, 2, 3]],
        "data": [[0], [1], [2], [3]],
        "model": [[0, 1, 2, 3]],
        "embedding": [[0, 3]],
        "expert": [[0], [1], [2], [3]],
        "expert_data": [[0], [1], [2], [3]],
    },
    (4, 1, 1): {
        "tensor": [[0, 1, 2, 3]],
        "pipeline": [[0], [1], [2], [3]],
        "data": [[0], [1], [2], [3]],
        "model": [[0, 1, 2, 3]],
        "embedding": [[0], [1], [2], [3]],
        "expert": [[0], [1], [2], [3]],
        "expert_data": [[0], [1], [2], [3]],
    },
    (1, 1, 1): {
        "tensor": [[0], [1], [2], [3]],
        "pipeline": [[0], [1], [2], [3]],
        "data": [[0, 1, 2, 3]],
        "model": [[0], [1], [2], [3]],
        "embedding": [[0], [1], [2], [3]],
        "expert": [[0], [1], [2], [3]],
        "expert_data": [[0, 1, 2, 3]],
    },
    (2, 1, 2): {
        "tensor": [[0, 1], [2, 3]],
        "pipeline": [[0], [1], [2], [3]],
        "data": [[0, 2], [1, 3]],
        "model": [[0, 1], [2, 3]],
        "embedding": [[0], [1], [2], [3]],
        "expert": [[0, 2], [1, 3]],
        "expert_data": [[0], [1], [2], [3]],
    },
    (1, 1, 2): {
        "tensor": [[0], [1], [2], [3]],
        "pipeline": [[0], [1], [2], [3]],
        "data": [[0, 1, 2, 3]],
        "model": [[0], [1], [2], [3]],
        "embedding": [[0], [1], [2], [3]],
        "expert": [[0, 1], [2, 3]],
        "expert_data": [[0, 2], [1, 3]],
    },
    (1, 2, 2): {
        "tensor": [[0], [1], [2], [3]],
        "pipeline": [[0, 2], [1, 3]],
        "data": [[0, 1], [2, 3]],
        "model": [[0, 2], [1, 3]],
        "embedding": [[0, 2], [1, 3]],
        "expert": [[0, 1], [2, 3]],
        "expert_data": [[0], [1], [2], [3]],
    },
}


def test_layout_matches_megatron_docstring_example():
    # Megatron-Core's initialize_model_parallel docstring: 16 GPUs, tp=2, pp=4.
    groups = ps.parallel_rank_groups(
        16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4
    )
    assert groups["data"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert groups["tensor"] == [
        [0, 1],
        [2, 3],
        [4, 5],
        [6, 7],
        [8, 9],
        [10, 11],
        [12, 13],
        [14, 15],
    ]
    assert groups["pipeline"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert groups["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert groups["model"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]


def test_expert_groups_split_data_parallel_ranks():
    # 8 ranks, tp=2, ep=2: dp = 4 ranks {0,2,4,6} (and {1,3,5,7}); EP takes the nearest pairs.
    groups = ps.parallel_rank_groups(8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert groups["data"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups["expert"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["expert_data"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(("tp", "pp", "ep"), sorted(WORLD_4_LAYOUTS))
def test_layout_of_world_4(tp, pp, ep):
    groups = ps.parallel_rank_groups(4, tp, pp, ep)
    assert groups == WORLD_4_LAYOUTS[(tp, pp, ep)]


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ((6, 4, 1, 1), r"world size 6 is not divisible by tensor \(4\) x pipeline \(1\)"),
        ((8, 2, 3, 1), r"world size 8 is not divisible by tensor \(2\) x pipeline \(3\)"),
        ((8, 2, 1, 3), r"expert model parallel size 3 does not divide the data parallel size 4"),
        ((4, 0, 1, 1), r"tensor model parallel size must be at least 1, got 0"),
    ],
)
def test_bad_sizes_raise_one_clear_error(sizes, message):
    with pytest.raises(ValueError, match=message):
        ps.parallel_rank_groups(*sizes)


def test_queries_before_initialization_answer_for_a_single_process():
    assert not dist.is_initialized()
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_pipeline_model_parallel_world_size() == 1
    assert ps.get_data_parallel_world_size() == 1
    assert ps.get_data_parallel_rank() == 0
    assert ps.get_expert_model_parallel_world_size() == 1
    assert ps.get_expert_data_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.get_pipeline_model_parallel_next_rank() == 0
    assert ps.get_virtual_pipeline_model_parallel_rank() is None
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_tensor_model_parallel_group()


def test_single_process_initialization_without_torch_distributed():
    with pytest.raises(ValueError, match=r"world size 1 is not divisible by tensor \(2\)"):
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
    assert not ps.model_parallel_is_initialized()
    ps.initialize_model_parallel()
    try:
        assert ps.model_parallel_is_initialized()
        assert ps.get_tensor_model_parallel_group() is None
        assert ps.get_data_parallel_world_size() == 1
        with pytest.raises(RuntimeError, match="already initialized"):
            ps.initialize_model_parallel()
    finally:
        ps.destroy_model_parallel()
    assert not ps.model_parallel_is_initialized()


_GETTERS = {
    "tensor": ps.get_tensor_model_parallel_group,
    "pipeline": ps.get_pipeline_model_parallel_group,
    "data": ps.get_data_parallel_group,
    "model": ps.get_model_parallel_group,
    "expert": ps.get_expert_model_parallel_group,
    "expert_data": ps.get_expert_data_parallel_group,
}


def _groups_of_every_layout(rank: int, world_size: int) -> dict:
    """Per layout: the members of each of this rank's groups, as torch.distributed sees them."""
    seen = {}
    for tp, pp, ep in sorted(WORLD_4_LAYOUTS):
        ps.initialize_model_parallel(tp, pp, ep)
        try:
            members = {
                kind: dist.get_process_group_ranks(getter()) for kind, getter in _GETTERS.items()
            }
            # Middle pipeline stages hold no embedding and belong to no embedding group.
            if ps.is_rank_in_embedding_group():
                members["embedding"] = dist.get_process_group_ranks(ps.get_embedding_group())
            else:
                members["embedding"] = None
            sizes_and_ranks = {
                "tensor": (
                    ps.get_tensor_model_parallel_world_size(),
                    ps.get_tensor_model_parallel_rank(),
                ),
                "pipeline": (
                    ps.get_pipeline_model_parallel_world_size(),
                    ps.get_pipeline_model_parallel_rank(),
                ),
                "data": (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()),
                "expert": (
                    ps.get_expert_model_parallel_world_size(),
                    ps.get_expert_model_parallel_rank(),
                ),
                "expert_data": (
                    ps.get_expert_data_parallel_world_size(),
                    ps.get_expert_data_parallel_rank(),
                ),
            }
            seen[(tp, pp, ep)] = (members, sizes_and_ranks)
            # A collective on the tensor group proves the group really connects its members.
            dist.barrier(group=ps.get_tensor_model_parallel_group())
        finally:
            ps.destroy_model_parallel()
    return seen


def test_groups_contain_megatron_ranks_on_4_processes():
    results = run_distributed(_groups_of_every_layout, 4)
    for rank, seen in enumerate(results):
        for layout, expected_groups in WORLD_4_LAYOUTS.items():
            members, sizes_and_ranks = seen[layout]
            for kind, groups in expected_groups.items():
                holding = [ranks for ranks in groups if rank in ranks]
                expected = holding[0] if holding else None
                assert len(holding) <= 1
                assert members[kind] == expected, (layout, kind, rank)
                if kind in sizes_and_ranks:
                    assert sizes_and_ranks[kind] == (len(expected), expected.index(rank))


def _pipeline_queries(rank: int, world_size: int) -> dict:
    ps.initialize_model_parallel(
        pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2
    )
    try:
        answers = {
            "next": ps.get_pipeline_model_parallel_next_rank(),
            "prev": ps.get_pipeline_model_parallel_prev_rank(),
            "first_rank": ps.get_pipeline_model_parallel_first_rank(),
            "last_rank": ps.get_pipeline_model_parallel_last_rank(),
            "in_embedding_group": ps.is_rank_in_embedding_group(),
        }
        for chunk in range(2):
            ps.set_virtual_pipeline_model_parallel_rank(chunk)
            answers[chunk] = (ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
        answers["ignoring_virtual"] = (
            ps.is_pipeline_first_stage(ignore_virtual=True),
            ps.is_pipeline_last_stage(ignore_virtual=True),
        )
        return answers
    finally:
        ps.destroy_model_parallel()


def test_pipeline_neighbours_and_virtual_stages():
    results = run_distributed(_pipeline_queries, 4)
    assert [answers["next"] for answers in results] == [1, 2, 3, 0]
    assert [answers["prev"] for answers in results] == [3, 0, 1, 2]
    assert {answers["first_rank"] for answers in results} == {0}
    assert {answers["last_rank"] for answers in results} == {3}
    assert [answers["in_embedding_group"] for answers in results] == [True, False, False, True]
    # Chunk 0 of stage 0 is the model's first stage; chunk 1 of the last stage is its last.
    assert [answers[0] for answers in results] == [
        (True, False),
        (False, False),
        (False, False),
        (False, False),
    ]
    assert [answers[1] for answers in results] == [
        (False, False),
        (False, False),
        (False, False),
        (False, True),
    ]
    assert [answers["ignoring_virtual"] for answers in results] == [
        (True, False),
        (False, False),
        (False, False),
        (False, True),
    ]
