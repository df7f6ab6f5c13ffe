"""The MoE layers as an extension of a GPT run (megatron.composition.extension): the --moe-*
flags (MegaBlocks' and Megatron-Core's names, resolved in moe.megatron_core_flags), MoEConfig, MoE layers in place of the dense MLP, the training hooks (expert weight
copies, expert-parallel blocks, expert-load logging), the load-balancing and router z losses,
and the saved arguments that define the experts."""

from __future__ import annotations

from megatron.composition.extension import RunExtension
from moe.arguments import MOE_KERNEL_ARGUMENTS, MOE_MODEL_ARGUMENTS, add_moe_args
from moe.auxiliary_losses import MoEAuxiliaryLosses
from moe.config import MoEConfig, moe_config
from moe.megatron_core_flags import resolve_moe_arguments
from moe.mlp_spec import MoEMlpSpec
from moe.training_hooks import MoETrainingHooks

MOE_EXTENSION = RunExtension(
    name="moe",
    add_arguments=add_moe_args,
    build_config=moe_config,
    config_type=MoEConfig,
    model_arguments=MOE_MODEL_ARGUMENTS,
    mlp_spec=lambda moe, config: MoEMlpSpec(moe, config.parallel.expert_model_parallel_size),
    training_hooks=lambda moe, config: MoETrainingHooks(
        moe,
        config.numerics.weight_copies_dtype,
        config.model.num_layers,
        writes_metrics=config.logging.writes_metrics,
    ),
    # Averaged over the whole model's MoE layers, whichever of them this rank holds.
    auxiliary_losses=lambda moe, config, model: MoEAuxiliaryLosses(
        model, moe.num_moe_layers(config.model.num_layers)
    ),
    notes=MoEConfig.notes,
    kernel_arguments=MOE_KERNEL_ARGUMENTS,
    # Megatron-Core's MoE flags converted, and the settings left unset given their defaults.
    resolve_arguments=resolve_moe_arguments,
)
