"""MegaBlocks' MoE (experts with a capacity; extra assignments dropped) and dMoE (dropless).

Both map hidden states [b, s, h] -> [b, s, h] like the dense MLP they replace. Each forward
leaves on the layer, for the training step to collect:
  `auxiliary_losses`: this layer's unweighted losses by name (moe.router.Router.auxiliary_losses);
  `tokens_per_expert`: a buffer with this forward's assignments per expert (before drops);
  `window_tokens_per_expert`: their sum over the training forwards since the trainer last took
  it (moe.expert_load: the per-layer expert load in the log and TensorBoard); with
  --moe-per-layer-logging, `window_auxiliary_losses` likewise for the unweighted losses.
`moe.auxiliary_losses.MoEAuxiliaryLosses(model)()` turns them into the weighted terms added to
the LM loss.

Backends (`--moe-impl`): "grouped" multiplies with torch.bmm over capacity slots (MoE) or a
grouped GEMM over rows sorted by expert (dMoE); "sparse" uses the block-sparse kernels (dMoE
only); "reference" is the per-expert loop of moe.reference.

The dMoE has one data path, eager or compiled, on one rank or many: sort the assignments by
expert and gather the token rows into that order (moe.kernels.token_rows), run the experts on
them with each row's output scaled by its router weight (the only place the weights apply;
moe.experts), sum each token's rows back. What varies is the product: the run's grouped GEMM
(`MoEConfig.grouped_gemm`, chosen once at setup) or the block-sparse kernels. The MoE with
capacity sorts the same way and moves rows into capacity slots and back with gathers that
torch.compile fuses (moe.kernels.capacity_rows), weighting them in the combine.

A layer is built whole, as one process runs it; megatron.parallelize.steps's steps then shard it.
Under expert parallelism (`place_experts`) a layer holds only its rank's block of experts: the
dMoE moves assignments to the rank of their expert and back by all-to-all (moe.exchange: exactly,
or in fixed-size blocks), the MoE with capacity moves its fixed-size capacity slots.
Under tensor parallelism (the styles of moe.mlp_spec) each TP rank holds a slice of every
expert's ffn channels and the layer's tokens enter and leave the experts through
moe.tensor_parallel's region instead of moe.router.LocalRegion; the two combine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

from megatron.config import ModelConfig
from megatron.model.mlp import MLP
from megatron.parallel import parallel_state
from moe.config import MoEConfig
from moe.exchange.capacity_slots import run_capacity_slots
from moe.exchange.exact import ExactExchange, run_experts_exactly
from moe.exchange.fixed_blocks import FixedBlockExchange, block_capacity, run_experts_in_blocks
from moe.experts import Experts
from moe.kernels import capacity_rows, permute, token_rows
from moe.reference import reference_moe
from moe.router import LocalRegion, Router, Routing, update_expert_bias


def _compiling() -> bool:
    """True while torch.compile traces the layer (never on a torch without torch.compiler)."""
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and compiler.is_compiling()


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
        self.config = moe_config
        self.hidden_size = model_config.hidden_size
        # Set by `place_experts` (megatron.parallelize.steps).
        self.expert_parallel_rank, self.expert_parallel_size = 0, 1
        # Where tokens enter the experts and their output leaves: swapped by tensor parallelism.
        self.region: nn.Module = LocalRegion()
        std = model_config.init_method_std
        output_std = std / math.sqrt(2.0 * model_config.num_layers)
        self.router = Router(model_config.hidden_size, moe_config, init_std=std)
        self.experts = Experts(
            moe_config.num_experts,
            model_config.hidden_size,
            moe_config.expert_ffn_hidden_size(model_config),
            mlp_type=moe_config.mlp_type,
            activation="silu" if model_config.swiglu else "gelu",
            memory_optimized=moe_config.memory_optimized_mlp,
            init_std=std,
            output_init_std=output_std,
            grouped_gemm=moe_config.grouped_gemm,
        )
        # MegaBlocks' experts have no biases; the layer adds one output bias (--bias).
        if model_config.add_bias_linear:
            self.bias = nn.Parameter(torch.zeros(model_config.hidden_size))
        else:
            self.register_parameter("bias", None)
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
        # --moe-per-layer-logging (moe.expert_load.gather_layer_losses): each unweighted loss of
        # `logged_losses` summed over the training forwards since the trainer last took them,
        # then the number of those forwards.
        self.logged_losses = (
            tuple(self.router.loss_weights()) if moe_config.per_layer_logging else ()
        )
        self.register_buffer(
            "window_auxiliary_losses", torch.zeros(len(self.logged_losses) + 1), False
        )
        if moe_config.router_bias_update_rate > 0:
            # Counts since the last bias update; persistent so that a resumed run is exact.
            self.register_buffer("pending_tokens_per_expert", torch.zeros(moe_config.num_experts))
        self.auxiliary_losses: Optional[Dict[str, torch.Tensor]] = None
        # Under expert parallelism, for the trainer (moe.expert_load, moe.training_hooks):
        # [sum, count] of the training forwards' load imbalance since it last looked, and the
        # most rows the step's fullest fixed-size block needed, [over the block size, over
        # the balanced share]. Device buffers, updated in place, so that a compiled layer can
        # keep them.
        self.register_buffer(
            "window_expert_parallel_imbalance", torch.zeros(2, dtype=torch.float64), False
        )
        self.register_buffer("step_block_need", torch.zeros(2, dtype=torch.float64), False)
        # The fixed-size exchange's blocks (moe.exchange.fixed_blocks); grown by the training hooks
        # when a step's routing needed more, which then run the step again.
        self.expert_parallel_buffer_factor = moe_config.expert_parallel_buffer_factor

    @torch.no_grad()
    def init_own_weights(self, std: float, output_std: float) -> None:
        """The output bias and the counters start at zero (the router, the experts and the
        shared expert initialize themselves as submodules)."""
        if self.bias is not None:
            self.bias.zero_()
        for buffer in self.buffers(recurse=False):
            buffer.zero_()

    def place_experts(self, size: int, rank: int) -> None:
        """Run the experts of expert-parallel rank `rank` of `size` (the experts keep their
        block themselves); raises ConfigError for a size these experts cannot be split over."""
        self.config.check_expert_parallelism(size)
        self.expert_parallel_rank, self.expert_parallel_size = rank, size

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
        # No test of whether any token is pending: that would read the counts on the host (a
        # sync and a graph break in every layer's forward), and the update of zero counts moves
        # no expert's bias (the sign of 0 is 0).
        pending = self.pending_tokens_per_expert
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
        routing, expert_tokens = self.region.enter(self.router, tokens, hidden_states.shape)
        output, tokens_per_expert = self.experts(self.compute_experts, expert_tokens, routing)
        # Computed on recomputation too: a checkpointed re-run must save the same tensors.
        losses = self.router.auxiliary_losses(
            routing, tokens_per_expert, hidden_states.shape[0], self.training and not recomputing
        )
        if not recomputing:
            self.auxiliary_losses = losses
            with torch.no_grad():
                self.tokens_per_expert.copy_(tokens_per_expert)
                if self.training:
                    self.window_tokens_per_expert += tokens_per_expert
                    if self.logged_losses:
                        values = [losses[name].float() for name in self.logged_losses]
                        self.window_auxiliary_losses[:-1] += torch.stack(values)
                        self.window_auxiliary_losses[-1] += 1
                if bias_update:
                    self.pending_tokens_per_expert += tokens_per_expert.float()
        output = self.region.leave(output, hidden_states.shape)
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
            self.config.drop_by_weight,
        )

    def _sort(self, routing: Routing):
        """(order, slot_of, tokens_per_expert) of the stable sort of the assignments by
        expert (moe.kernels.token_rows.sort_assignments)."""
        with torch.no_grad():
            return token_rows.sort_assignments(routing.expert_indices, self.config.num_experts)


class MoE(MoELayer):
    """MegaBlocks' MoE: each expert takes at most `expert_capacity(T)` assignments, the first
    ones in token order (assignment t * k + j), or with `drop_by_weight` the highest-weight
    ones (Megatron-Core's `probs` policy); the rest contribute nothing.

    Under expert parallelism each rank fills the capacity slots of all E experts with its own
    tokens, as one process would for its micro-batch, and sends each expert's slot block to the
    expert's rank in one all-to-all of equal splits (the slots have a fixed size: no counts to
    exchange, no host sync; MegaBlocks' expert-parallel MoE moves them the same way); the
    experts run on the slots of every rank and the outputs come back the same way.
    """

    def expert_capacity(self, num_tokens: int) -> int:
        """int(capacity_factor * top_k * T / E), MegaBlocks' rule, or its ceil with
        `capacity_rounds_up` (Megatron-Core's); 0 means no limit."""
        config = self.config
        capacity = config.capacity_factor * config.top_k * num_tokens / config.num_experts
        return math.ceil(capacity) if config.capacity_rounds_up else int(capacity)

    def compute_experts(
        self, tokens: torch.Tensor, routing: Routing
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        capacity = self.expert_capacity(tokens.shape[0])
        if self.config.mlp_impl == "reference":
            return self._reference(tokens, routing, capacity or None)
        if self.config.drop_by_weight:
            order, slot_of, tokens_per_expert = capacity_rows.sort_assignments_by_weight(
                routing.expert_indices, routing.expert_weights, self.config.num_experts
            )
        else:
            order, slot_of, tokens_per_expert = self._sort(routing)
        if capacity == 0:
            capacity = self._unlimited_capacity(tokens_per_expert)
        slots = capacity_rows.capacity_slots(
            routing.expert_indices, order, slot_of, tokens_per_expert, capacity
        )
        expert_inputs = capacity_rows.gather_into_slots(tokens, slots)
        expert_inputs = expert_inputs.view(self.config.num_experts, capacity, -1)
        if self.expert_parallel_size > 1:
            expert_outputs = run_capacity_slots(
                expert_inputs,
                self.expert_parallel_size,
                parallel_state.get_expert_model_parallel_group(),
                self.experts.forward_batched,
            )
        else:
            expert_outputs = self.experts.forward_batched(expert_inputs)
        weights = routing.expert_weights.reshape(-1)
        output = capacity_rows.combine_from_slots(expert_outputs.flatten(0, 1), weights, slots)
        return output, tokens_per_expert

    def _unlimited_capacity(self, tokens_per_expert: torch.Tensor) -> int:
        """--moe-capacity-factor 0: room for the busiest expert's assignments; under expert
        parallelism the busiest over the group, so that every rank sends blocks of one size."""
        busiest = tokens_per_expert.max()
        if self.expert_parallel_size > 1:
            busiest = busiest.clone()
            dist.all_reduce(
                busiest,
                op=dist.ReduceOp.MAX,
                group=parallel_state.get_expert_model_parallel_group(),
            )
        return int(busiest)


class DroplessMoE(MoELayer):
    """MegaBlocks' dMoE: every assignment reaches its expert, whatever the imbalance."""

    @property
    def sparse_block_size(self) -> int:
        """The block size of the block-sparse products: MegaBlocks uses 128; smaller blocks
        let tiny models (and tensor-parallel shards) run the same kernels."""
        ffn = self.experts.local_ffn_hidden_size
        return next((b for b in (128, 64, 32, 16) if ffn % b == 0), 0)

    def compute_experts(
        self, tokens: torch.Tensor, routing: Routing
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.config.mlp_impl == "reference":
            return self._reference(tokens, routing, None)
        order, slot_of, tokens_per_expert = self._sort(routing)
        top_k = self.config.top_k
        rows = token_rows.gather_rows(tokens, order, slot_of, top_k)
        row_weights = routing.expert_weights.reshape(-1).index_select(0, order)
        if self.expert_parallel_size > 1:
            outputs = self._run_experts_expert_parallel(rows, row_weights, tokens_per_expert)
        else:
            outputs = self._run_experts(rows, row_weights, tokens_per_expert)
        return token_rows.sum_rows(outputs, order, slot_of, top_k), tokens_per_expert

    def _run_experts(
        self, rows: torch.Tensor, row_weights: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts on `rows` sorted by expert (tokens_per_expert[e] rows each), each
        output row scaled by its router weight."""
        if self.config.mlp_impl == "sparse":
            return self._sparse(rows, row_weights, tokens_per_expert)
        offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
        return self.experts.forward_grouped(rows, tokens_per_expert, offsets, row_weights)

    def _run_experts_expert_parallel(
        self, rows: torch.Tensor, row_weights: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """`_run_experts` with the experts sharded over the expert-parallel group: rows sorted
        by global expert (so by destination rank) and their router weights go to the ranks of
        their experts, run there, and come back: in fixed-size blocks with
        --moe-expert-parallel-buffer-factor (moe.exchange.fixed_blocks), else exactly, the
        all-to-alls overlapped with this rank's own rows (moe.exchange.exact)."""
        if self.expert_parallel_buffer_factor is not None:
            return self._run_experts_in_blocks(rows, row_weights, tokens_per_expert)
        return self._run_experts_exactly(rows, row_weights, tokens_per_expert)

    def _run_experts_in_blocks(
        self, rows: torch.Tensor, row_weights: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """Fixed shapes and no host sync: torch.compile traces this with the rest."""
        group = parallel_state.get_expert_model_parallel_group()
        size, chunks = self.expert_parallel_size, self.config.expert_parallel_chunks
        factor = self.expert_parallel_buffer_factor
        capacity = block_capacity(rows.shape[0], size, factor, chunks)
        exchange = FixedBlockExchange.plan(
            tokens_per_expert, rows.shape[0], capacity, group, chunks
        )
        if self.training and not _in_backward():
            with torch.no_grad():
                imbalance = exchange.imbalance
                self.window_expert_parallel_imbalance.add_(
                    torch.stack([imbalance, torch.ones_like(imbalance)])
                )
                needed = exchange.needed.double()
                need = torch.stack([needed / capacity, needed * size / rows.shape[0]])
                self.step_block_need.copy_(torch.maximum(self.step_block_need, need))
        # The grouped products leave the padding rows out; the block-sparse topology covers
        # every row, so there they are counted (as zeros) in the last expert.
        padded = self.config.mlp_impl == "sparse"
        with self.experts.weights_cast_once(rows.dtype):
            run = self._run_local_experts
            return run_experts_in_blocks(rows, row_weights, exchange, run, padded)

    # The all-to-all split sizes need a host sync, which no traced graph can hold: under
    # torch.compile this method runs eagerly, between graphs (docs/moe.md).
    @torch.compiler.disable
    def _run_experts_exactly(
        self, rows: torch.Tensor, row_weights: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """The exact exchange: split sizes on the host, one sync."""
        exchange = ExactExchange.plan(
            tokens_per_expert, parallel_state.get_expert_model_parallel_group()
        )
        if self.training and not _in_backward():
            with torch.no_grad():
                self.window_expert_parallel_imbalance[0] += exchange.imbalance
                self.window_expert_parallel_imbalance[1] += 1
        with self.experts.weights_cast_once(rows.dtype):
            return run_experts_exactly(rows, row_weights, exchange, self._run_local_experts)

    def _run_local_experts(
        self,
        rows: torch.Tensor,
        row_weights: torch.Tensor,
        order: Optional[torch.Tensor],
        tokens_per_local_expert: torch.Tensor,
    ) -> torch.Tensor:
        """The local experts on rows in local-expert order (`order` None) or put in that order
        by `order` (moe.exchange.primitives.RunExperts); outputs in the rows' order."""
        if order is None:
            return self._run_experts(rows, row_weights, tokens_per_local_expert)
        order = order.long()
        slot_of = token_rows.inverse_permutation(order)
        sorted_rows = token_rows.gather_rows(rows, order, slot_of, 1)
        outputs = self._run_experts(
            sorted_rows, row_weights.index_select(0, order), tokens_per_local_expert
        )
        return token_rows.sum_rows(outputs, order, slot_of, 1)

    def _sparse(
        self, rows: torch.Tensor, row_weights: torch.Tensor, tokens_per_expert: torch.Tensor
    ) -> torch.Tensor:
        """`_run_experts` on the block-sparse kernels: the sorted rows padded to whole blocks
        per expert, the experts as two block-sparse products, the padding dropped, the rows
        scaled by their weights."""
        from moe.kernels.block_sparse import Topology, sparse_mlp

        block = self.sparse_block_size
        experts = self.experts
        num_experts, hidden, ffn = experts.w1.shape
        w1, _, w2 = experts.projection_weights(rows.dtype)
        with torch.no_grad():
            bins = torch.cumsum(tokens_per_expert, 0).int()
            padded_bins = permute.padded_bins(tokens_per_expert, block)
            topology = Topology.from_padded_bins(padded_bins, ffn, block)
            identity = torch.arange(rows.shape[0], device=rows.device, dtype=torch.int32)
        padded_rows = permute.padded_gather(rows, identity, bins, padded_bins, 1)
        # [E, h, f] -> [h, E*f] and [E, f, h] -> [E*f, h]: the block-sparse operand layouts.
        compute_dtype = rows.dtype  # autocast's dtype: weights cast like autocast would
        w1 = w1.to(compute_dtype).permute(1, 0, 2).reshape(hidden, num_experts * ffn)
        w2 = w2.to(compute_dtype).reshape(num_experts * ffn, hidden)
        padded_outputs = sparse_mlp(padded_rows, w1, w2, topology)
        outputs = permute.padded_scatter(padded_outputs, identity, None, bins, padded_bins, 1)
        # In fp32: the router's weights are not rounded to the rows' dtype first.
        return (outputs.float() * row_weights.float().unsqueeze(-1)).to(outputs.dtype)


def build_moe_layer(model_config: ModelConfig, moe_config: MoEConfig) -> MoELayer:
    """The dMoE when `moe_config.dropless`, else the MoE with capacity (`moe_config` validated
    against `model_config`: MoEConfig.validate)."""
    layer_class = DroplessMoE if moe_config.dropless else MoE
    return layer_class(model_config, moe_config)


def moe_layers(model: nn.Module) -> List[Tuple[str, MoELayer]]:
    """(name, layer) of every MoE layer in `model`, in module order."""
    return [
        (name, module) for name, module in model.named_modules() if isinstance(module, MoELayer)
    ]
