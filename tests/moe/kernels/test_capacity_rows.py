"""moe.kernels.capacity_rows: the capacity MoE's rows into slots and back equal a plain loop over
the assignments (MegaBlocks' drops: each expert keeps its first C assignments in assignment
order; Megatron-Core's `probs` policy: its C highest-weight ones), forward and backward, and
need no host sync."""

import pytest
import torch

from moe.kernels import capacity_rows, token_rows

# (tokens, top_k, experts, capacity): drops (capacity below the busiest expert's count), empty
# slots, and a capacity large enough to keep everything.
CASES = [(40, 1, 8, 3), (40, 2, 8, 6), (33, 3, 4, 20), (16, 2, 4, 1)]


def _routing(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=generator)
    return scores.topk(top_k, dim=-1).indices


def _slots_by_loop(expert_indices: torch.Tensor, experts: int, capacity: int) -> dict:
    """{assignment: slot} for the kept assignments, in MegaBlocks' order."""
    slots, taken = {}, [0] * experts
    for assignment, expert in enumerate(expert_indices.reshape(-1).tolist()):
        if taken[expert] < capacity:
            slots[assignment] = expert * capacity + taken[expert]
            taken[expert] += 1
    return slots


def _by_loop(x, y, weights, expert_indices, experts, capacity):
    """(slots [E * C, h], combined [T, h]) through per-row copies and adds, differentiable."""
    top_k = expert_indices.shape[1]
    kept = _slots_by_loop(expert_indices, experts, capacity)
    gathered = [torch.zeros(x.shape[1], dtype=x.dtype) for _ in range(experts * capacity)]
    combined = [torch.zeros(y.shape[1]) for _ in range(x.shape[0])]
    for assignment, slot in kept.items():
        token = assignment // top_k
        gathered[slot] = x[token]
        combined[token] = combined[token] + weights[assignment] * y[slot].float()
    return torch.stack(gathered), torch.stack(combined).to(y.dtype)


@pytest.mark.parametrize("tokens,top_k,experts,capacity", CASES)
def test_slots_and_combine_equal_a_loop_over_assignments(tokens, top_k, experts, capacity):
    expert_indices = _routing(tokens, top_k, experts, seed=tokens + top_k)
    order, slot_of, tokens_per_expert = token_rows.sort_assignments(expert_indices, experts)
    slots = capacity_rows.capacity_slots(
        expert_indices, order, slot_of, tokens_per_expert, capacity
    )
    kept = _slots_by_loop(expert_indices, experts, capacity)
    assert len(kept) < tokens * top_k or capacity == 20  # the cases drop, but for the last
    for assignment, slot in enumerate(slots.slot_of_assignment.tolist()):
        assert slot == kept.get(assignment, experts * capacity)
    holder = {slot: assignment for assignment, slot in kept.items()}
    for slot, assignment in enumerate(slots.assignment_of_slot.tolist()):
        assert assignment == holder.get(slot, tokens * top_k)

    generator = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, 8, generator=generator)
    y = torch.randn(experts * capacity, 8, generator=generator)
    weights = torch.rand(tokens * top_k, generator=generator)
    probes = torch.randn(experts * capacity, 8), torch.randn(tokens, 8)
    results = []
    for run in ("ops", "loop"):
        inputs = [t.clone().requires_grad_() for t in (x, y, weights)]
        if run == "ops":
            gathered = capacity_rows.gather_into_slots(inputs[0], slots)
            combined = capacity_rows.combine_from_slots(inputs[1], inputs[2], slots)
        else:
            gathered, combined = _by_loop(*inputs, expert_indices, experts, capacity)
        ((gathered * probes[0]).sum() + (combined * probes[1]).sum()).backward()
        results.append([gathered, combined] + [t.grad for t in inputs])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("tokens,top_k,experts,capacity", CASES)
def test_the_weight_order_gives_each_experts_slots_to_its_highest_weights(
    tokens, top_k, experts, capacity
):
    """Megatron-Core's `probs` policy: sorted by weight within each expert, the slots hold the
    C highest-weight assignments, in descending weight; the rest are dropped."""
    expert_indices = _routing(tokens, top_k, experts, seed=tokens + top_k)
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(5))
    order, slot_of, tokens_per_expert = capacity_rows.sort_assignments_by_weight(
        expert_indices, weights, experts
    )
    slots = capacity_rows.capacity_slots(
        expert_indices, order, slot_of, tokens_per_expert, capacity
    )
    flat_indices, flat_weights = expert_indices.reshape(-1), weights.reshape(-1)
    expected = torch.full((tokens * top_k,), experts * capacity)
    for expert in range(experts):
        mine = torch.nonzero(flat_indices == expert).squeeze(1)
        best = mine[flat_weights[mine].argsort(descending=True)[:capacity]]
        expected[best] = expert * capacity + torch.arange(len(best))
    assert torch.equal(slots.slot_of_assignment, expected)


def test_bf16_rows_are_summed_in_fp32():
    """Three choices of one token whose bf16 running sum stays at 1 (each addend is below half
    of bf16's spacing there, 2^-7): the combine sums in fp32 and rounds once, as MegaBlocks'
    scatter does, to the next bf16 number."""
    expert_indices = torch.tensor([[0, 1, 2]])
    order, slot_of, tokens_per_expert = token_rows.sort_assignments(expert_indices, 3)
    slots = capacity_rows.capacity_slots(expert_indices, order, slot_of, tokens_per_expert, 1)
    small = 3 * 2.0**-10
    y = torch.tensor([[1.0], [small], [small]], dtype=torch.bfloat16)
    out = capacity_rows.combine_from_slots(y, torch.ones(3), slots)
    assert out.dtype == torch.bfloat16
    assert out.item() == 1.0 + 2.0**-7
