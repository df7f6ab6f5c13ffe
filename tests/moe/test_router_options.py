"""Megatron-Core's routing options: where the weights come from (--no-moe-router-pre-softmax,
--moe-router-topk-scaling-factor), the router's precision (--moe-router-dtype), what the
balancing loss balances (--moe-router-load-balancing-type), and the losses the router returns by
name."""

import pytest
import torch

import pretrain_gpt
from megatron.config.sections import ModelConfig
from megatron.parallel import parallel_state
from moe.auxiliary_losses import MoEAuxiliaryLosses
from moe.config import MoEConfig
from moe.layers import build_moe_layer
from moe.router import (
    LOAD_BALANCING_LOSS,
    ROUTER_Z_LOSS,
    Router,
    load_balancing_loss,
    sequence_load_balancing_loss,
)
from moe.training_hooks import MoETrainingHooks
from tests.launch import run_distributed
from tests.tiny_gpt import tiny_gpt_args

SHORT = ("--seq-length", "32", "--max-position-embeddings", "32")


def _router(**overrides):
    torch.manual_seed(0)
    config = MoEConfig(**{"num_experts": 4, "top_k": 2, **overrides})
    return Router(8, config, init_std=0.5)


def test_softmax_after_top_k_weights_the_chosen_logits_alone():
    """Megatron-Core's default (Mixtral's weights): the same experts as the softmax over all,
    weighted by the softmax of their own logits, which is the renormalized top-k."""
    x = torch.randn(16, 8)
    after = _router(router_pre_softmax=False)(x)
    renormalized = _router(normalize_expert_weights=1.0)(x)
    assert torch.equal(after.expert_indices, renormalized.expert_indices)
    torch.testing.assert_close(after.expert_weights, renormalized.expert_weights)
    chosen = after.logits.gather(1, after.expert_indices)
    torch.testing.assert_close(after.expert_weights, chosen.softmax(dim=-1))
    # The balancing loss still sees every expert's softmax score.
    torch.testing.assert_close(after.scores, after.logits.softmax(dim=-1))


def test_top_k_scaling_factor_multiplies_the_weights_and_the_layers_output():
    x = torch.randn(16, 8)
    plain, scaled = _router()(x), _router(router_topk_scaling_factor=2.5)(x)
    torch.testing.assert_close(scaled.expert_weights, 2.5 * plain.expert_weights)

    model = ModelConfig(
        num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16,
        seq_length=4, max_position_embeddings=4, add_bias_linear=False,
    )  # fmt: skip
    tokens = torch.randn(2, 4, 8)
    outputs = []
    for factor in (None, 3.0):
        torch.manual_seed(0)
        config = MoEConfig(
            num_experts=4, top_k=2, mlp_impl="reference", router_topk_scaling_factor=factor
        )
        outputs.append(build_moe_layer(model, config)(tokens))
    torch.testing.assert_close(outputs[1], 3.0 * outputs[0])


