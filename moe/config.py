"""Typed MoE configuration (MegaBlocks' `Arguments`, MoE part), built from the `--moe-*` flags.

`MoEConfig.from_args(namespace, model_config)` validates the flags against the model and
raises `megatron.config.ConfigError` naming the flag, the value and what to change.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch

from megatron.config import Config, ConfigError, ModelConfig
from megatron.config.layer_pattern import is_marked, parse_pattern
from megatron.initialize import compute_device
from moe.exchange_flags import check_exchange, exchange_chunks, routed_rows_per_rank
from moe.kernels import grouped_gemm, quack_grouped_gemm
from moe.kernels.grouped_gemm import MOE, GroupedGemmBackend
from moe.megatron_core_flags import MEGABLOCKS_DEFAULTS as DEFAULTS
from moe.megatron_core_flags import capacity_rounds_up, resolve_moe_arguments

MLP_IMPLS = ("grouped", "sparse", "reference")
MLP_TYPES = ("mlp", "glu")
ROUTER_SCORES = ("softmax", "sigmoid")
# --moe-router-load-balancing-type, Megatron-Core's names: each micro-batch's assignments, each
# sequence's, the step's over every data-parallel rank, or no balancing loss (moe.router).
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}  # --moe-router-dtype
# --moe-grouped-gemm-kernel: the grouped GEMM choose_backend picks for the device, or QuACK's.
GROUPED_GEMM_KERNELS = ("auto", "quack")


@dataclass(frozen=True)
class MoEConfig:
    """What an MoE layer is built from; field names follow MegaBlocks' `moe_*` arguments.

    dropless=True builds MegaBlocks' dMoE (every token reaches its experts, capacity_factor
    unused); dropless=False builds MegaBlocks' MoE, whose experts take at most
    `int(capacity_factor * top_k * tokens / num_experts)` assignments each (0: no limit), or
    its ceil with `capacity_rounds_up` (Megatron-Core's --moe-expert-capacity-factor), and drop
    the last ones past it, or the lowest-weight ones with `drop_by_weight` (its `probs` policy).
    """

    num_experts: int
    top_k: int = DEFAULTS.top_k
    dropless: bool = DEFAULTS.dropless
    capacity_factor: float = DEFAULTS.capacity_factor
    capacity_rounds_up: bool = False
    drop_by_weight: bool = False
    loss_weight: float = DEFAULTS.loss_weight
    zloss_weight: float = DEFAULTS.zloss_weight
    jitter_eps: Optional[float] = None
    normalize_expert_weights: Optional[float] = None  # p of the p-norm; None: no normalization
    # Every layer_freq-th layer from 0, or one mark per layer (--moe-layer-freq's pattern form,
    # megatron.config.layer_pattern).
    layer_freq: Union[int, Tuple[bool, ...]] = 1
    mlp_impl: str = "grouped"
    mlp_type: str = "mlp"
    router_score: str = DEFAULTS.router_score
    router_bias_update_rate: float = 0.0  # DeepSeek-V3 aux-loss-free bias; 0 disables it
    load_balancing_type: str = "aux_loss"
    # The precision of the gate's logits and the routing weights; None: the compute dtype.
    router_dtype: Optional[str] = None
    # The weights are the chosen experts' softmax over all experts (MegaBlocks); False: the
    # softmax over the chosen logits alone (Megatron-Core's default).
    router_pre_softmax: bool = DEFAULTS.router_pre_softmax
    router_topk_scaling_factor: Optional[float] = None  # the weights' multiplier; None: 1
    # Benchmarks only: experts drawn uniformly at random instead of the top-k (moe.router).
    router_force_load_balancing: bool = False
    # Under expert parallelism, exchange fixed-size blocks of this many times the balanced
    # share instead of exact splits (moe.exchange.fixed_blocks: no host sync); None: exact
    # splits.
    expert_parallel_buffer_factor: Optional[float] = None
    # Chunks the fixed-size blocks are cut into, each one's all-to-alls under the others'
    # experts (--moe-expert-parallel-chunked-overlap); 1: one exchange, no overlap.
    expert_parallel_chunks: int = 1
    shared_expert: bool = False
    shared_expert_ffn_hidden_size: Optional[int] = None
    # Each expert's FFN channels (--moe-ffn-hidden-size); None: the dense MLP's
    # (`expert_ffn_hidden_size`).
    ffn_hidden_size: Optional[int] = None
    memory_optimized_mlp: bool = False
    # Log each MoE layer's expert load after the iteration line (moe.expert_load).
    per_layer_logging: bool = False
    # What --moe-grouped-gemm-kernel asks for (GROUPED_GEMM_KERNELS); `grouped_gemm` is the
    # product chosen from it.
    grouped_gemm_kernel: str = "auto"
    # The dMoE's grouped product (a moe.kernels.grouped_gemm.GroupedGemmBackend): a run chooses
    # it once for its device and precision (`moe_config`); this default runs everywhere.
    grouped_gemm: GroupedGemmBackend = MOE

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether layer `layer_number` (0-based) gets experts: every `layer_freq`-th, from 0,
        or where the pattern marks it."""
        return is_marked(self.layer_freq, layer_number)

    def expert_ffn_hidden_size(self, model: ModelConfig) -> int:
        """Each expert's FFN channels: --moe-ffn-hidden-size, else the dense MLP's
        --ffn-hidden-size (the one place that default is taken)."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else model.ffn_hidden_size

    def num_moe_layers(self, num_layers: int) -> int:
        """How many of `num_layers` layers are MoE layers."""
        return sum(self.is_moe_layer(index) for index in range(num_layers))

    @classmethod
    def from_args(cls, args: argparse.Namespace, model: ModelConfig) -> Optional[MoEConfig]:
        """The MoE config of a parsed command line (its settings resolved, if they are not yet:
        moe.megatron_core_flags), or None without --moe-num-experts or --num-experts. How the
        experts are split over ranks is the layout's (ParallelConfig's
        expert_model_parallel_size); `check_expert_parallelism` checks the two together."""
        args = argparse.Namespace(**vars(args))
        resolve_moe_arguments(args)
        if args.moe_num_experts is None:
            if getattr(args, "expert_model_parallel_size", 1) != 1 or getattr(
                args, "moe_expert_model_parallelism", False
            ):
                raise ConfigError(
                    "--expert-model-parallel-size / --moe-expert-model-parallelism shard MoE "
                    "experts, but the model has none (no --moe-num-experts); add "
                    "--moe-num-experts N or drop the flag"
                )
            if getattr(args, "moe_per_layer_logging", False):
                raise ConfigError(
                    "--moe-per-layer-logging logs the MoE layers' expert load, but the model "
                    "has none (no --moe-num-experts); add --moe-num-experts N or drop the flag"
                )
            return None
        mlp_type = args.mlp_type or ("glu" if model.swiglu else "mlp")
        config = cls(
            num_experts=args.moe_num_experts,
            top_k=args.moe_top_k,
            dropless=args.moe_dropless,
            capacity_factor=args.moe_capacity_factor,
            capacity_rounds_up=capacity_rounds_up(args),
            drop_by_weight=args.moe_token_drop_policy == "probs",
            loss_weight=args.moe_loss_weight,
            zloss_weight=args.moe_zloss_weight,
            jitter_eps=args.moe_jitter_eps,
            normalize_expert_weights=args.moe_normalize_expert_weights,
            layer_freq=_moe_layers(args.moe_layer_freq),
            mlp_impl=args.mlp_impl,
            mlp_type=mlp_type,
            router_score=args.moe_router_score,
            router_bias_update_rate=args.moe_router_bias_update_rate,
            load_balancing_type=args.moe_router_load_balancing_type,
            router_dtype=args.moe_router_dtype,
            router_pre_softmax=args.moe_router_pre_softmax,
            router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
            router_force_load_balancing=args.moe_router_force_load_balancing,
            expert_parallel_buffer_factor=args.moe_expert_parallel_buffer_factor,
            expert_parallel_chunks=exchange_chunks(args),
            shared_expert=args.moe_shared_expert,
            shared_expert_ffn_hidden_size=args.moe_shared_expert_ffn_hidden_size,
            ffn_hidden_size=args.moe_ffn_hidden_size,
            memory_optimized_mlp=args.moe_memory_optimized_mlp,
            per_layer_logging=args.moe_per_layer_logging,
            grouped_gemm_kernel=args.moe_grouped_gemm_kernel,
        )
        if args.mlp_type == "mlp" and model.swiglu:
            raise ConfigError(
                "--swiglu asks for gated experts but --mlp-type mlp was given; "
                "use --mlp-type glu (SwiGLU experts) or drop --swiglu"
            )
        config.validate(model)
        return config

    def notes(self) -> List[str]:
        """Informational lines for rank 0 about how the flags were read."""
        notes = []
        if self.dropless and self.capacity_factor != 1.0:
            notes.append(
                f"--moe-capacity-factor {self.capacity_factor} is unused by the dropless dMoE; "
                "pass --no-moe-dropless for MoE with capacity"
            )
        if self.dropless and self.mlp_impl == "grouped":
            notes.append(f"dMoE grouped GEMM: {self.grouped_gemm.name}")
        if self.router_score == "softmax" and not self.router_pre_softmax and self.top_k == 1:
            notes.append(
                "--no-moe-router-pre-softmax at --moe-top-k 1: every token's expert weight is "
                "1, so the router learns from the load-balancing loss alone"
            )
        if (
            self.router_score == "sigmoid"
            and self.router_bias_update_rate == 0
            and self.load_balancing_type != "none"
        ):
            # Seen on real text (docs/moe.md, "Which routing to use"): the loss held its
            # balanced value while the busiest expert took 6-22 times the mean share.
            notes.append(
                "--moe-router-score sigmoid: the load-balancing loss sees little of a sigmoid "
                "router's imbalance (its per-token normalized scores stay near uniform); "
                "DeepSeek-V3 balances sigmoid routing with the expert bias, "
                "--moe-router-enable-expert-bias"
            )
        if self.router_force_load_balancing:
            notes.append(
                "--moe-router-force-load-balancing: experts are drawn at random, not chosen by "
                "the router (a benchmark mode: the model does not learn its routing)"
            )
        return notes

    def validate(self, model: ModelConfig) -> None:
        """Raise ConfigError for a combination the MoE layers cannot build."""
        if self.num_experts < 1:
            raise ConfigError(f"--moe-num-experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(
                f"--moe-top-k {self.top_k} must be between 1 and --moe-num-experts "
                f"{self.num_experts}; a token cannot pick more experts than exist"
            )
        if self.capacity_factor < 0:
            raise ConfigError(
                f"--moe-capacity-factor must be >= 0 (0: no token dropping), "
                f"got {self.capacity_factor}"
            )
        for flag, value in (
            ("--moe-loss-weight", self.loss_weight),
            ("--moe-zloss-weight", self.zloss_weight),
            ("--moe-router-bias-update-rate", self.router_bias_update_rate),
        ):
            if value < 0:
                raise ConfigError(f"{flag} must be >= 0, got {value}")
        if self.jitter_eps is not None and not 0.0 <= self.jitter_eps < 1.0:
            raise ConfigError(
                f"--moe-jitter-eps must be in [0, 1) (router inputs are scaled by "
                f"U(1-eps, 1+eps)), got {self.jitter_eps}"
            )
        if self.normalize_expert_weights is not None and self.normalize_expert_weights <= 0:
            raise ConfigError(
                "--moe-normalize-expert-weights is the p of a p-norm and must be > 0, "
                f"got {self.normalize_expert_weights}"
            )
        self._validate_moe_layers(model)
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ConfigError(f"--moe-ffn-hidden-size must be >= 1, got {self.ffn_hidden_size}")
        self._validate_router()
        if self.mlp_impl not in MLP_IMPLS:
            raise ConfigError(f"--moe-impl {self.mlp_impl!r} is not one of {MLP_IMPLS}")
        if self.mlp_type not in MLP_TYPES:
            raise ConfigError(f"--mlp-type {self.mlp_type!r} is not one of {MLP_TYPES}")
        if self.router_score not in ROUTER_SCORES:
            raise ConfigError(
                f"--moe-router-score {self.router_score!r} is not one of {ROUTER_SCORES}"
            )
        factor = self.expert_parallel_buffer_factor
        # Not `factor < 1.0` alone: NaN compares false with everything.
        if factor is not None and not (math.isfinite(factor) and factor >= 1.0):
            raise ConfigError(
                f"--moe-expert-parallel-buffer-factor must be a finite number >= 1 (blocks of at "
                f"least the balanced share), got {factor}"
            )
        self._validate_sparse(model)
        self._validate_tensor_parallel_split(model)
        if self.grouped_gemm_kernel not in GROUPED_GEMM_KERNELS:
            raise ConfigError(
                f"--moe-grouped-gemm-kernel {self.grouped_gemm_kernel!r} is not one of "
                f"{GROUPED_GEMM_KERNELS}"
            )
        if self.grouped_gemm_kernel != "auto" and not (
            self.dropless and self.mlp_impl == "grouped"
        ):
            raise ConfigError(
                f"--moe-grouped-gemm-kernel {self.grouped_gemm_kernel} chooses the dropless dMoE's "
                "grouped GEMM (--moe-impl grouped), which --no-moe-dropless and --moe-impl "
                "sparse or reference do not run: drop the flag"
            )
        if self.shared_expert_ffn_hidden_size is not None:
            if not self.shared_expert:
                raise ConfigError("--moe-shared-expert-ffn-hidden-size needs --moe-shared-expert")
            if self.shared_expert_ffn_hidden_size < 1:
                raise ConfigError(
                    "--moe-shared-expert-ffn-hidden-size must be >= 1, got "
                    f"{self.shared_expert_ffn_hidden_size}"
                )

    def _validate_router(self) -> None:
        """The routing flags Megatron-Core names: known values, and no flag that would do
        nothing with the score function chosen."""
        if self.load_balancing_type not in LOAD_BALANCING_TYPES:
            hint = (
                f" ({self.load_balancing_type} is not implemented here; global_aux_loss, or none "
                "with --moe-router-enable-expert-bias, balance without a per-batch loss)"
                if self.load_balancing_type in ("sinkhorn", "quantile_balancing")
                else ""
            )
            raise ConfigError(
                f"--moe-router-load-balancing-type {self.load_balancing_type!r} is not one of "
                f"{LOAD_BALANCING_TYPES}{hint}"
            )
        if self.router_dtype is not None and self.router_dtype not in ROUTER_DTYPES:
            raise ConfigError(
                f"--moe-router-dtype {self.router_dtype!r} is not one of {tuple(ROUTER_DTYPES)}; drop "
                "the flag to route in the compute dtype"
            )
        if not self.router_pre_softmax and self.router_score != "softmax":
            raise ConfigError(
                "--no-moe-router-pre-softmax takes the softmax over the chosen experts' logits, "
                f"but --moe-router-score {self.router_score} has no softmax; drop one of the two"
            )
        factor = self.router_topk_scaling_factor
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            raise ConfigError(
                f"--moe-router-topk-scaling-factor must be a finite number > 0 (it multiplies "
                f"the routing weights), got {factor}"
            )

    def _validate_moe_layers(self, model: ModelConfig) -> None:
        """--moe-layer-freq: an integer within the layers, or one mark per layer, some marked."""
        if isinstance(self.layer_freq, int):
            if not 1 <= self.layer_freq <= model.num_layers:
                raise ConfigError(
                    f"--moe-layer-freq {self.layer_freq} must be between 1 and --num-layers "
                    f"{model.num_layers}"
                )
            return
        if len(self.layer_freq) != model.num_layers:
            raise ConfigError(
                f"--moe-layer-freq has {len(self.layer_freq)} entries, but --num-layers is "
                f"{model.num_layers}; give one 0 or 1 per layer"
            )
        if not any(self.layer_freq):
            raise ConfigError(
                "--moe-layer-freq marks no layer as an MoE layer (all 0s); mark some with 1, "
                "or drop --moe-num-experts for a dense model"
            )

    def _validate_sparse(self, model: ModelConfig) -> None:
        """The block-sparse backend: the dMoE's, GELU experts only, whole blocks of 16 of each
        expert's channels on each tensor-parallel rank."""
        if self.mlp_impl != "sparse":
            return
        if not self.dropless:
            raise ConfigError(
                "--moe-impl sparse is the dropless dMoE's block-sparse backend; with "
                "--no-moe-dropless use --moe-impl grouped or reference"
            )
        if self.mlp_type != "mlp" or model.swiglu:
            raise ConfigError(
                "--moe-impl sparse supports --mlp-type mlp with GELU only; use --moe-impl grouped"
            )
        tensor = model.tensor_model_parallel_size
        ffn = self.expert_ffn_hidden_size(model)
        if ffn % (16 * tensor) != 0:
            flag = "--ffn-hidden-size" if self.ffn_hidden_size is None else "--moe-ffn-hidden-size"
            raise ConfigError(
                f"--moe-impl sparse with --tensor-model-parallel-size {tensor} needs {flag} "
                f"divisible by {16 * tensor} (each rank's channels of an expert form blocks of "
                f"16), got {ffn}; use --moe-impl grouped"
            )

    def _validate_tensor_parallel_split(self, model: ModelConfig) -> None:
        """Every expert's channels, and the shared expert's, split over the tensor-parallel
        ranks like a dense MLP's (the dense --ffn-hidden-size is megatron's to check)."""
        tensor = model.tensor_model_parallel_size
        if tensor == 1:
            return
        ffn = self.ffn_hidden_size
        if ffn is not None and ffn % tensor != 0:
            raise ConfigError(
                f"--moe-ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size "
                f"{tensor}: each tensor-parallel rank holds an equal share of every expert's "
                f"channels; choose a multiple of {tensor}"
            )
        shared = self.shared_expert_ffn_hidden_size or model.ffn_hidden_size
        if self.shared_expert and shared % tensor != 0:
            raise ConfigError(
                f"--moe-shared-expert-ffn-hidden-size {shared} is not divisible by "
                f"--tensor-model-parallel-size {tensor}: the shared expert's channels are split "
                f"evenly over the tensor-parallel ranks; choose a multiple of {tensor}"
            )

    def check_expert_parallelism(self, size: int) -> None:
        """Raise ConfigError unless the layers can split these experts over `size`
        expert-parallel ranks (ParallelConfig.expert_model_parallel_size, which already divides
        the data-parallel size); the layers check again when placed."""
        if size == 1:
            return
        if self.num_experts % size != 0:
            raise ConfigError(
                f"--moe-num-experts {self.num_experts} is not divisible by the expert parallel "
                f"size {size} (--expert-model-parallel-size, or the data-parallel size with "
                "--moe-expert-model-parallelism): each rank holds an equal block of experts; "
                f"choose a number of experts that is a multiple of {size}"
            )
        if self.mlp_impl == "reference":
            raise ConfigError(
                "--moe-impl reference runs every expert on one rank and has no expert-parallel "
                "form; use --moe-impl grouped or sparse, or expert parallel size 1"
            )


