"""--use-torch-fsdp2 (megatron.parallelize.fully_shard): pretrain_gpt.py's trainer in gloo
processes on a tiny GPT and dMoE in fp32, 20 iterations, against one process (the same losses
and grad norms within 1e-5) at world 2 and 4: plain, experts over the expert-data-parallel
ranks, under tensor parallelism, and hybrid sharding; its checkpoints resumed in other
layouts and other layouts' in it; and the bytes each rank holds."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import torch

import pretrain_gpt
from tests.launch import run_distributed
from tests.tiny_gpt import MOE_ARGS, run_expecting_error, tensorboard_scalars, tiny_gpt_args

ITERATIONS = 20
SAVED_AT = 10
TOLERANCE = 1e-5
FSDP2 = ("--use-torch-fsdp2",)
TP2 = ("--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64")
EP2 = ("--expert-model-parallel-size", "2")

# name: (model, world size, flags)
LAYOUTS = {
    "dense": ("dense", 2, FSDP2),
    "dmoe": ("dmoe", 2, FSDP2),
    "dmoe-ep2": (
        "dmoe",
        4,
        (*FSDP2, *EP2, "--recompute-granularity", "full", "--recompute-method", "uniform"),
    ),
    "dense-tp2-sp": ("dense", 4, (*FSDP2, *TP2, "--sequence-parallel")),
    "dense-hybrid-2x2": ("dense", 4, (*FSDP2, "--data-parallel-replicate-degree", "2")),
}


def _pretrain(rank: int, world_size: int, args: List[str]) -> None:
    os.environ.update(
        WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    pretrain_gpt.main(args)


def train(world_size: int, args: List[str], directory: Path) -> Dict:
    args = [*args, "--tensorboard-dir", str(directory / "tb")]
    run_distributed(_pretrain, world_size, args, timeout_s=300.0)
    return tensorboard_scalars(directory / "tb", ("lm loss", "grad-norm"))


def model_args(data_prefix: str, model: str, *extra: str) -> List[str]:
    return tiny_gpt_args(
        data_prefix, *(MOE_ARGS if model == "dmoe" else ()), *extra,
        seq_length=16, micro_batch=1, global_batch=4, train_iters=ITERATIONS, eval_iters=0,
    )  # fmt: skip


_RUNS: Dict[Tuple[str, ...], Dict] = {}


def run_once(world_size: int, args: List[str], tmp_path_factory) -> Dict:
    """One run per layout and flags in this file (the layouts' runs are also their saves)."""
    key = (str(world_size), *args)
    if key not in _RUNS:
        directory = tmp_path_factory.mktemp("run")
        _RUNS[key] = train(world_size, [*args, *_save(directory)], directory)
        _RUNS[key]["checkpoint"] = directory / "ckpt"
    return _RUNS[key]


def _save(directory: Path) -> List[str]:
    return ["--save", str(directory / "ckpt"), "--save-interval", str(SAVED_AT)]


def assert_same(run: Dict, reference: Dict, steps: range, names=("lm loss", "grad-norm")) -> None:
    for name in names:
        for step in steps:
            assert run[name][step] == pytest.approx(reference[name][step], rel=TOLERANCE), (
                name, step, reference[name], run[name],
            )  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fully_shard_gives_one_process(data_prefix, tmp_path_factory, layout):
    model, world_size, flags = LAYOUTS[layout]
    single = run_once(1, model_args(data_prefix, model), tmp_path_factory)
    sharded = run_once(world_size, model_args(data_prefix, model, *flags), tmp_path_factory)
    assert_same(sharded, single, range(1, ITERATIONS + 1))


def resume(world_size: int, args: List[str], checkpoint: Path, directory: Path) -> Dict:
    """The run of `args` from `checkpoint`'s iteration SAVED_AT (copied: a resume writes its
    own saves beside it)."""
    load = directory / "load"
    load.mkdir(parents=True)
    shutil.copytree(checkpoint / f"iter_{SAVED_AT:07d}", load / f"iter_{SAVED_AT:07d}")
    (load / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))
    return train(world_size, [*args, "--load", str(load)], directory)


