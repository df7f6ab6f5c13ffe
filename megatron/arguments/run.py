"""Megatron-LM's flags that shape the run: training, learning rate, checkpointing, validation,
data and logging (the distributed layout's are in megatron.arguments.distributed).
"""

from __future__ import annotations

import argparse

# Flags Megatron-LM accepts that select a fused CUDA kernel or an overlap we do not implement
# separately; they parse so existing launch scripts run, and change nothing.
NO_EFFECT = "Accepted for Megatron-LM compatibility; has no effect in this framework."

# Megatron-Core's names for the learning-rate shapes; megatron/optimizer/lr_schedule.py computes
# each and is the only reader.
LR_DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
LR_WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


def add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="training")
    group.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        help="Samples per model replica per forward/backward pass.",
    )
    group.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="Samples per optimizer step; a multiple of micro-batch-size x data-parallel size. "
        "Defaults to micro-batch-size x data-parallel size.",
    )
    group.add_argument(
        "--rampup-batch-size",
        nargs="*",
        default=None,
        help="Megatron's batch-size ramp-up (start increment samples). Not supported here.",
    )
    group.add_argument(
        "--recompute-granularity",
        type=str,
        default=None,
        choices=["full", "selective"],
        help="Recompute activations in the backward pass: whole layers (full) or only the "
        "core attention (selective).",
    )
    group.add_argument(
        "--recompute-method",
        type=str,
        default=None,
        choices=["uniform", "block"],
        help="With full recompute: checkpoint every chunk of --recompute-num-layers layers "
        "(uniform) or only the first --recompute-num-layers layers (block).",
    )
    group.add_argument(
        "--recompute-num-layers",
        type=int,
        default=1,
        help="Layers per recompute chunk (uniform) or layers recomputed (block).",
    )
    group.add_argument(
        "--checkpoint-activations",
        action="store_true",
        help="Deprecated Megatron alias of --recompute-granularity full "
        "--recompute-method uniform.",
    )
    group.add_argument(
        "--train-iters",
        type=int,
        default=None,
        help="Total iterations to train over all runs (exclusive with --train-samples).",
    )
    group.add_argument(
        "--train-samples",
        type=int,
        default=None,
        help="Total samples to train over all runs (exclusive with --train-iters).",
    )
    group.add_argument(
        "--log-interval", type=int, default=100, help="Iterations between log lines."
    )
    group.add_argument(
        "--exit-interval",
        type=int,
        default=None,
        help="Exit once the iteration number is divisible by this value.",
    )
    group.add_argument(
        "--exit-duration-in-mins",
        type=int,
        default=None,
        help="Save and exit after this many minutes of training.",
    )
    group.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="Save a checkpoint and exit when SIGTERM is received.",
    )
    group.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action="store_true",
        default=True,
        help="Stop the run at an iteration whose loss or gradient norm is NaN or infinite, "
        "before anything of it is saved, naming the last good checkpoint (the default; fp16 "
        "loss-scale skips go on as before).",
    )
    group.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        action="store_false",
        dest="check_for_nan_in_loss_and_grad",
        help="Train on through non-finite losses and gradient norms (they are counted in the "
        "log line's `number of nan iterations`); a checkpoint is still never saved with "
        "non-finite weights.",
    )
    group.add_argument(
        "--tensorboard-dir", type=str, default=None, help="Write TensorBoard logs here."
    )
    group.add_argument(
        "--no-masked-softmax-fusion",
        action="store_false",
        dest="masked_softmax_fusion",
        help=NO_EFFECT,
    )
    group.add_argument(
        "--no-bias-gelu-fusion", action="store_false", dest="bias_gelu_fusion", help=NO_EFFECT
    )
    group.add_argument(
        "--no-bias-dropout-fusion",
        action="store_false",
        dest="bias_dropout_fusion",
        help=NO_EFFECT,
    )
    group.add_argument(
        "--no-gradient-accumulation-fusion",
        action="store_false",
        dest="gradient_accumulation_fusion",
        help="In bf16/fp16 MoE training, let autocast cast the fp32 expert weights in every "
        "micro-batch and autograd accumulate their gradients, instead of bf16/fp16 copies "
        "refreshed once per step and a fused add of their gradients, two micro-batches at a "
        "time (moe.experts.refresh_compute_weights): slower, and 4 bytes per expert weight "
        "less memory. Other layers: no effect.",
    )
    group.add_argument(
        "--no-async-tensor-model-parallel-allreduce",
        action="store_false",
        dest="async_tensor_model_parallel_allreduce",
        help=NO_EFFECT,
    )
    group.add_argument(
        "--use-flash-attn",
        action="store_true",
        help="Accepted for Megatron compatibility: attention always runs through torch SDPA, "
        "which picks the flash kernels on GPUs that have them.",
    )
    group.add_argument(
        "--deterministic-mode",
        action="store_true",
        help="Bit-exact reruns and resumes on GPUs: torch's deterministic algorithms (which "
        "torch.compile's kernels follow too), CUBLAS_WORKSPACE_CONFIG=:4096:8 and NCCL_ALGO=Ring "
        "unless set. Off, GPU runs of the same flags differ in the last digits.",
    )
    group.add_argument(
        "--no-torch-compile",
        action="store_false",
        dest="torch_compile",
        help="Run the model eagerly on GPUs (by default dense models are compiled with "
        "torch.compile, which fuses their elementwise work; MoE models and the CPU always run "
        "eagerly).",
    )
    group.add_argument(
        "--optimizer", type=str, default="adam", choices=["adam", "sgd"], help="Optimizer."
    )


