"""MegaBlocks' MoE (experts with a capacity; extra assignments dropped) and dMoE (dropless).

Both map hidden states [b, s, h] -> [b, s, h] like the dense MLP they replace. Each forward
leaves on the layer, for the training step to collect:
  `load_balancing_loss`, `router_z_loss`: this layer's unweighted losses (see moe.router);
  `tokens_per_expert`: a buffer with this forward's assignments per expert (before drops);
  `window_tokens_per_expert`: their sum over the training forwards since the trainer last took
  it (moe.expert_load: the per-layer expert load in the log and TensorBoard).
`MoEAuxiliaryLosses(model)()` turns them into the weighted terms added to the LM loss.

Backends (`--moe-impl`): "grouped" permutes with moe.kernels.permute and multiplies with
torch.bmm over capacity slots (MoE) or grouped_mm over sorted rows (dMoE); "sparse" uses the
block-sparse kernels (dMoE only); "reference" is the per-expert loop of moe.reference.

With `expert_model_parallel_size` > 1 the dMoE holds only its rank's block of experts and moves
assignments to the rank of their expert and back by all-to-all (moe.expert_parallel).
With `tensor_model_parallel_size` > 1 each TP rank holds a slice of every expert's ffn channels
and the layer routes, combines and reduces as moe.tensor_parallel describes; the two combine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from megatron import parallel_state
from megatron.config import ModelConfig
from megatron.model.mlp import MLP
from megatron.model.parallel_layers import check_tensor_parallel_state
from moe.config import MoEConfig
from moe.expert_parallel import expert_parallel_rank_and_size
from moe.experts import Experts
from moe.overlapped_exchange import OverlappedExchange, run_experts_overlapped
from moe.reference import reference_moe
from moe.router import (
    Router,
    Routing,
    balancing_probabilities,
    load_balancing_loss,
    router_z_loss,
    update_expert_bias,
)
from moe.tensor_parallel import (
    mark_sequence_parallel_parameters,
    reduce_expert_output,
    route_tensor_parallel,
)

SPARSE_UNAVAILABLE = (
    "--moe-impl sparse: block-sparse kernels are not available yet "
    "(moe/kernels/block_sparse with sparse_mlp); use --moe-impl grouped"
)


def _permute_ops():
    """moe.kernels.permute, with a message saying what to do when it is missing."""
    try:
        from moe.kernels import permute
    except ImportError as error:
        raise RuntimeError(
            "--moe-impl grouped needs the permutation kernels in moe/kernels/permute.py, which "
            "could not be imported; use --moe-impl reference"
        ) from error
    return permute


def _compiling() -> bool:
    """True while torch.compile traces the layer (never on a torch without torch.compiler)."""
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and compiler.is_compiling()


def _traceable_path_runs(tokens: torch.Tensor) -> bool:
    """Whether the compiled dropless layer can be one graph (moe.kernels.traceable): bf16, the
    only dtype torch._grouped_mm takes, on a device where it is fast. Otherwise the Triton path
    runs, breaking the graph."""
    from moe.kernels import traceable

    return tokens.dtype == torch.bfloat16 and traceable.runs_on(tokens.device)


def _in_backward() -> bool:
    """True while autograd runs a backward pass, i.e. when a checkpointed forward is being
    recomputed; such a re-run must not count tokens or move the expert bias again.

    Under torch.compile the forward's Python runs once, when traced: a recomputation inside the
    compiled backward does not re-run these side effects, so the answer there is False.
    """
    if _compiling():
        return False
    graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
    return graph_task_id is not None and graph_task_id() != -1


class MoELayer(nn.Module):
    """Router + experts (+ output bias, + optional shared expert); subclasses say how tokens
    reach the experts (`compute_experts`)."""

    def __init__(self, model_config: ModelConfig, moe_config: MoEConfig) -> None:
        super().__init__()
        moe_config.validate_expert_parallelism()
        self.config = moe_config
        self.hidden_size = model_config.hidden_size
        self.expert_parallel_rank, self.expert_parallel_size = expert_parallel_rank_and_size(
            moe_config
        )
        self.tensor_parallel = model_config.tensor_model_parallel_size > 1
        self.sequence_parallel = self.tensor_parallel and model_config.sequence_parallel
        if self.tensor_parallel:
            check_tensor_parallel_state(model_config)
        std = model_config.init_method_std
        output_std = std / math.sqrt(2.0 * model_config.num_layers)
        self.router = Router(model_config.hidden_size, moe_config, init_std=std)
        self.experts = Experts(
            moe_config.num_experts,
            model_config.hidden_size,
            model_config.ffn_hidden_size,
            mlp_type=moe_config.mlp_type,
            activation="silu" if model_config.swiglu else "gelu",
            memory_optimized=moe_config.memory_optimized_mlp,
            init_std=std,
            output_init_std=output_std,
            expert_parallel_size=self.expert_parallel_size,
            expert_parallel_rank=self.expert_parallel_rank,
            tensor_parallel_size=model_config.tensor_model_parallel_size,
            tensor_parallel_rank=parallel_state.get_tensor_model_parallel_rank(),
        )
        # MegaBlocks' experts have no biases; the layer adds one output bias (--bias).
        if model_config.add_bias_linear:
            self.bias = nn.Parameter(torch.zeros(model_config.hidden_size))
        else:
            self.register_parameter("bias", None)
        if self.sequence_parallel:
            mark_sequence_parallel_parameters(self.router, self.bias)
        # A dense MLP: under tensor parallelism its own parallel layers split and reduce it.
        self.shared_expert: Optional[MLP] = None
        if moe_config.shared_expert:
            shared_config = dataclasses.replace(
                model_config,
                ffn_hidden_size=moe_config.shared_expert_ffn_hidden_size
                or model_config.ffn_hidden_size,
            )
            self.shared_expert = MLP(shared_config)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(moe_config.num_experts, dtype=torch.long), False
        )
        self.register_buffer(
            "window_tokens_per_expert",
            torch.zeros(moe_config.num_experts, dtype=torch.long),
            False,
        )
        if moe_config.router_bias_update_rate > 0:
            # Counts since the last bias update; persistent so that a resumed run is exact.
            self.register_buffer("pending_tokens_per_expert", torch.zeros(moe_config.num_experts))
        self.load_balancing_loss: Optional[torch.Tensor] = None
        self.router_z_loss: Optional[torch.Tensor] = None

    def compute_experts(
        self, tokens: torch.Tensor, routing: Routing
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(output [T, h], tokens_per_expert [E]) for tokens [T, h] routed by `routing`."""
        raise NotImplementedError

    def update_expert_bias(self) -> None:
        """Apply the DeepSeek-V3 bias update for the tokens counted since the last one.

        Called by `forward` at the start of each training forward, so the bias moves once per
        micro-batch and never between a forward and its recomputation in backward.
        """
        pending = getattr(self, "pending_tokens_per_expert", None)
        if pending is None or not bool(pending.any()):
            return
        # Summed over the ranks holding this layer: under pipeline parallelism the other
        # stages hold other layers (and run their forwards at other times).
        group = (
            parallel_state.get_data_parallel_group()
            if parallel_state.model_parallel_is_initialized()
            else None
        )
        update_expert_bias(
            self.router.expert_bias, pending, self.config.router_bias_update_rate, group
        )
        pending.zero_()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[b, s, h] -> [b, s, h] ([b, s / tp, h] with sequence parallelism)."""
        recomputing = _in_backward()
        bias_update = self.training and self.config.router_bias_update_rate > 0
        if bias_update and not recomputing:
            self.update_expert_bias()
        tokens = hidden_states.reshape(-1, self.hidden_size)
        device_type = tokens.device.type
        if torch.is_autocast_enabled(device_type):
            # Permute in the compute dtype, as MegaBlocks does: half the bytes moved. The expert
            # kernels are autograd Functions autocast does not see; Experts casts their weights.
            tokens = tokens.to(torch.get_autocast_dtype(device_type))
        if self.tensor_parallel:
            routing, expert_tokens = route_tensor_parallel(
                self.router, tokens, hidden_states.shape, self.sequence_parallel
            )
        else:
            routing, expert_tokens = self.router(tokens), tokens
        output, tokens_per_expert = self.compute_experts(expert_tokens, routing)
        # Computed on recomputation too: a checkpointed re-run must save the same tensors.
        probabilities = balancing_probabilities(routing, self.config.router_score)
        balance_loss = load_balancing_loss(tokens_per_expert, probabilities, self.config.top_k)
        z_loss = router_z_loss(routing.logits)
        if not recomputing:
            self.load_balancing_loss, self.router_z_loss = balance_loss, z_loss
            with torch.no_grad():
                self.tokens_per_expert.copy_(tokens_per_expert)
                if self.training:
                    self.window_tokens_per_expert += tokens_per_expert
                if bias_update:
                    self.pending_tokens_per_expert += tokens_per_expert.float()
        if self.tensor_parallel:
            output = reduce_expert_output(output, hidden_states.shape, self.sequence_parallel)
        else:
            output = output.view(hidden_states.shape)
        if self.bias is not None:
            output = output + self.bias
        if self.shared_expert is not None:
            output = output + self.shared_expert(tokens.view(hidden_states.shape))
        return output

    def _reference(
        self, tokens: torch.Tensor, routing: Routing, capacity: Optional[int]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        return reference_moe(
            tokens,
            routing.expert_weights,
            routing.expert_indices,
            self.experts.forward_expert,
            self.config.num_experts,
            capacity,
        )

    def _sort(self, routing: Routing):
        """(flat weights, indices, bins, tokens_per_expert) of the stable sort by expert."""
        permute = _permute_ops()
        flat_indices = routing.expert_indices.reshape(-1).int()
        with torch.no_grad():
            tokens_per_expert = permute.expert_histogram(flat_indices, self.config.num_experts)
            _, indices = permute.sort_by_expert(flat_indices, self.config.num_experts)
            bins = torch.cumsum(tokens_per_expert, 0).int()
        return routing.expert_weights.reshape(-1), indices, bins, tokens_per_expert


class MoE(MoELayer):
    """MegaBlocks' MoE: each expert takes at most `expert_capacity(T)` assignments, the first
    ones in token order (assignment t * k + j); the rest contribute nothing."""

    def expert_capacity(self, num_tokens: int) -> int:
        """int(capacity_factor * top_k * T / E), MegaBlocks' rule; 0 means no limit."""
        config = self.config
        return int(config.capacity_factor * config.top_k * num_tokens / config.num_experts)

    def compute_experts(
        self, tokens: torch.Tensor, routing: Routing
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        capacity = self.expert_capacity(tokens.shape[0])
        if self.config.mlp_impl == "reference":
            return self._reference(tokens, routing, capacity or None)
        permute = _permute_ops()
        weights, indices, bins, tokens_per_expert = self._sort(routing)
        if capacity == 0:
            capacity = int(tokens_per_expert.max())
        top_k = self.config.top_k
        expert_inputs = permute.binned_gather(tokens, indices, bins, capacity, top_k)
        expert_outputs = self.experts.forward_batched(expert_inputs)
        output = permute.binned_scatter(expert_outputs, indices, weights, bins, top_k)
        return output, tokens_per_expert


class DroplessMoE(MoELayer):
    """MegaBlocks' dMoE: every assignment reaches its expert, whatever the imbalance."""

    def __init__(self, model_config: ModelConfig, moe_config: MoEConfig) -> None:
        super().__init__(model_config, moe_config)
        self.sparse_block_size = 0
        if moe_config.mlp_impl == "sparse":
            try:
                from moe.kernels.block_sparse import sparse_mlp  # noqa: F401
            except ImportError as error:
                raise RuntimeError(SPARSE_UNAVAILABLE) from error
            ffn = self.experts.local_ffn_hidden_size
            # MegaBlocks uses 128; smaller blocks let tiny models run the same kernels.
            self.sparse_block_size = next((b for b in (128, 64, 32, 16) if ffn % b == 0), 0)

    def compute_experts(
        self, tokens: torch.Tensor, routing: Routing
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        impl = self.config.mlp_impl
        if impl == "reference":
            return self._reference(tokens, routing, None)
        if self.expert_parallel_size > 1:
            return self._compute_experts_expert_parallel(tokens, routing)
        if impl == "grouped" and _compiling() and _traceable_path_runs(tokens):
            return self._grouped_traceable(tokens, routing)
        weights, indices, bins, tokens_per_expert = self._sort(routing)
        output = self._run_experts(
            tokens, indices, weights, bins, tokens_per_expert, self.config.top_k
        )
        return output, tokens_per_expert

    def _run_experts(
        self,
        rows: torch.Tensor,
        indices: torch.Tensor,
        weights: Optional[torch.Tensor],
        bins: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        top_k: int,
    ) -> torch.Tensor:
        """Gather `rows` into expert order (permute's `indices` and `bins`), run this rank's
        experts, scatter back weighted by `weights` (None: 1): [indices.numel() / top_k, h].

        On one rank the rows are the tokens and the permutation the routing's; under expert
        parallelism they are the received rows, put in expert order with top_k = 1.
        """
        if self.config.mlp_impl == "sparse":
            return self._sparse(rows, weights, indices, bins, tokens_per_expert, top_k)
        permute = _permute_ops()
        expert_inputs = permute.gather(rows, indices, bins, top_k)
        expert_outputs = self.experts.forward_grouped(expert_inputs, tokens_per_expert)
        return permute.scatter(expert_outputs, indices, weights, bins, top_k)

    # The all-to-all split sizes need a host sync, which no traced graph can hold: under
    # torch.compile this method runs eagerly, between graphs (docs/moe.md).
    @torch.compiler.disable
    def _compute_experts_expert_parallel(
        self, tokens: torch.Tensor, routing: Routing
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """compute_experts with the experts sharded over the expert-parallel group: rows to
        the ranks of their experts, the local experts, rows back (moe.expert_parallel), the
        all-to-alls overlapped with this rank's own rows (moe.overlapped_exchange)."""
        permute = _permute_ops()
        weights, indices, bins, tokens_per_expert = self._sort(routing)
        top_k = self.config.top_k
        # Sorted by global expert is sorted by destination rank: each rank's rows are one block.
        rows = permute.gather(tokens, indices, bins, top_k)
        exchange = OverlappedExchange.plan(
            tokens_per_expert, parallel_state.get_expert_model_parallel_group()
        )
        with self.experts.weights_cast_once(rows.dtype):
            returned = run_experts_overlapped(rows, exchange, self._run_local_experts)
        output = permute.scatter(returned, indices, weights, bins, top_k)
        return output, tokens_per_expert

    def _run_local_experts(
        self,
        rows: torch.Tensor,
        indices: Optional[torch.Tensor],
        bins: torch.Tensor,
        tokens_per_local_expert: torch.Tensor,
    ) -> torch.Tensor:
        """The local experts on rows in local-expert order (`indices` None) or put in that
        order by `indices` (moe.overlapped_exchange.RunExperts); outputs in the rows' order."""
        if indices is None and self.config.mlp_impl != "sparse":
            return self.experts.forward_grouped(rows, tokens_per_local_expert)
        if indices is None:  # the block-sparse path pads through a permutation: the identity
            indices = torch.arange(rows.shape[0], device=rows.device, dtype=torch.int32)
        return self._run_experts(rows, indices, None, bins, tokens_per_local_expert, top_k=1)

    def _grouped_traceable(
        self, tokens: torch.Tensor, routing: Routing
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The grouped backend as torch.compile sees it: same function, one graph (see
        moe.kernels.traceable), the permutation kernels generated and fused by Inductor."""
        from moe.kernels import traceable

        top_k = self.config.top_k
        order, slot_of, tokens_per_expert = traceable.sort_assignments(
            routing.expert_indices, self.config.num_experts
        )
        expert_inputs = traceable.gather_rows(tokens, order, slot_of, top_k)
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        # The router's weights scale the activations inside the experts rather than the
        # expert outputs in the combine: the combine's backward is then a plain gather, and the
        # weights' gradient a reduction fused into the activation's backward
        # (docs/benchmark-log.md).
        row_weights = routing.expert_weights.reshape(-1).index_select(0, order)
        expert_outputs = self.experts.forward_sorted_rows(expert_inputs, offsets, row_weights)
        output = traceable.sum_rows(expert_outputs, order, slot_of, top_k)
        return output, tokens_per_expert

    def _sparse(self, rows, weights, indices, bins, tokens_per_expert, top_k) -> torch.Tensor:
        from moe.kernels.block_sparse import Topology, sparse_mlp

        permute = _permute_ops()
        block = self.sparse_block_size
        experts = self.experts
        num_experts, hidden, ffn = experts.w1.shape
        w1, _, w2 = experts.projection_weights(rows.dtype)
        with torch.no_grad():
            padded_bins = permute.padded_bins(tokens_per_expert, block)
            topology = Topology.from_padded_bins(padded_bins, ffn, block)
        expert_inputs = permute.padded_gather(rows, indices, bins, padded_bins, top_k)
        # [E, h, f] -> [h, E*f] and [E, f, h] -> [E*f, h]: the block-sparse operand layouts.
        compute_dtype = expert_inputs.dtype  # autocast's dtype: weights cast like autocast would
        w1 = w1.to(compute_dtype).permute(1, 0, 2).reshape(hidden, num_experts * ffn)
        w2 = w2.to(compute_dtype).reshape(num_experts * ffn, hidden)
        expert_outputs = sparse_mlp(expert_inputs, w1, w2, topology)
        return permute.padded_scatter(expert_outputs, indices, weights, bins, padded_bins, top_k)


def build_moe_layer(model_config: ModelConfig, moe_config: MoEConfig) -> MoELayer:
    """The dMoE when `moe_config.dropless`, else the MoE with capacity."""
    if moe_config.mlp_impl == "sparse":
        if moe_config.mlp_type != "mlp" or model_config.swiglu:
            raise ValueError(
                "--moe-impl sparse supports --mlp-type mlp with GELU only; use --moe-impl grouped"
            )
        tensor_parallel_size = model_config.tensor_model_parallel_size
        if model_config.ffn_hidden_size % (16 * tensor_parallel_size) != 0:
            raise ValueError(
                f"--moe-impl sparse needs --ffn-hidden-size divisible by 16 x "
                f"--tensor-model-parallel-size {tensor_parallel_size}, got "
                f"{model_config.ffn_hidden_size}; use --moe-impl grouped"
            )
    layer_class = DroplessMoE if moe_config.dropless else MoE
    return layer_class(model_config, moe_config)


def moe_layers(model: nn.Module) -> List[Tuple[str, MoELayer]]:
    """(name, layer) of every MoE layer in `model`, in module order."""
    return [
        (name, module) for name, module in model.named_modules() if isinstance(module, MoELayer)
    ]


class MoEAuxiliaryLosses:
    """Collects the weighted auxiliary losses of a model's MoE layers after each forward.

    "load balancing loss": --moe-loss-weight * mean over MoE layers of each layer's loss
    (MegaBlocks' batched_load_balancing_loss when every layer is an MoE layer);
    "router z loss" (only with --moe-zloss-weight > 0): --moe-zloss-weight * mean over layers.

    Under pipeline parallelism each stage holds some of the layers: called with the model
    chunk that just ran, it returns that chunk's share, the weighted sum of its layers' losses
    over `num_moe_layers` (the whole model's count), so the shares add up to the terms of one
    process.
    """

    def __init__(self, model: nn.Module, num_moe_layers: Optional[int] = None) -> None:
        self.layers = [layer for _, layer in moe_layers(model)]
        self.num_moe_layers = num_moe_layers or len(self.layers)

    def __call__(self, chunk: Optional[nn.Module] = None) -> Dict[str, torch.Tensor]:
        """The losses of the latest forward of `chunk` (default: the whole model); clears
        them from its layers. {} when it holds no MoE layer."""
        layers = self.layers if chunk is None else [layer for _, layer in moe_layers(chunk)]
        if not layers:
            return {}
        config = layers[0].config
        if any(layer.load_balancing_loss is None for layer in layers):
            raise RuntimeError(
                "MoEAuxiliaryLosses called before every MoE layer ran a forward; call it once "
                "after each model forward"
            )
        # Sum over count: the shares of the stages add up to the mean over the model's layers.
        balance = torch.stack([layer.load_balancing_loss for layer in layers]).sum()
        losses = {"load balancing loss": config.loss_weight * (balance / self.num_moe_layers)}
        if config.zloss_weight > 0:
            z_loss = torch.stack([layer.router_z_loss for layer in layers]).sum()
            losses["router z loss"] = config.zloss_weight * (z_loss / self.num_moe_layers)
        for layer in layers:
            layer.load_balancing_loss = layer.router_z_loss = None
        return losses