def test_router_dtype_fp32_computes_the_logits_in_fp32_under_autocast():
    x = torch.randn(16, 8)
    for dtype, expected in ((None, torch.bfloat16), ("fp32", torch.float32)):
        router = _router(router_dtype=dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            routing = router(x.bfloat16())
        assert routing.logits.dtype == expected, dtype
    reference = x.bfloat16().float() @ router.layer.weight.t()
    torch.testing.assert_close(routing.logits, reference, rtol=1e-6, atol=1e-6)


def test_sequence_balancing_loss_hand_checked():
    """Two sequences of two tokens, top-1 of 2 experts: the first sends both tokens to expert 0
    with probability 0.75, the second one to each with probability 0.5."""
    indices = torch.tensor([[0], [0], [0], [1]])
    scores = torch.tensor([[0.75, 0.25], [0.75, 0.25], [0.5, 0.5], [0.5, 0.5]])
    # Sequence 1: 2 / 2 * (2 * 0.75 + 0) = 1.5; sequence 2: 2 / 2 * (0.5 + 0.5) = 1.0.
    loss = sequence_load_balancing_loss(indices, scores, sequences=2)
    assert loss.item() == pytest.approx(1.25)
    # One sequence: the micro-batch's loss.
    tokens_per_expert = torch.bincount(indices.view(-1), minlength=2)
    one = sequence_load_balancing_loss(indices, scores, sequences=1)
    torch.testing.assert_close(one, load_balancing_loss(tokens_per_expert, scores, top_k=1))


def _layer(**moe):
    model = ModelConfig(
        num_layers=2, hidden_size=8, num_attention_heads=2, ffn_hidden_size=16,
        seq_length=4, max_position_embeddings=4,
    )  # fmt: skip
    torch.manual_seed(0)
    config = MoEConfig(**{"num_experts": 2, "top_k": 1, "mlp_impl": "reference", **moe})
    layer = build_moe_layer(model, config)
    with torch.no_grad():
        # Expert 0 for tokens whose first feature is positive, expert 1 otherwise.
        layer.router.layer.weight.copy_(torch.zeros(2, 8))
        layer.router.layer.weight[0, 0], layer.router.layer.weight[1, 0] = 4.0, -4.0
    return layer


def test_global_balancing_counts_the_steps_micro_batches():
    """A micro-batch that sends everything to expert 0 and one that sends everything to expert
    1 are each unbalanced, but their step is balanced: global_aux_loss weighs the second's
    scores with the counts of both; aux_loss with its own."""
    first, second = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    first[..., 0], second[..., 0] = 1.0, -1.0
    local, step = _layer(), _layer(load_balancing_type="global_aux_loss")
    for layer in (local, step):
        layer(first)
        layer.auxiliary_losses = None
        layer(second)
    scores = step.router(second.view(-1, 8)).scores
    both = torch.tensor([8, 8])
    expected = load_balancing_loss(both, scores, top_k=1, counted_tokens=torch.tensor(16.0))
    torch.testing.assert_close(step.auxiliary_losses[LOAD_BALANCING_LOSS], expected)
    own = load_balancing_loss(torch.tensor([0, 8]), scores, top_k=1)
    torch.testing.assert_close(local.auxiliary_losses[LOAD_BALANCING_LOSS], own)
    assert own > 1.5 * expected
    assert step.router.step_assignments.tolist() == [8.0, 8.0, 16.0]
    # Evaluation balances each micro-batch alone and counts nothing.
    step.eval()
    step(first)
    assert step.router.step_assignments.tolist() == [8.0, 8.0, 16.0]


def test_losses_come_by_name_and_only_the_weighted_ones():
    x = torch.randn(2, 4, 8)
    cases = (
        ({}, {LOAD_BALANCING_LOSS}),
        ({"zloss_weight": 1e-3}, {LOAD_BALANCING_LOSS, ROUTER_Z_LOSS}),
        ({"load_balancing_type": "none", "zloss_weight": 1e-3}, {ROUTER_Z_LOSS}),
        ({"load_balancing_type": "none"}, set()),
    )
    for overrides, names in cases:
        layer = _layer(**overrides)
        layer(x)
        assert set(layer.auxiliary_losses) == names, overrides
        collected = MoEAuxiliaryLosses(layer)()
        assert set(collected) == names, overrides


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--moe-router-load-balancing-type", "sinkhorn"), "(sinkhorn is not implemented here"),
        (("--moe-router-load-balancing-type", "aux"), "'aux' is not one of"),
        (("--moe-router-dtype", "bf16"), "--moe-router-dtype 'bf16' is not one of"),
        (
            ("--moe-router-score", "sigmoid", "--no-moe-router-pre-softmax"),
            "--moe-router-score sigmoid has no softmax",
        ),
        (("--moe-router-topk-scaling-factor", "0"), "must be a finite number > 0"),
        (("--moe-router-topk-scaling-factor", "nan"), "must be a finite number > 0"),
    ],
)
def test_bad_routing_flags_are_refused_in_one_line(data_prefix, capsys, flags, message):
    args = tiny_gpt_args(data_prefix, *SHORT, "--moe-num-experts", "4", *flags, train_iters=4)
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(args)
    assert exit_info.value.code not in (0, None)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if message in line]
    assert len(lines) == 1, err