def test_a_fully_sharded_run_resumes_exactly_in_its_layout(data_prefix, tmp_path, tmp_path_factory):
    """TP2 x FSDP2 with sequence parallelism, saved at iteration 10 and resumed with its RNG
    states: iterations 11-20 are the uninterrupted run's, bit for bit."""
    _, world_size, flags = LAYOUTS["dense-tp2-sp"]
    args = model_args(data_prefix, "dense", *flags)
    saved = run_once(world_size, args, tmp_path_factory)
    resumed = resume(world_size, args, saved["checkpoint"], tmp_path)
    for name in ("lm loss", "grad-norm"):
        for step in range(SAVED_AT + 1, ITERATIONS + 1):
            assert resumed[name][step] == saved[name][step], (name, step)


# (model, saved by: layout, resumed in: world size and flags)
RESUMES = {
    "fsdp2-tp2 -> fsdp2": ("dense", "dense-tp2-sp", 2, FSDP2),
    "fsdp2-tp2 -> zero1-tp2": ("dense", "dense-tp2-sp", 4, (*TP2, "--use-distributed-optimizer")),
    "fsdp2-tp2 -> one process": ("dense", "dense-tp2-sp", 1, ()),
    "fsdp2-ep2 -> one process": ("dmoe", "dmoe-ep2", 1, ()),
    "zero1-tp2 -> fsdp2": ("dense", "zero1-tp2", 2, FSDP2),
    "one process -> fsdp2-ep2": ("dmoe", "one process", 4, (*FSDP2, *EP2)),
    # --ckpt-format torch: the whole tensors, model and optimizer state, of which each rank
    # keeps its rows.
    "zero1, torch -> fsdp2": ("dmoe", "zero1, torch", 2, FSDP2),
    "zero1, torch -> fsdp2-ep2": ("dmoe", "zero1, torch", 4, (*FSDP2, *EP2)),
}
SAVERS = {
    "zero1-tp2": (4, (*TP2, "--use-distributed-optimizer")),
    "one process": (1, ()),
    "zero1, torch": (2, ("--use-distributed-optimizer", "--ckpt-format", "torch")),
}


@pytest.mark.parametrize("case", RESUMES)
def test_fully_shard_checkpoints_resume_in_other_layouts(
    data_prefix, tmp_path, tmp_path_factory, case
):
    """Saved at iteration 10 in one layout (torch_dist: each rank writes its rows; or
    --ckpt-format torch: the whole tensors, each rank keeping its rows), resumed in another:
    it continues the uninterrupted one-process run."""
    model, saver, world_size, flags = RESUMES[case]
    single = run_once(1, model_args(data_prefix, model), tmp_path_factory)
    saved_world, saved_flags = LAYOUTS[saver][1:] if saver in LAYOUTS else SAVERS[saver]
    saved = run_once(saved_world, model_args(data_prefix, model, *saved_flags), tmp_path_factory)
    # Other layouts: another number of saved RNG states than ranks (docs/training.md).
    args = model_args(data_prefix, model, *flags, "--no-load-rng")
    resumed = resume(world_size, args, saved["checkpoint"], tmp_path)
    assert_same(resumed, single, range(SAVED_AT + 1, ITERATIONS + 1), names=("lm loss",))


WIRE = (
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
)