def _moe_layers(value: Union[int, str]) -> Union[int, Tuple[bool, ...]]:
    """--moe-layer-freq as MoEConfig keeps it: an integer as it is, a pattern read into one
    mark per layer (ConfigError, one line, for one that is not 0s and 1s)."""
    return value if isinstance(value, int) else parse_pattern("--moe-layer-freq", value)


def moe_config(args: argparse.Namespace, config: Config) -> Optional[MoEConfig]:
    """The run's MoE config from its resolved flags, for `Config.from_args(extensions=...)`;
    None without --moe-num-experts. The grouped GEMM is chosen for the device this process will
    compute on and the dtype its experts' rows will have (the autocast dtype)."""
    moe = MoEConfig.from_args(args, config.model)
    if moe is None:
        return None
    expert_parallel_size = config.parallel.expert_model_parallel_size
    moe.check_expert_parallelism(expert_parallel_size)
    check_exchange(moe, expert_parallel_size, routed_rows_per_rank(moe, config))
    return with_grouped_gemm_for(
        moe,
        config,
        compute_device(),
        config.numerics.compute_dtype,
        expert_parallel_size,
        config.model.tensor_model_parallel_size,
    )


def with_grouped_gemm_for(
    moe: MoEConfig,
    config: Config,
    device: torch.device,
    dtype: torch.dtype,
    expert_parallel_size: int,
    tensor_parallel_size: int,
) -> MoEConfig:
    """`moe` with the grouped GEMM for experts whose rows are `dtype` on `device`, each rank
    holding num_experts / expert_parallel_size of them, their FFN split tensor_parallel_size
    ways: the one place it is chosen, for a training run (moe_config) and for generation on
    another device or dtype. --moe-grouped-gemm-kernel auto takes `choose_backend`'s choice;
    quack takes QUACK, or refuses in one line where it cannot run (`_check_quack_runs`)."""
    model = config.model
    widths = (model.hidden_size, moe.expert_ffn_hidden_size(model) // tensor_parallel_size)
    if moe.grouped_gemm_kernel == "quack":
        _check_quack_runs(device, dtype, widths, config.training.kernels)
        return dataclasses.replace(moe, grouped_gemm=quack_grouped_gemm.QUACK)
    backend = grouped_gemm.choose_backend(
        device, dtype, widths, moe.num_experts // expert_parallel_size, config.training.kernels
    )
    return dataclasses.replace(moe, grouped_gemm=backend)


def _check_quack_runs(
    device: torch.device, dtype: torch.dtype, widths: Tuple[int, int], mode: str
) -> None:
    """ConfigError, one line, where --moe-grouped-gemm-kernel quack cannot run: its kernels
    (Hopper, Blackwell), bf16 rows of widths its TMA loads take, QuACK importable, and the
    kernel mode (MEGATRON_KERNELS) not forcing the references or our Triton kernels instead."""
    flag = "--moe-grouped-gemm-kernel quack"
    if mode != "auto":
        forced = "the PyTorch references" if mode == "reference" else "our Triton kernels"
        raise ConfigError(
            f"{flag} runs the dMoE's products on QuACK's kernels, but MEGATRON_KERNELS={mode} "
            f"forces {forced} everywhere; unset MEGATRON_KERNELS or drop the flag"
        )
    if not quack_grouped_gemm.quack_runs_on(device):
        raise ConfigError(
            f"{flag} runs on NVIDIA Hopper or Blackwell GPUs (sm90 or newer), and this process "
            f"computes on {_device_name(device)}; drop the flag (auto chooses for the device)"
        )
    if dtype != torch.bfloat16:
        raise ConfigError(
            f"{flag} multiplies bf16 rows, and this run's experts compute in "
            f"{str(dtype).replace('torch.', '')}; add --bf16 or drop the flag"
        )
    if not grouped_gemm.bf16_widths_are_tma_aligned(widths):
        raise ConfigError(
            f"{flag} needs expert widths that are multiples of 8 (16 bytes of bf16, for its TMA "
            f"loads), got --hidden-size {widths[0]} and {widths[1]} expert channels per "
            "tensor-parallel rank; choose multiples of 8 or drop the flag"
        )
    missing = quack_grouped_gemm.quack_missing()
    if missing is not None:
        raise ConfigError(
            f"{flag} needs the quack-kernels package, and quack.gemm_interface does not import "
            f"here ({missing}); pip install quack-kernels (the project's [quack] extra) or drop "
            "the flag"
        )


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    if torch.version.hip is not None:
        return torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