@pytest.mark.usefixtures("reference_kernels")
def test_a_run_without_a_balancing_loss_logs_none(data_prefix, capsys):
    """--moe-router-load-balancing-type none: no balancing term in the loss or the log line;
    global_aux_loss trains and logs its term."""
    none = pretrain_gpt.main(
        tiny_gpt_args(
            data_prefix, *SHORT, "--moe-num-experts", "4",
            "--moe-router-load-balancing-type", "none", "--moe-zloss-weight", "0.001",
            train_iters=3, micro_batch=2, global_batch=4,
        )
    )  # fmt: skip
    output = capsys.readouterr().out
    assert "load balancing loss" not in output and " router z loss: " in output
    assert all(set(step) >= {"lm loss", "router z loss"} for step in none.losses)
    assert not any("load balancing loss" in step for step in none.losses)

    result = pretrain_gpt.main(
        tiny_gpt_args(
            data_prefix, *SHORT, "--moe-num-experts", "4",
            "--moe-router-load-balancing-type", "global_aux_loss",
            train_iters=3, micro_batch=2, global_batch=4,
        )
    )  # fmt: skip
    balance = [step["load balancing loss"] for step in result.losses]
    assert len(balance) == 3 and all(0.099 < value < 0.4 for value in balance), balance


def test_each_step_counts_its_own_micro_batches():
    """The training hooks clear the step's balancing counts before its forwards."""
    layer = _layer(load_balancing_type="global_aux_loss")
    layer(torch.randn(2, 4, 8))
    assert layer.router.step_assignments[-1].item() == 8.0
    hooks = MoETrainingHooks(layer.config, None, num_layers=2, writes_metrics=False)
    hooks.before_forwards(layer)
    assert not layer.router.step_assignments.any()


def _global_balance_on_rank(rank: int, world_size: int, tokens: torch.Tensor) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        layer = _layer(load_balancing_type="global_aux_loss")
        layer(tokens[rank])
        scores = layer.router(tokens[rank].view(-1, 8)).scores
        return {
            "loss": layer.auxiliary_losses[LOAD_BALANCING_LOSS].detach(),
            "scores": scores.detach(),
            "counts": layer.router.step_assignments.clone(),
        }
    finally:
        parallel_state.destroy_model_parallel()


def test_global_balancing_counts_every_data_parallel_rank():
    """Two data-parallel ranks, one routing all its tokens to expert 0 and the other to expert
    1: each rank's loss weighs its own scores with the counts of both."""
    tokens = torch.randn(2, 2, 4, 8)
    tokens[0, ..., 0], tokens[1, ..., 0] = 1.0, -1.0
    results = run_distributed(_global_balance_on_rank, 2, tokens)
    for result in results:
        assert result["counts"].tolist() == [8.0, 8.0, 16.0]
        expected = load_balancing_loss(
            torch.tensor([8, 8]), result["scores"], top_k=1, counted_tokens=torch.tensor(16.0)
        )
        torch.testing.assert_close(result["loss"], expected)


def test_a_sigmoid_router_without_the_expert_bias_gets_a_note():
    """The balancing loss of a sigmoid router reads near balance whatever the counts (its
    normalized scores stay near uniform), so a run without the expert bias is told."""
    sigmoid = MoEConfig(num_experts=4, router_score="sigmoid")
    assert any("--moe-router-enable-expert-bias" in note for note in sigmoid.notes())
    for quiet in (
        MoEConfig(num_experts=4),
        MoEConfig(num_experts=4, router_score="sigmoid", router_bias_update_rate=1e-3),
        MoEConfig(num_experts=4, router_score="sigmoid", load_balancing_type="none"),
    ):
        assert not any("--moe-router-enable-expert-bias" in note for note in quiet.notes())


def test_the_balancing_loss_of_near_uniform_sigmoid_scores_stays_near_balance():
    """What the note is about: every token on expert 0, whose logit is 3 where the others' are 1.
    A softmax puts half of each token's probability there and the loss reads 4x its balanced
    value; the sigmoid scores (0.95 against 0.73) normalize to nearly uniform probabilities and
    the loss reads barely above balance."""
    logits = torch.ones(64, 8)
    logits[:, 0] = 3.0
    counts = torch.tensor([64, 0, 0, 0, 0, 0, 0, 0])
    softmax = load_balancing_loss(counts, logits.softmax(dim=-1), top_k=1)
    scores = logits.sigmoid()
    sigmoid = load_balancing_loss(counts, scores / scores.sum(dim=-1, keepdim=True), top_k=1)
    assert softmax.item() > 4.0 and sigmoid.item() < 1.3