def _one_step(rank: int, world_size: int, args: List[str]) -> Dict:
    """One step of the model of `args` built as pretrain_gpt.py builds it: the bytes of the
    weights, gradients and optimizer state this rank holds then, and the dtypes that crossed
    the wire in torch.distributed's gathers and reduce-scatters ({name: {dtype}})."""
    import torch.distributed as dist

    from gpt_pretraining import GPT_RUN
    from megatron.initialize import initialize_distributed, initialize_model_parallel
    from megatron.parallel.dtensors import local_part
    from megatron.parallel.parallel_state import destroy_model_parallel
    from megatron.parallelize.steps import parallelize

    wire: Dict[str, set] = {}
    for name in WIRE:
        if hasattr(dist, name):
            collective = getattr(dist, name)

            def recorded(output, input, *rest, _name=name, _collective=collective, **kwargs):
                kind = "gather" if "gather" in _name else "reduce-scatter"
                wire.setdefault(kind, set()).add(str(input.dtype))
                return _collective(output, input, *rest, **kwargs)

            setattr(dist, name, recorded)
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), MASTER_ADDR="127.0.0.1")
    config, _ = GPT_RUN.config_from_argv(args, world_size)
    context = initialize_distributed("gloo")
    parallel = config.parallel
    initialize_model_parallel(
        parallel.tensor_model_parallel_size, parallel.expert_model_parallel_size
    )
    try:
        with torch.device("meta"):
            whole = GPT_RUN.model(config)
        model = parallelize(whole, config, context)
        optimizer = model.data_parallel.build_optimizer(model.unwrapped)
        tokens = torch.randint(0, 50257, (1, 16), generator=torch.Generator().manual_seed(rank))
        dtype = config.numerics.compute_dtype if config.numerics.autocast else torch.float32
        with torch.autocast("cpu", dtype=dtype, enabled=config.numerics.autocast):
            loss = model.module(tokens, labels=tokens).float().mean()
        loss.backward()
        model.data_parallel.after_backwards(model.unwrapped)
        optimizer.step()
        params = list(model.unwrapped.parameters())
        state = [
            value
            for per_param in optimizer.optimizer.state.values()
            for value in per_param.values()
            if torch.is_tensor(value) and value.dim() > 0
        ]

        def held(tensors) -> int:
            return sum(local_part(t).numel() * t.element_size() for t in tensors)

        grads = [param.grad for param in params if param.grad is not None]
        return {"bytes": (held(params), held(grads), held(state)), "wire": wire}
    finally:
        destroy_model_parallel()


@pytest.mark.parametrize(
    "flags, shards",
    [
        ((*FSDP2, *EP2), 4),  # the dense weights over 4 ranks, each rank's experts over 2
        ((*FSDP2, "--data-parallel-replicate-degree", "2"), 2),  # 2 replicas of 2 shards
    ],
    ids=["fsdp2-ep2", "hybrid-2x2"],
)
def test_each_rank_holds_its_share_of_weights_gradients_and_state(data_prefix, flags, shards):
    """World 4: every rank holds 1/shards of one process's bytes of each (to the rows a
    shard's rounding moves), and the ranks together hold them 4/shards times."""
    args = model_args(data_prefix, "dmoe")
    (single,) = run_distributed(_one_step, 1, args, timeout_s=120.0)
    ranks = run_distributed(_one_step, 4, [*args, *flags], timeout_s=120.0)
    for index, kind in enumerate(("weights", "gradients", "optimizer state")):
        whole = single["bytes"][index]
        held = [rank["bytes"][index] for rank in ranks]
        assert sum(held) == whole * 4 // shards, (kind, whole, held)
        for part in held:
            assert part == pytest.approx(whole / shards, rel=0.02), (kind, whole, held)


@pytest.mark.parametrize("reduce_in_bf16", [False, True])
def test_bf16_weights_gather_in_bf16_and_gradients_reduce_in_fp32_unless_asked(
    data_prefix, reduce_in_bf16
):
    flags = [*FSDP2, "--bf16", *(["--grad-reduce-in-bf16"] if reduce_in_bf16 else [])]
    ranks = run_distributed(_one_step, 2, model_args(data_prefix, "dmoe", *flags), timeout_s=120)
    for rank in ranks:
        # The layers' weights in bf16; the embeddings, final norm and output layer in fp32.
        assert rank["wire"]["gather"] == {"torch.bfloat16", "torch.float32"}, rank["wire"]
        reduced = "torch.bfloat16" if reduce_in_bf16 else "torch.float32"
        assert rank["wire"]["reduce-scatter"] == {reduced}, rank["wire"]


def test_fully_shard_without_a_process_group_says_to_launch_with_torchrun(
    data_prefix, capsys, monkeypatch
):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    error = run_expecting_error([*model_args(data_prefix, "dense"), *FSDP2], capsys)
    assert "--use-torch-fsdp2 needs a process group: launch with torchrun" in error
