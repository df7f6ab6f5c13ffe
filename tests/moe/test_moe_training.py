"""pretrain_gpt.py with MoE layers: trains on the sample corpus, logs the load-balancing loss,
and rejects impossible MoE flags before any work."""

import re

import pytest

import pretrain_gpt
from gpt_pretraining import pretrain as training_run
from tests.tiny_gpt import tiny_gpt_args

MOE_LINE = re.compile(r" iteration +(\d+)/.*\| load balancing loss: ([0-9.E+-]+) \|")
# Shorter samples than the dense tests use: the same learning signal at a third of the cost.
SHORT = ("--seq-length", "32", "--max-position-embeddings", "32")


pytestmark = pytest.mark.usefixtures("reference_kernels")


def test_dmoe_top2_trains_and_logs_load_balancing_loss(data_prefix, capsys):
    args = tiny_gpt_args(
        data_prefix, *SHORT, "--moe-num-experts", "4", "--moe-top-k", "2", train_iters=16
    )
    result = pretrain_gpt.main(args)
    output = capsys.readouterr().out
    lines = MOE_LINE.findall(output)
    assert len(lines) == 16, output[-3000:]
    balance = [float(value) for _, value in lines]
    # Weight 0.1 times a loss that is 1 at perfect balance and larger otherwise.
    assert all(0.099 < value < 0.4 for value in balance), balance
    losses = [step["lm loss"] for step in result.losses]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.5, losses
    assert "number of parameters" in output


def test_the_run_shows_and_scopes_its_kernel_choices(data_prefix, capsys, monkeypatch):
    """The kernel mode (MEGATRON_KERNELS, read once) shows in the arguments block and holds for the
    run only; the grouped GEMM chosen for the device is named after the block."""
    from megatron.kernels import dispatch

    monkeypatch.setattr(dispatch, "_mode", "triton")  # what this process had before the run
    seen = []
    monkeypatch.setattr(
        training_run, "pretrain", lambda *args, **kwargs: seen.append(dispatch.kernel_mode())
    )
    pretrain_gpt.main(tiny_gpt_args(data_prefix, *SHORT, "--moe-num-experts", "4", train_iters=4))
    output = capsys.readouterr().out
    assert f"  kernels {'.' * 41} reference\n" in output
    assert "dMoE grouped GEMM: moe.kernels.grouped_gemm\n" in output
    assert seen == ["reference"] and dispatch.kernel_mode() == "triton"


def test_moe_with_capacity_every_other_layer_and_zloss(data_prefix, capsys):
    args = tiny_gpt_args(
        data_prefix, *SHORT,
        "--moe-num-experts", "4", "--moe-top-k", "1", "--no-moe-dropless",
        "--moe-capacity-factor", "1.5", "--moe-layer-freq", "2", "--moe-zloss-weight", "0.001",
        "--moe-router-bias-update-rate", "0.001", "--moe-impl", "grouped",
        train_iters=4, micro_batch=2, global_batch=4,
    )  # fmt: skip
    result = pretrain_gpt.main(args)
    output = capsys.readouterr().out
    assert " load balancing loss: " in output and " router z loss: " in output
    assert all("router z loss" in step for step in result.losses)
    assert len(result.losses) == 4