def add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="learning rate")
    group.add_argument("--lr", type=float, default=None, help="Peak learning rate.")
    group.add_argument(
        "--lr-decay-style",
        type=str,
        default="linear",
        choices=LR_DECAY_STYLES,
        help="Learning-rate decay function after warmup. WSD (warmup-stable-decay) holds --lr "
        "until the last --lr-wsd-decay-iters (or -samples) of the decay length, then decays to "
        "--min-lr by --lr-wsd-decay-style.",
    )
    group.add_argument(
        "--lr-wsd-decay-style",
        type=str,
        default="exponential",
        choices=LR_WSD_DECAY_STYLES,
        help="Shape of WSD's final decay from --lr to --min-lr.",
    )
    group.add_argument(
        "--lr-wsd-decay-iters",
        type=int,
        default=None,
        help="Iterations of WSD's final decay, the end of --lr-decay-iters (needed with "
        "--lr-decay-style WSD and --train-iters).",
    )
    group.add_argument(
        "--lr-wsd-decay-samples",
        type=int,
        default=None,
        help="Samples of WSD's final decay, the end of --lr-decay-samples (needed with "
        "--lr-decay-style WSD and --train-samples).",
    )
    group.add_argument(
        "--lr-decay-iters",
        type=int,
        default=None,
        help="Iterations to decay the learning rate over; defaults to --train-iters.",
    )
    group.add_argument(
        "--lr-decay-samples",
        type=int,
        default=None,
        help="Samples to decay the learning rate over; defaults to --train-samples.",
    )
    group.add_argument(
        "--lr-warmup-fraction",
        type=float,
        default=None,
        help="Fraction of the decay iterations (or samples) spent in linear warmup.",
    )
    group.add_argument(
        "--lr-warmup-iters", type=int, default=0, help="Iterations of linear warmup."
    )
    group.add_argument("--lr-warmup-samples", type=int, default=0, help="Samples of linear warmup.")
    group.add_argument(
        "--min-lr", type=float, default=0.0, help="Floor of the learning rate after decay."
    )
    group.add_argument(
        "--override-opt_param-scheduler",
        "--override-opt-param-scheduler",
        action="store_true",
        help="On resume, take the schedule (lr, min lr, warmup, decay length and style) from "
        "this run's flags instead of the checkpoint's; the samples consumed still come from "
        "the checkpoint.",
    )
    group.add_argument(
        "--use-checkpoint-opt_param-scheduler",
        "--use-checkpoint-opt-param-scheduler",
        action="store_true",
        help="On resume, take the schedule (lr, min lr, warmup, decay length and style) from "
        "the checkpoint, whatever this run's flags say.",
    )


