"""Optimizer setup, fp16 loss scaling and the learning-rate schedule.

optimizer = build_optimizer(model, config.optimizer, config.training)
scheduler = build_lr_scheduler(optimizer, config.optimizer, config.training)
...
optimizer.scale_loss(loss).backward()
update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
if update_successful:
    scheduler.step(increment=config.training.global_batch_size)
"""

from megatron.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
from megatron.optimizer.lr_schedule import OptimizerParamScheduler, build_lr_scheduler
from megatron.optimizer.optimizer import MegatronOptimizer, build_optimizer

__all__ = [
    "ConstantGradScaler",
    "DynamicGradScaler",
    "MegatronOptimizer",
    "OptimizerParamScheduler",
    "build_lr_scheduler",
    "build_optimizer",
]
