"""Tensor-parallel layers, cross-entropy and RNG tracker against their single-process equivalents.

Every rank builds the same full inputs from one seed, runs the sharded computation, and compares
outputs and gradients with plain PyTorch modules holding the gathered full weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megatron.kernels.fp8_linear import max_over_ranks
from megatron.parallel import parallel_state as ps
from megatron.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_init_method,
    gather_tensor_model_parallel_weight,
    model_parallel_manual_seed,
    model_parallel_rng_tracker,
    shard_tensor_model_parallel_weight,
    vocab_parallel_cross_entropy,
)
from tests.launch import run_distributed
from tests.parallel.collective_names import IN_PLACE_COLLECTIVES, replaced_collectives

BATCH, SEQ, HIDDEN, FFN, VOCAB = 2, 4, 8, 16, 16


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)


def serial_linear(layer: nn.Module) -> nn.Linear:
    """An nn.Linear holding ``layer``'s gathered full weight and bias."""
    weight = gather_tensor_model_parallel_weight(layer.weight)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=layer.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if layer.bias is not None:
            # Layers start with zero biases; random ones make a misplaced bias show up.
            linear.bias.copy_(torch.randn_like(linear.bias))
            layer.bias.copy_(shard_like(linear.bias, layer.bias))
    return linear