def add_checkpointing_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="checkpointing")
    group.add_argument("--save", type=str, default=None, help="Directory to save checkpoints to.")
    group.add_argument(
        "--save-interval", type=int, default=None, help="Iterations between checkpoint saves."
    )
    group.add_argument(
        "--no-save-optim",
        action="store_true",
        default=None,
        help="Do not save the optimizer state.",
    )
    group.add_argument(
        "--no-save-rng", action="store_true", default=None, help="Do not save the RNG state."
    )
    group.add_argument(
        "--load",
        type=str,
        default=None,
        help="Directory to load a checkpoint from; training starts from scratch if it holds none.",
    )
    group.add_argument(
        "--no-load-optim",
        action="store_true",
        default=None,
        help="Do not load the optimizer state.",
    )
    group.add_argument(
        "--no-load-rng", action="store_true", default=None, help="Do not load the RNG state."
    )
    group.add_argument(
        "--finetune",
        action="store_true",
        help="Load only the model weights and start at iteration 0 (no optimizer or RNG state).",
    )
    group.add_argument(
        "--ckpt-format",
        choices=["torch_dist", "torch"],
        default="torch_dist",
        help="Format of saved checkpoints: torch_dist (every rank writes its own shards through "
        "torch.distributed.checkpoint, in parallel) or torch (one Megatron model_optim_rng.pt "
        "written by rank 0). Loading reads either, whatever this flag says.",
    )
    group.add_argument(
        "--async-save",
        action="store_true",
        help="Write torch_dist checkpoints in the background: training waits only while the "
        "state is copied to host memory.",
    )
    group.add_argument(
        "--keep-latest-checkpoints",
        type=int,
        default=None,
        metavar="N",
        help="Keep only the newest N checkpoints under --save, deleting older ones once a newer "
        "one is complete (default: keep all).",
    )


def add_validation_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="validation")
    group.add_argument(
        "--eval-iters", type=int, default=100, help="Iterations per validation/test run."
    )
    group.add_argument(
        "--eval-interval", type=int, default=1000, help="Iterations between validation runs."
    )


