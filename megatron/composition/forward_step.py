"""The GPT run's forward step: a batch of `seq_length + 1` tokens made into inputs, shifted
labels and the loss mask, and Megatron's masked mean of the per-token losses plus the loss terms
an extension adds (the MoE layers' load-balancing loss)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from megatron.composition.extension import AuxiliaryLosses


def get_batch(
    batch: Dict[str, torch.Tensor], eod_token: int, eod_mask_loss: bool
) -> Dict[str, torch.Tensor]:
    """Inputs, shifted labels and the loss mask from a batch of `seq_length + 1` tokens."""
    tokens_and_next = batch["text"].long()
    tokens = tokens_and_next[:, :-1].contiguous()
    labels = tokens_and_next[:, 1:].contiguous()
    loss_mask = torch.ones_like(labels, dtype=torch.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod_token] = 0.0
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def make_forward_step(
    eod_token: int,
    eod_mask_loss: bool,
    auxiliary_losses: Optional[AuxiliaryLosses] = None,
):
    """forward_step(model, batch) -> (loss, {"lm loss": loss, ...}) with Megatron's masked mean.

    `auxiliary_losses(model)` (MoE: `MoEAuxiliaryLosses`) returns the extra loss terms of the
    forward `model` just ran, e.g. {"load balancing loss": ...}; each is added to the loss and
    reported. On a pipeline stage before the last they are that stage's share, returned as its
    reported values, which the schedule adds to the loss (megatron.pipeline.schedules).
    """

    def forward_step(
        model: torch.nn.Module, batch: Dict[str, torch.Tensor]
    ) -> Tuple[torch.Tensor, Dict]:
        inputs = get_batch(batch, eod_token, eod_mask_loss)
        per_token_losses = model(inputs["tokens"], labels=inputs["labels"])
        auxiliary = auxiliary_losses(model) if auxiliary_losses else {}
        if not getattr(model, "post_process", True):
            # A pipeline stage before the last: its hidden states go to the next stage.
            return per_token_losses, auxiliary
        loss_mask = inputs["loss_mask"]
        lm_loss = torch.sum(per_token_losses.float() * loss_mask) / loss_mask.sum()
        reported = {"lm loss": lm_loss.detach()}
        loss = lm_loss
        for name, value in auxiliary.items():
            loss = loss + value
            reported[name] = value.detach()
        return loss, reported

    return forward_step