def shard_like(full: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` in the layout of ``shard`` (replicated if not sharded)."""
    if not getattr(shard, "tensor_model_parallel", False):
        return full.detach().clone()
    return shard_tensor_model_parallel_weight(full, shard.partition_dim)


def gathered_grad(param: torch.Tensor) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return param.grad
    return gather_tensor_model_parallel_weight(param.grad, param.partition_dim)


def assert_same_grads(layer: nn.Module, serial: nn.Linear) -> None:
    assert_close(gathered_grad(layer.weight), serial.weight.grad)
    if layer.bias is not None:
        assert_close(gathered_grad(layer.bias), serial.bias.grad)


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().clone().requires_grad_(True)


def _check_linear_layers(rank: int, world_size: int) -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp_rank = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(0)

    # Column, both output layouts.
    for gather_output in (True, False):
        column = ColumnParallelLinear(HIDDEN, FFN, gather_output=gather_output)
        serial = serial_linear(column)
        x = leaf(torch.randn(BATCH, SEQ, HIDDEN))
        x_ref = leaf(x)
        upstream = torch.randn(BATCH, SEQ, FFN)
        ref = serial(x_ref)
        (ref * upstream).sum().backward()
        if not gather_output:
            # Each rank holds its output features; the loss is the sum over ranks.
            ref = ref.chunk(world_size, -1)[tp_rank]
            upstream = upstream.chunk(world_size, -1)[tp_rank]
        out = column(x)
        assert_close(out, ref)
        (out * upstream).sum().backward()
        assert_close(x.grad, x_ref.grad)
        assert_same_grads(column, serial)

    # Row, both input layouts.
    for input_is_parallel in (False, True):
        row = RowParallelLinear(FFN, HIDDEN, input_is_parallel=input_is_parallel)
        serial = serial_linear(row)
        x_full = torch.randn(BATCH, SEQ, FFN)
        x_ref = leaf(x_full)
        x = leaf(x_full.chunk(world_size, -1)[tp_rank] if input_is_parallel else x_full)
        upstream = torch.randn(BATCH, SEQ, HIDDEN)
        out, ref = row(x), serial(x_ref)
        assert_close(out, ref)
        (out * upstream).sum().backward()
        (ref * upstream).sum().backward()
        expected_x_grad = (
            x_ref.grad.chunk(world_size, -1)[tp_rank] if input_is_parallel else x_ref.grad
        )
        assert_close(x.grad, expected_x_grad)
        assert_same_grads(row, serial)
    ps.destroy_model_parallel()


def _check_mlp(rank: int, world_size: int, sequence_parallel: bool) -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp_rank = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(1)
    fc1 = ColumnParallelLinear(
        HIDDEN, FFN, gather_output=False, sequence_parallel=sequence_parallel
    )
    fc2 = RowParallelLinear(
        FFN, HIDDEN, input_is_parallel=True, sequence_parallel=sequence_parallel
    )
    serial_fc1, serial_fc2 = serial_linear(fc1), serial_linear(fc2)

    x_full = torch.randn(BATCH, SEQ, HIDDEN)
    upstream = torch.randn(BATCH, SEQ, HIDDEN)
    x_ref = leaf(x_full)
    ref = serial_fc2(F.gelu(serial_fc1(x_ref)))
    (ref * upstream).sum().backward()

    if sequence_parallel:
        # Outside the tensor-parallel region each rank holds its own chunk of the sequence.
        x = leaf(x_full.chunk(world_size, 1)[tp_rank])
        expected, upstream = (
            ref.chunk(world_size, 1)[tp_rank],
            upstream.chunk(world_size, 1)[tp_rank],
        )
        expected_x_grad = x_ref.grad.chunk(world_size, 1)[tp_rank]
    else:
        x, expected, expected_x_grad = leaf(x_full), ref, x_ref.grad
    out = fc2(F.gelu(fc1(x)))
    assert_close(out, expected)
    (out * upstream).sum().backward()
    assert_close(x.grad, expected_x_grad)
    assert_same_grads(fc1, serial_fc1)
    assert_same_grads(fc2, serial_fc2)
    ps.destroy_model_parallel()


def _check_vocab_parallel(rank: int, world_size: int) -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    tp_rank = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(2)

    embedding = VocabParallelEmbedding(VOCAB, HIDDEN)
    serial = nn.Embedding(VOCAB, HIDDEN)
    with torch.no_grad():
        serial.weight.copy_(gather_tensor_model_parallel_weight(embedding.weight))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    ids[0, :2] = torch.tensor([0, VOCAB - 1])  # both ends of the vocabulary
    upstream = torch.randn(BATCH, SEQ, HIDDEN)
    out, ref = embedding(ids), serial(ids)
    assert_close(out, ref)
    (out * upstream).sum().backward()
    (ref * upstream).sum().backward()
    assert_close(gathered_grad(embedding.weight), serial.weight.grad)

    logits_full = torch.randn(BATCH, SEQ, VOCAB) * 4
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels[0, :2] = torch.tensor([0, VOCAB - 1])
    upstream = torch.rand(BATCH, SEQ)
    logits_ref = leaf(logits_full)
    ref = F.cross_entropy(logits_ref.view(-1, VOCAB), labels.view(-1), reduction="none")
    ref = ref.view(BATCH, SEQ)
    (ref * upstream).sum().backward()
    logits = leaf(logits_full.chunk(world_size, -1)[tp_rank])
    loss = vocab_parallel_cross_entropy(logits, labels)
    assert loss.dtype == torch.float32
    assert_close(loss, ref)
    (loss * upstream).sum().backward()
    assert_close(logits.grad, logits_ref.grad.chunk(world_size, -1)[tp_rank])
    # Logits far beyond exp()'s range: the shift by the global max keeps the loss exact.
    huge = logits_full * 1e4
    expected = F.cross_entropy(huge.view(-1, VOCAB), labels.view(-1), reduction="none")
    loss = vocab_parallel_cross_entropy(huge.chunk(world_size, -1)[tp_rank], labels)
    torch.testing.assert_close(loss, expected.view(BATCH, SEQ), atol=1e-2, rtol=1e-6)
    ps.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2, 4])
def test_column_and_row_parallel_linear_match_nn_linear(world_size):
    run_distributed(_check_linear_layers, world_size)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("world_size", [2, 4])
def test_parallel_mlp_matches_serial_mlp(world_size, sequence_parallel):
    run_distributed(_check_mlp, world_size, sequence_parallel)


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy_match_serial(world_size):
    run_distributed(_check_vocab_parallel, world_size)


def _communicate_functionally(rank: int, world_size: int) -> None:
    """A sequence-parallel MLP, the vocabulary-parallel loss and FP8's amax reduction, forward
    and backward, with every in-place collective the project can reach, by any of its names,
    replaced by a refusal (tests/parallel/collective_names.py)."""
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    torch.manual_seed(3)
    fc1 = ColumnParallelLinear(HIDDEN, FFN, gather_output=False, sequence_parallel=True)
    fc2 = RowParallelLinear(FFN, VOCAB, input_is_parallel=True, sequence_parallel=True)
    x = leaf(torch.randn(BATCH, SEQ // world_size, HIDDEN))
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))

    def refusal(name, collective):
        def refuse(*args, **kwargs):
            raise AssertionError(f"an in-place collective inside the model: {name}")

        return refuse

    with replaced_collectives(refusal, IN_PLACE_COLLECTIVES) as replaced:
        # The project's own names for the one-tensor collectives are among those refused.
        names = {(namespace.__name__, attribute) for namespace, attribute, _ in replaced}
        assert {("megatron.parallel.collectives", "reduce_scatter_single"),
                ("megatron.parallel.collectives", "all_gather_single")} <= names  # fmt: skip
        hidden = fc2(F.gelu(fc1(x)))  # sequence-sharded [BATCH, SEQ / tp, VOCAB]
        logits = ColumnParallelLinear(VOCAB, VOCAB, gather_output=False, sequence_parallel=True)
        loss = vocab_parallel_cross_entropy(logits(hidden), labels)
        loss.sum().backward()
        amax = max_over_ranks(torch.tensor([float(rank)]), ps.get_tensor_model_parallel_group())
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert amax.item() == world_size - 1
    ps.destroy_model_parallel()


def test_the_layers_communicate_by_functional_collectives():
    """torch.compile rewrites an in-place collective into a functional one copied back into
    its input, and on NCCL a compiled backward read that input before the reduction was done
    (megatron/parallel/collectives.py); the layers call the functional collectives themselves."""
    run_distributed(_communicate_functionally, 2)


def _draw_masks(rank: int, world_size: int) -> dict:
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_manual_seed(1234)
    tracker = model_parallel_rng_tracker()
    ones = torch.ones(256)

    def mask() -> torch.Tensor:
        return F.dropout(ones, p=0.5) != 0

    masks = {"outside": mask()}
    with tracker.fork():
        masks["inside"] = mask()
    masks["outside_after_fork"] = mask()

    saved = tracker.get_states()
    with tracker.fork():
        masks["inside_2"] = mask()
    tracker.set_states(saved)
    with tracker.fork():
        masks["inside_2_restored"] = mask()
    ps.destroy_model_parallel()
    return masks


def test_rng_tracker_streams_differ_only_across_tensor_parallel_ranks():
    # 4 ranks as tp=2 x dp=2: ranks 0/1 and 2/3 are tensor-parallel peers.
    masks = run_distributed(_draw_masks, 4)
    # The default generator is the same on every rank (replicated residual stream).
    for rank in range(1, 4):
        assert torch.equal(masks[rank]["outside"], masks[0]["outside"])
        assert torch.equal(masks[rank]["outside_after_fork"], masks[0]["outside_after_fork"])
    # The forked stream differs between TP peers but repeats across data-parallel replicas.
    assert not torch.equal(masks[0]["inside"], masks[1]["inside"])
    assert torch.equal(masks[0]["inside"], masks[2]["inside"])
    assert torch.equal(masks[1]["inside"], masks[3]["inside"])
    for rank_masks in masks:
        # Forking leaves the default stream where it was, and saved states replay exactly.
        assert not torch.equal(rank_masks["inside"], rank_masks["outside"])
        assert torch.equal(rank_masks["inside_2"], rank_masks["inside_2_restored"])


def test_rng_tracker_leaves_the_default_stream_untouched():
    ps.destroy_model_parallel()
    model_parallel_manual_seed(7, device_type="cpu")
    first, second = torch.rand(4), torch.rand(4)
    model_parallel_manual_seed(7, device_type="cpu")
    assert torch.equal(torch.rand(4), first)
    with model_parallel_rng_tracker().fork():
        torch.rand(100)
    assert torch.equal(torch.rand(4), second)
    with pytest.raises(ValueError, match="already exists"):
        model_parallel_rng_tracker().add("model-parallel-rng", 99)
    with pytest.raises(KeyError, match="never added"):
        with model_parallel_rng_tracker().fork("no-such-stream"):
            pass


def _init_weights(tensor_model_parallel_size: int) -> dict[str, torch.Tensor]:
    ps.initialize_model_parallel(tensor_model_parallel_size=tensor_model_parallel_size)
    torch.manual_seed(5)
    layers = {
        "column": ColumnParallelLinear(HIDDEN, FFN),
        "row": RowParallelLinear(FFN, HIDDEN),
        "embedding": VocabParallelEmbedding(VOCAB, HIDDEN),
    }
    weights = {
        name: gather_tensor_model_parallel_weight(layer.weight) for name, layer in layers.items()
    }
    for name, layer in layers.items():
        # Cutting the gathered weight again gives back this rank's shard.
        assert torch.equal(shard_like(weights[name], layer.weight), layer.weight.detach())
    ps.destroy_model_parallel()
    return weights


def _compare_initialization(rank: int, world_size: int) -> None:
    sharded, unsharded = _init_weights(world_size), _init_weights(1)
    torch.manual_seed(5)
    for name, shape in (
        ("column", (FFN, HIDDEN)),
        ("row", (HIDDEN, FFN)),
        ("embedding", (VOCAB, HIDDEN)),
    ):
        serial = torch.empty(shape)
        default_init_method(serial)
        assert torch.equal(sharded[name], unsharded[name]), name
        assert torch.equal(sharded[name], serial), name


@pytest.mark.parametrize("world_size", [2, 4])
def test_sharded_initialization_equals_single_process_initialization(world_size):
    run_distributed(_compare_initialization, world_size)


def test_layers_without_initialization_are_plain_layers():
    ps.destroy_model_parallel()
    torch.manual_seed(3)
    column = ColumnParallelLinear(HIDDEN, FFN)
    serial = serial_linear(column)
    x = torch.randn(BATCH, SEQ, HIDDEN)
    assert_close(column(x), serial(x))
    logits, labels = torch.randn(BATCH, SEQ, VOCAB), torch.randint(0, VOCAB, (BATCH, SEQ))
    expected = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), reduction="none")
    assert_close(vocab_parallel_cross_entropy(logits, labels), expected.view(BATCH, SEQ))


def _bad_partition(rank: int, world_size: int) -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    with pytest.raises(
        ValueError, match="output size 10 is not divisible by the tensor model parallel size 4"
    ):
        ColumnParallelLinear(HIDDEN, 10)
    with pytest.raises(ValueError, match="vocabulary size 18 is not divisible"):
        VocabParallelEmbedding(18, HIDDEN)
    with pytest.raises(ValueError, match="needs input_is_parallel=True"):
        RowParallelLinear(FFN, HIDDEN, sequence_parallel=True)
    ps.destroy_model_parallel()


def test_sizes_that_do_not_split_raise():
    run_distributed(_bad_partition, 4)


def test_strided_shards_hold_each_ranks_blocks_of_every_part():
    # [gate rows 0-3 | up rows 4-7] at stride 2 over 2 ranks: each rank its gate and up halves.
    full = torch.arange(8.0)
    shards = [
        shard_tensor_model_parallel_weight(full, 0, rank=rank, world_size=2, stride=2)
        for rank in range(2)
    ]
    assert [shard.tolist() for shard in shards] == [[0.0, 1.0, 4.0, 5.0], [2.0, 3.0, 6.0, 7.0]]
    with pytest.raises(ValueError, match="does not split into 2 tensor-parallel shards of 2"):
        shard_tensor_model_parallel_weight(torch.arange(6.0), 0, rank=0, world_size=2, stride=2)


def _strided_round_trip(rank: int, world_size: int) -> None:
    ps.initialize_model_parallel(tensor_model_parallel_size=world_size)
    torch.manual_seed(5)
    layer = ColumnParallelLinear(HIDDEN, FFN, gather_output=False, stride=2)
    torch.manual_seed(5)
    full = torch.empty(FFN, HIDDEN)
    default_init_method(full)
    assert torch.equal(gather_tensor_model_parallel_weight(layer.weight), full)
    assert layer.weight.partition_stride == 2 and layer.bias.partition_stride == 2
    ps.destroy_model_parallel()


def test_strided_column_parallel_weight_gathers_to_the_full_weight():
    run_distributed(_strided_round_trip, 2)