def add_data_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="data and dataloader")
    group.add_argument(
        "--data-path",
        nargs="*",
        default=None,
        help="A dataset prefix, or 'WEIGHT PREFIX WEIGHT PREFIX ...' to blend; divided into "
        "train/valid/test by --split. Exclusive with --train/valid/test-data-path.",
    )
    group.add_argument(
        "--split",
        type=str,
        default="969, 30, 1",
        help="Train, validation and test proportions of --data-path, e.g. '949,50,1'.",
    )
    for split in ("train", "valid", "test"):
        group.add_argument(
            f"--{split}-data-path",
            nargs="*",
            default=None,
            help=f"The {split} dataset: a prefix or 'WEIGHT PREFIX ...' pairs.",
        )
    group.add_argument(
        "--data-cache-path",
        type=str,
        default=None,
        help="Directory for the datasets' index caches (written by global rank 0, read by every "
        "rank), instead of beside the data: for a read-only or shared dataset directory.",
    )
    group.add_argument(
        "--mock-data",
        action="store_true",
        help="Train, validate and test on synthetic tokens (megatron/data/mock_dataset.py) "
        "instead of a dataset: for throughput runs without a corpus. Exclusive with "
        "--data-path and --train/valid/test-data-path.",
    )
    group.add_argument("--seq-length", type=int, default=None, help="Tokens per training sample.")
    group.add_argument("--num-workers", type=int, default=2, help="DataLoader worker processes.")
    group.add_argument(
        "--data-impl",
        "--dataset-impl",
        dest="data_impl",
        type=str,
        default="infer",
        choices=["lazy", "cached", "mmap", "infer"],
        help="Indexed-dataset implementation; only mmap files are read (infer finds mmap).",
    )
    group.add_argument(
        "--reset-position-ids",
        action="store_true",
        help="Restart position ids after each end-of-document token.",
    )
    group.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="Stop attention across end-of-document tokens.",
    )
    group.add_argument(
        "--eod-mask-loss", action="store_true", help="Exclude end-of-document tokens from the loss."
    )


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(title="logging")
    group.add_argument(
        "--log-params-norm", action="store_true", help="Compute and log the parameter norm."
    )
    group.add_argument(
        "--log-num-zeros-in-grad",
        action="store_true",
        help="Compute and log the number of zeros in the gradient.",
    )
    group.add_argument(
        "--timing-log-level",
        type=int,
        default=0,
        choices=range(0, 3),
        help="0: iteration time only; 1: also once-per-iteration operations; 2: everything.",
    )
    group.add_argument(
        "--tensorboard-log-interval",
        type=int,
        default=1,
        help="Iterations between TensorBoard writes.",
    )
    group.add_argument(
        "--tensorboard-queue-size",
        type=int,
        default=1000,
        help="Pending TensorBoard events before a flush to disk.",
    )
    group.add_argument(
        "--log-timers-to-tensorboard", action="store_true", help="Write timers to TensorBoard."
    )
    group.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Write validation perplexity to TensorBoard.",
    )
    group.add_argument(
        "--log-memory-to-tensorboard",
        action="store_true",
        help="Write memory statistics to TensorBoard.",
    )
    # Megatron-LM's Weights & Biases flags, with its empty-string defaults.
    group.add_argument(
        "--wandb-project",
        type=str,
        default="",
        help="Log TensorBoard's scalars to this Weights & Biases project too (off when empty).",
    )
    group.add_argument("--wandb-exp-name", type=str, default="", help="The W&B run's name.")
    group.add_argument(
        "--wandb-save-dir",
        type=str,
        default="",
        help="Where W&B keeps its local files (default: <--save>/wandb, else ./wandb).",
    )
    group.add_argument("--wandb-entity", type=str, default="", help="The W&B team or user.")
    group.add_argument(
        "--profile",
        action="store_true",
        help="Profile iterations --profile-step-start+1 .. --profile-step-end on --profile-ranks: "
        "with --use-pytorch-profiler a torch.profiler trace in --tensorboard-dir, otherwise "
        "CUDA's profiler range and NVTX ranges for `nsys profile --capture-range=cudaProfilerApi`.",
    )
    group.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="With --profile: record with torch.profiler and write the trace (and a table of the "
        "costliest operations) to --tensorboard-dir.",
    )
    group.add_argument(
        "--profile-step-start",
        type=int,
        default=10,
        help="Iterations completed before profiling starts.",
    )
    group.add_argument(
        "--profile-step-end",
        type=int,
        default=12,
        help="Iterations completed when profiling stops.",
    )
    group.add_argument(
        "--profile-ranks",
        nargs="+",
        type=int,
        default=[0],
        help="Global ranks to profile.",
    )
    # Megatron-Core's names and meaning (megatron.training.memory_history).
    group.add_argument(
        "--record-memory-history",
        action="store_true",
        help="Record the CUDA caching allocator's history from before the model is built, and "
        "write a snapshot of it to --memory-snapshot-path on the last rank at every log line "
        "(for https://pytorch.org/memory_viz). Needs a GPU.",
    )
    group.add_argument(
        "--memory-snapshot-path",
        type=str,
        default=None,
        help="Where --record-memory-history writes its snapshot, a pickle "
        "(default: snapshot.pickle in the working directory).",
    )
