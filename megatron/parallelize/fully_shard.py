"""`--use-torch-fsdp2`: the data-parallel mode that shards everything, on torch's fully_shard
(FSDP2, torch.distributed.fsdp), as Megatron-Core's `--use-torch-fsdp2` and torchtitan do.

Units. One per transformer layer, one per module of expert-parallel weights (the MoE layer's
experts under --expert-model-parallel-size > 1) and one for the rest (embeddings, final norm,
output layer). A unit's weights are DTensor shards of its data-parallel mesh between its
forwards and backwards; its forward all-gathers them (a layer's in the compute dtype under
--bf16/--fp16, MixedPrecisionPolicy; the rest in fp32, so that the residual stream stays fp32),
its backward gathers them again and reduce-scatters the gradients into fp32 shards, in fp32
(--grad-reduce-in-bf16: in bf16), micro-batch by micro-batch. The optimizer steps the fp32
shards. Each layer's forward prefetches the next layer's gather and each layer's
backward the previous one's.

Meshes, in Megatron-Core's rank order (megatron.parallel.parallel_state):
- the dense weights shard over the data-parallel ranks, or with
  --data-parallel-replicate-degree R (hybrid sharding, HSDP) within each of R groups of
  consecutive data-parallel ranks, replicated across the groups, whose gradients FSDP2
  all-reduces;
- the expert-parallel weights over the expert-data-parallel ranks (the ranks that hold the same
  experts: torchtitan's expert mesh, SageMaker's expert-parallel + sharded data parallelism),
  their gradients averaged over the whole data-parallel size (megatron.parallel.expert_parameters
  says why).
- Tensor parallelism stays this project's own (megatron.tensor_parallel): each
  tensor-parallel rank's weights shard over its own data-parallel mesh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from megatron.config.data_parallel_kind import DataParallelKind
from megatron.errors import UserError
from megatron.initialize import DistributedContext
from megatron.main_grads import gradient
from megatron.model.transformer import TransformerLayer
from megatron.optimizer import MegatronOptimizer, build_optimizer
from megatron.parallel import parallel_state
from megatron.parallel.dtensors import local_part
from megatron.parallel.expert_parameters import expert_parameters, is_expert_parameter
from megatron.parallelize.data_parallel import DataParallel
from megatron.parallelize.gradient_sync import FULLY_SHARD

if TYPE_CHECKING:
    from megatron.config import Config


class FullyShard(DataParallel):
    """FSDP2 over the data-parallel meshes (module docstring)."""

    kind = DataParallelKind.FULLY_SHARD
    # Each expert shard's FSDP2 unit reduce-scatters its gradients in the backward.
    reduces_expert_gradients_after_backward = False

    @classmethod
    def gradient_reduction(cls, config: Config) -> str:
        return FULLY_SHARD

    @property
    def shards_parameters(self) -> bool:
        return True

    @property
    def compiles_by_layer(self) -> bool:
        # Each layer's forward compiled on its own: fully_shard's hooks around it (the gathers,
        # and the reduce-scatters they set up) run eagerly.
        return True

    @property
    def gradient_reduce_dtype(self) -> torch.dtype:
        """The dtype each unit's gradients are reduce-scattered in (--grad-reduce-in-bf16)."""
        return torch.bfloat16 if self.config.parallel.grad_reduce_in_bf16 else torch.float32

    def optimizer_shards(self) -> Tuple[int, int]:
        parallel = self.config.parallel
        dense = parallel.data_parallel_size // parallel.data_parallel_replicate_degree
        ep = parallel.expert_model_parallel_size
        if ep == 1:
            return dense, dense  # the experts are in their layer's unit, on the dense mesh
        return dense, parallel.data_parallel_size // ep

    def apply(self, model: nn.Module, context: DistributedContext) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            raise UserError(
                "--use-torch-fsdp2 needs a process group: launch with torchrun (one process "
                "is enough: torchrun --nproc_per_node 1 pretrain_gpt.py ...)"
            )
        numerics = self.config.numerics
        # The layers' weights are gathered in the compute dtype (those autocast casts are most
        # of them: the same values reach the products). Their inputs stay as they are, and the
        # rest (embeddings, final norm, output layer) is gathered in fp32: the residual stream
        # stays fp32, as in the other modes.
        policy = MixedPrecisionPolicy(
            param_dtype=numerics.compute_dtype if numerics.autocast else None,
            reduce_dtype=self.gradient_reduce_dtype,
            cast_forward_inputs=False,
        )
        root_policy = MixedPrecisionPolicy(reduce_dtype=self.gradient_reduce_dtype)
        device = context.device.type
        dense_mesh = self._dense_mesh(device)
        # fully_shard makes new parameters: the marks the layers set on theirs (tensor- and
        # expert-parallel, read by checkpoints and gradient reductions) are carried over.
        marks = {name: dict(vars(param)) for name, param in model.named_parameters()}
        layers: List[nn.Module] = []
        experts: List[nn.Module] = []
        for module in model.modules():
            own = list(module.parameters(recurse=False))
            if own and all(is_expert_parameter(param) for param in own):
                experts.append(module)
            elif isinstance(module, TransformerLayer):
                layers.append(module)
        if experts:
            expert_mesh = self._expert_mesh(device)
            for module in experts:
                fully_shard(module, mesh=expert_mesh, mp_policy=policy)
        for layer in layers:
            fully_shard(layer, mesh=dense_mesh, mp_policy=policy)
        fully_shard(model, mesh=dense_mesh, mp_policy=root_policy)
        for earlier, later in zip(layers, layers[1:]):
            earlier.set_modules_to_forward_prefetch([later])
            later.set_modules_to_backward_prefetch([earlier])
        for name, param in model.named_parameters():
            for key, value in marks[name].items():
                setattr(param, key, value)
        return model

    def _dense_mesh(self, device: str):
        """The data-parallel ranks as a mesh: 1-D, or (replicate, shard) for hybrid sharding."""
        parallel = self.config.parallel
        replicas = parallel.data_parallel_replicate_degree
        dims = (("replicate", replicas), ("shard", parallel.data_parallel_size // replicas))
        picked = ("replicate", "shard") if replicas > 1 else "shard"
        group = parallel_state.get_data_parallel_group()
        return self._mesh(device, dims, picked, group, "data-parallel")

    def _expert_mesh(self, device: str):
        """The expert-data-parallel ranks (those that hold this rank's experts) as a mesh."""
        parallel = self.config.parallel
        ep = parallel.expert_model_parallel_size
        dims = (("shard", parallel.data_parallel_size // ep), ("ep", ep))
        group = parallel_state.get_expert_data_parallel_group()
        return self._mesh(device, dims, "shard", group, "expert-data-parallel")

    def _mesh(
        self,
        device: str,
        dims: Tuple[Tuple[str, int], ...],
        picked: Union[str, Tuple[str, ...]],
        group: dist.ProcessGroup,
        name: str,
    ):
        """Every rank as a DeviceMesh (pipeline, *`dims`, tensor), slowest-varying coordinate
        first (parallel_state's rank order, reversed), sliced to the `picked` dims; checked to
        hold the ranks of the project's own `group`: one layout, two descriptions."""
        from torch.distributed.device_mesh import init_device_mesh

        parallel = self.config.parallel
        names = ("pp", *(dim for dim, _ in dims), "tp")
        shape = (
            parallel.pipeline_model_parallel_size,
            *(size for _, size in dims),
            parallel.tensor_model_parallel_size,
        )
        mesh = init_device_mesh(device, shape, mesh_dim_names=names)[picked]
        ranks = sorted(mesh.mesh.flatten().tolist())
        expected = sorted(dist.get_process_group_ranks(group))
        if ranks != expected:
            raise RuntimeError(f"the FSDP2 {name} mesh holds ranks {ranks}, the group {expected}")
        return mesh

    def after_backwards(self, model: nn.Module) -> None:
        super().after_backwards(model)
        ep = self.config.parallel.expert_model_parallel_size
        if ep > 1:
            # FSDP2 averaged the expert gradients over their mesh, the D / ep expert-data-
            # parallel ranks; the data-parallel average divides by D. (Its own divide factor
            # needs a premultiplied sum, which gloo lacks; this pass touches 1/D of them.)
            grads = [gradient(param) for param in expert_parameters(model)]
            torch._foreach_mul_([local_part(grad) for grad in grads if grad is not None], 1 / ep)

    def build_optimizer(self, model: nn.Module) -> MegatronOptimizer:
        self.optimizer = build_optimizer(model, self.config.optimizer, self.config.training)
        return self.optimizer
