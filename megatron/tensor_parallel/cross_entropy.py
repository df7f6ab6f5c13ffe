"""Cross-entropy over logits split by vocabulary across tensor-parallel ranks.

The full ``[..., vocab]`` logits never exist on one rank: three all-reduces of ``[...]``-sized
tensors (max, target logit, sum of exponentials) give every rank the exact loss, and the
gradient ``softmax - one_hot(target)`` is computed shard by shard without communication.
"""

from __future__ import annotations

import torch

from megatron.parallel import parallel_state
from megatron.parallel.collectives import all_reduce_result


def _all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return tensor
    return all_reduce_result(tensor, parallel_state.get_tensor_model_parallel_group(), op)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # fp32 throughout: exp/sum over a large vocabulary loses too much in half precision.
        logits = logits_shard.float()
        # Subtracting the global max keeps exp() in range; it cancels out of the loss.
        logits_max = logits.max(dim=-1).values
        logits_max = _all_reduce(logits_max, "max")
        logits = logits - logits_max.unsqueeze(-1)

        vocab_per_partition = logits.shape[-1]
        vocab_start = parallel_state.get_tensor_model_parallel_rank() * vocab_per_partition
        outside = (labels < vocab_start) | (labels >= vocab_start + vocab_per_partition)
        local_labels = (labels - vocab_start).masked_fill(outside, 0)
        # Only the rank owning the label contributes its logit; the all-reduce delivers it.
        target_logits = logits.gather(-1, local_labels.unsqueeze(-1)).squeeze(-1)
        target_logits = target_logits.masked_fill(outside, 0.0)
        target_logits = _all_reduce(target_logits, "sum")

        exp_logits = logits.exp()
        sum_exp_logits = exp_logits.sum(dim=-1)
        sum_exp_logits = _all_reduce(sum_exp_logits, "sum")

        loss = sum_exp_logits.log() - target_logits
        softmax = exp_logits.div_(sum_exp_logits.unsqueeze(-1))
        ctx.input_dtype = logits_shard.dtype
        ctx.save_for_backward(softmax, outside, local_labels)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        softmax, outside, local_labels = ctx.saved_tensors
        # d loss / d logits = softmax - one_hot(label), the one-hot living on the owning rank.
        grad = softmax.clone()
        grad.scatter_add_(-1, local_labels.unsqueeze(-1), -(~outside).unsqueeze(-1).to(grad.dtype))
        grad.mul_(grad_output.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 cross-entropy of vocabulary-split logits.

    ``logits_shard``: ``[..., vocab / tp]``, this rank's contiguous vocabulary range (as a
    ``ColumnParallelLinear(gather_output=False)`` output layer produces it). ``labels``:
    ``[...]`` ids in ``[0, vocab)``. Returns ``[...]`` fp32 losses, identical on every TP rank,
    equal to ``F.cross_entropy(full_logits, labels, reduction="none")``. There is no
    ``ignore_index``: mask the returned losses instead (Megatron's loss mask).
    """
    return _VocabParallelCrossEntropy.apply(logits_shard, labels)