def test_per_layer_expert_load_in_the_log_and_tensorboard(data_prefix, capsys, tmp_path):
    """--moe-per-layer-logging: a line per log window with each MoE layer's expert load, and
    TensorBoard's histogram of tokens per expert with the max and min over the mean; the counts
    are every assignment of the window (4 samples x 32 tokens x top-2, before capacity drops)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = tiny_gpt_args(
        data_prefix, *SHORT,
        "--num-layers", "4", "--moe-num-experts", "4", "--moe-top-k", "2", "--moe-layer-freq", "2",
        "--no-moe-dropless", "--moe-capacity-factor", "1.0", "--moe-per-layer-logging",
        "--tensorboard-dir", str(tmp_path), "--log-interval", "2",
        train_iters=4, micro_batch=2, global_batch=4,
    )  # fmt: skip
    result = pretrain_gpt.main(args)
    output = capsys.readouterr().out
    lines = re.findall(
        r"\n expert load \(max / min tokens per expert over the mean\) \| "
        r"layer 0: (\d\.\d\d) / (\d\.\d\d) \| layer 2: (\d\.\d\d) / (\d\.\d\d) \|\n",
        output,
    )
    assert len(lines) == 2, output[-3000:]
    expert_load = result.records["expert load"]
    assert len(expert_load) == 2
    for window in expert_load:
        assert sorted(window) == [0, 2]
        assert all(sum(counts) == 2 * 4 * 32 * 2 for counts in window.values()), window
    events = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})  # keep them all
    events.Reload()
    for layer in (0, 2):
        histogram = events.Histograms(f"moe/tokens-per-expert layer {layer}")
        assert [event.step for event in histogram] == [2, 4]
        for event, window in zip(histogram, expert_load):
            assert event.histogram_value.sum == sum(window[layer])
            assert event.histogram_value.max == max(window[layer])
        highest = events.Scalars(f"moe/tokens-per-expert max-over-mean layer {layer}")
        last = expert_load[-1][layer]
        assert highest[-1].value == pytest.approx(max(last) / (sum(last) / 4))
    # Megatron-Core's meaning of the flag too: each MoE layer's unweighted load-balancing loss,
    # its mean over the window's training forwards, whose mean over the layers times
    # --moe-loss-weight (0.1) is the window's mean of the logged, weighted loss.
    per_layer = {
        layer: events.Scalars(f"moe/load balancing loss layer {layer}") for layer in (0, 2)
    }
    assert [event.step for event in per_layer[0]] == [2, 4] == [e.step for e in per_layer[2]]
    logged = [step["load balancing loss"] for step in result.losses]
    for window, (first, second) in enumerate(zip(per_layer[0], per_layer[2])):
        weighted = 0.1 * (first.value + second.value) / 2
        assert weighted == pytest.approx(sum(logged[2 * window : 2 * window + 2]) / 2, rel=1e-5)
    assert "moe/router z loss layer 0" not in events.Tags()["scalars"]  # no z-loss here


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--moe-per-layer-logging"], "--moe-per-layer-logging"),
        (["--moe-num-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5"),
        (
            ["--moe-num-experts", "4", "--expert-model-parallel-size", "2"],
            "--expert-model-parallel-size 2 does not divide the data-parallel size 1",
        ),
        (["--moe-num-experts", "4", "--moe-layer-freq", "3"], "--moe-layer-freq 3"),
        (
            ["--moe-num-experts", "4", "--moe-layer-freq", "[1,1,1]"],
            "--moe-layer-freq has 3 entries, but --num-layers is 2",
        ),
        (["--moe-num-experts", "4", "--moe-impl", "nope"], "--moe-impl"),
        (["--moe-num-experts", "4", "--swiglu", "--mlp-type", "mlp"], "--mlp-type glu"),
    ],
)
def test_bad_moe_flags_are_rejected_before_work(data_prefix, capsys, extra, message):
    with pytest.raises(SystemExit) as exit_info:
        pretrain_gpt.main(tiny_gpt_args(data_prefix, *extra))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error, error


def test_expert_weight_copies_train_exactly_like_casting_every_micro_batch(
    data_prefix,
    monkeypatch,
    capsys,
):
    """In bf16 the trainer keeps bf16 copies of the fp32 expert weights, refreshed at each step
    and evaluation (moe.experts.refresh_compute_weights), instead of a cast per micro-batch,
    and adds the micro-batches' expert gradients into the fp32 gradients itself, two at a time.
    Under torch DDP the copies leave accumulation to autograd; --no-gradient-accumulation-fusion
    turns both off. The copies round as the casts do and the fused adds are autograd's adds in
    its order, so all three runs are the same, bit for bit. Three micro-batches per step leave
    one gradient held for the flush after the last backward. A copy left stale after an
    optimizer step, or a micro-batch's gradient not added, would change the losses from the
    second iteration on."""
    import moe.training_hooks

    args = tiny_gpt_args(
        data_prefix, *SHORT, "--bf16", "--moe-num-experts", "4", "--moe-top-k", "2",
        "--moe-loss-weight", "0.1", "--eval-interval", "2",
        train_iters=4, micro_batch=2, global_batch=6,
    )  # fmt: skip
    runs = {}
    for name, extra in (("fused", []), ("cast", ["--no-gradient-accumulation-fusion"])):
        result = pretrain_gpt.main(args + extra)
        runs[name] = (result.losses, result.validation)
    monkeypatch.setattr(moe.training_hooks, "_expert_grads_in_place", lambda sync: False)
    result = pretrain_gpt.main(args)
    runs["copies, autograd's accumulation"] = (result.losses, result.validation)
    capsys.readouterr()
    assert len(runs["fused"][0]) == 4 and len(runs["fused"][1]) >= 2
    assert runs["fused"] == runs["cast"] == runs["copies, autograd's accumulation"]
    losses = [step["lm loss"] for step in runs["fused"][0]]
    assert len(set(losses)) == 4  # the weights did change between iterations
