"""Pipeline schedules for one training step: 1F1B and interleaved 1F1B (Megatron's orderings).

Both run `num_micro_batches` micro-batches through this rank's model chunks and leave the
step's gradients in the parameters. The stage function is the one the trainer uses without a
pipeline, ``forward_step(model, batch) -> (output, reported)``: on the last stage ``output`` is
the micro-batch's loss and ``reported`` its log values, elsewhere ``output`` is the hidden
states to send on. Every stage reads the same micro-batches (the first needs the tokens, the
last the labels and loss mask), so the schedules take the trainer's data iterator as it is.

Loss terms computed before the last stage (MoE auxiliary losses: each stage holds some of the
MoE layers) come back from a stage before the last as its ``reported`` values, still in the
autograd graph: the schedule scales their sum like the last stage's loss and attaches it to
the stage's output (`attach_loss`), so the stage's backward also sends the loss's gradient
into its layers. Every stage's reported values are its share of the log values: the schedules
return their sums over micro-batches, which `training_step` adds up over the stages.

1F1B: stage r runs ``P - r - 1`` warm-up forwards, then alternates one forward and one
backward, then finishes the remaining backwards (cool-down); at most ``P - r`` micro-batches'
activations are alive at once.

Interleaved 1F1B: each rank holds V chunks; the virtual micro-batches ``0 .. V * M - 1`` go in
groups of P through chunk 0, 1, ..., V - 1 (backwards in the reverse chunk order), and the
activations of a rank's last chunk travel to rank 0's next chunk. As in Megatron, M must be a
multiple of P.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from megatron.parallel import parallel_state
from megatron.pipeline import p2p
from megatron.pipeline.p2p import ActivationSpec

StageForwardStep = Callable[
    [nn.Module, Dict[str, torch.Tensor]], Tuple[torch.Tensor, Dict[str, torch.Tensor]]
]
# A rank's reported values, each summed over the micro-batches of every chunk it ran.
Reported = Dict[str, torch.Tensor]


class _AttachedLoss(torch.autograd.Function):
    """The identity on a stage's output whose backward also gives `loss` the gradient 1: the
    loss then takes part in the step's backward as if it had been added to the last stage's
    loss (Megatron-Core's MoEAuxLossAutoScaler, with the scale applied before attaching)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = (loss.shape, loss.dtype, loss.device)
        return output

    @staticmethod
    def backward(ctx, output_grad: torch.Tensor):
        shape, dtype, device = ctx.loss_shape
        return output_grad, torch.ones(shape, dtype=dtype, device=device)


def attach_loss(output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """`output` unchanged; a backward from it also runs backward from the scalar `loss`."""
    return _AttachedLoss.apply(output, loss)


class _MicroBatches:
    """The step's micro-batches by index, read from the iterator on first use: chunks of the
    interleaved schedule each run every micro-batch, in order."""

    def __init__(self, data_iterator: Iterator) -> None:
        self.data_iterator = data_iterator
        self.batches: List[Dict[str, torch.Tensor]] = []

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        while len(self.batches) <= index:
            self.batches.append(next(self.data_iterator))
        return self.batches[index]


class _StageRunner:
    """Forward and backward of one micro-batch on one model chunk."""

    def __init__(
        self,
        forward_step: StageForwardStep,
        num_micro_batches: int,
        scale_loss: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.forward_step = forward_step
        self.num_micro_batches = num_micro_batches
        self.scale_loss = scale_loss
        self.reported: Reported = {}

    def forward(
        self,
        model: nn.Module,
        batch: Dict[str, torch.Tensor],
        input_tensor: Optional[torch.Tensor],
    ) -> torch.Tensor:
        model.set_input_tensor(input_tensor)
        output, reported = self.forward_step(model, batch)
        if parallel_state.is_pipeline_last_stage():
            # The step's loss is the mean over micro-batches, as without a pipeline.
            output = self.scale_loss(output / self.num_micro_batches)
        elif reported and torch.is_grad_enabled():
            # This stage's loss terms, scaled like the last stage's loss (see module docstring).
            stage_loss = self.scale_loss(sum(reported.values()) / self.num_micro_batches)
            output = attach_loss(output, stage_loss)
        for name, value in reported.items():
            value = value.detach().float()
            self.reported[name] = self.reported[name] + value if name in self.reported else value
        return output

    @staticmethod
    def backward(
        input_tensor: Optional[torch.Tensor],
        output_tensor: torch.Tensor,
        output_grad: Optional[torch.Tensor],
    ) -> Optional[torch.Tensor]:
        """Backward from this chunk's output; the gradient of its input, to send back."""
        if output_grad is not None:
            output_grad = output_grad.to(output_tensor.dtype)
        torch.autograd.backward(output_tensor, grad_tensors=output_grad)
        return input_tensor.grad if input_tensor is not None else None


def forward_backward_pipelining_without_interleaving(
    forward_step: StageForwardStep,
    data_iterator: Iterator,
    model: nn.Module,
    num_micro_batches: int,
    spec: ActivationSpec,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
) -> Reported:
    """The 1F1B schedule; returns this stage's reported values summed over micro-batches
    (empty on a stage that reports nothing)."""
    runner = _StageRunner(forward_step, num_micro_batches, scale_loss)
    batches = _MicroBatches(data_iterator)
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    num_warmup = min(stages - rank - 1, num_micro_batches)
    num_steady = num_micro_batches - num_warmup
    input_tensors: List[Optional[torch.Tensor]] = []
    output_tensors: List[torch.Tensor] = []

    for index in range(num_warmup):
        input_tensor = p2p.recv_forward(spec)
        output_tensor = runner.forward(model, batches[index], input_tensor)
        p2p.send_forward(output_tensor, spec)
        input_tensors.append(input_tensor)
        output_tensors.append(output_tensor)

    input_tensor = p2p.recv_forward(spec) if num_steady > 0 else None
    for index in range(num_steady):
        output_tensor = runner.forward(model, batches[num_warmup + index], input_tensor)
        output_grad = p2p.send_forward_recv_backward(output_tensor, spec)
        input_tensors.append(input_tensor)
        output_tensors.append(output_tensor)
        input_grad = runner.backward(input_tensors.pop(0), output_tensors.pop(0), output_grad)
        if index == num_steady - 1:
            input_tensor = None
            p2p.send_backward(input_grad, spec)
        else:
            input_tensor = p2p.send_backward_recv_forward(input_grad, spec)

    for _ in range(num_warmup):
        output_grad = p2p.recv_backward(spec)
        input_grad = runner.backward(input_tensors.pop(0), output_tensors.pop(0), output_grad)
        p2p.send_backward(input_grad, spec)
    return runner.reported


def forward_backward_pipelining_with_interleaving(
    forward_step: StageForwardStep,
    data_iterator: Iterator,
    model: Sequence[nn.Module],
    num_micro_batches: int,
    spec: ActivationSpec,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss,
) -> Reported:
    """The interleaved 1F1B schedule over this rank's model chunks (`model`, in virtual-stage
    order); returns what `forward_backward_pipelining_without_interleaving` does."""
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if num_micro_batches % stages != 0:
        raise ValueError(
            f"the interleaved pipeline schedule needs the number of micro-batches "
            f"({num_micro_batches}) to be divisible by --pipeline-model-parallel-size {stages}"
        )
    return _Interleaved(forward_step, data_iterator, model, num_micro_batches, spec, scale_loss)()


class _Interleaved:
    """State of one interleaved step; Megatron's algorithm without communication overlap."""

    def __init__(self, forward_step, data_iterator, model, num_micro_batches, spec, scale_loss):
        self.runner = _StageRunner(forward_step, num_micro_batches, scale_loss)
        self.batches = _MicroBatches(data_iterator)
        self.model = list(model)
        self.spec = spec
        self.num_chunks = len(self.model)
        self.stages = parallel_state.get_pipeline_model_parallel_world_size()
        self.rank = parallel_state.get_pipeline_model_parallel_rank()
        self.total = num_micro_batches * self.num_chunks
        self.input_tensors: List[List[Optional[torch.Tensor]]] = [[] for _ in self.model]
        self.output_tensors: List[List[torch.Tensor]] = [[] for _ in self.model]
        self.output_grads: List[List[Optional[torch.Tensor]]] = [[] for _ in self.model]
        # With M == P every forward comes before the first backward.
        self.all_warmup = num_micro_batches == self.stages
        if self.all_warmup:
            self.num_warmup = self.total
        else:
            warmup = (self.stages - self.rank - 1) * 2 + (self.num_chunks - 1) * self.stages
            self.num_warmup = min(warmup, self.total)

    def chunk_id(self, virtual_index: int, forward: bool) -> int:
        """The chunk that runs virtual micro-batch `virtual_index` (reversed for backward)."""
        chunk = (virtual_index % (self.stages * self.num_chunks)) // self.stages
        return chunk if forward else self.num_chunks - chunk - 1

    def micro_batch(self, virtual_index: int) -> int:
        group, within = divmod(virtual_index, self.stages * self.num_chunks)
        return group * self.stages + within % self.stages

    def select(self, chunk: int) -> None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk)

    def forward(self, virtual_index: int) -> torch.Tensor:
        chunk = self.chunk_id(virtual_index, forward=True)
        self.select(chunk)
        if parallel_state.is_pipeline_first_stage():
            if len(self.input_tensors[chunk]) == len(self.output_tensors[chunk]):
                self.input_tensors[chunk].append(None)
        batch = self.batches[self.micro_batch(virtual_index)]
        output = self.runner.forward(self.model[chunk], batch, self.input_tensors[chunk][-1])
        self.output_tensors[chunk].append(output)
        return output

    def backward(self, virtual_index: int) -> Optional[torch.Tensor]:
        chunk = self.chunk_id(virtual_index, forward=False)
        self.select(chunk)
        if parallel_state.is_pipeline_last_stage() and not self.output_grads[chunk]:
            self.output_grads[chunk].append(None)
        return self.runner.backward(
            self.input_tensors[chunk].pop(0),
            self.output_tensors[chunk].pop(0),
            self.output_grads[chunk].pop(0),
        )

    def __call__(self) -> Reported:
        try:
            self._run()
        finally:
            self.select(0)
        return self.runner.reported

    def _run(self) -> None:
        spec, last_chunk = self.spec, self.num_chunks - 1
        first_rank = self.rank == 0
        last_rank = self.rank == self.stages - 1
        self.select(0)
        self.input_tensors[0].append(p2p.recv_forward(spec))
        for index in range(self.num_warmup):
            output = self.forward(index)
            next_chunk = self.chunk_id(index + 1, forward=True)
            recv_prev = not (first_rank and next_chunk == 0) and index != self.total - 1
            if parallel_state.is_pipeline_last_stage():
                output = None  # the loss goes nowhere
            if index == self.num_warmup - 1 and not self.all_warmup:
                # The last warm-up forward also receives the first backward's gradient.
                input_tensor, output_grad = p2p.communicate(
                    output, None, recv_prev, not last_rank, spec
                )
                self.output_grads[last_chunk].append(output_grad)
            else:
                input_tensor, _ = p2p.communicate(output, None, recv_prev, False, spec)
            if recv_prev:
                self.input_tensors[next_chunk].append(input_tensor)

        num_steady = self.total - self.num_warmup
        for index in range(num_steady):
            forward_index = index + self.num_warmup
            output = self.forward(forward_index)
            input_grad = self.backward(index)
            self.select(self.chunk_id(forward_index, forward=True))
            if parallel_state.is_pipeline_last_stage():
                output = None
            self.select(self.chunk_id(index, forward=False))
            if parallel_state.is_pipeline_first_stage():
                input_grad = None  # nothing before the model's input

            recv_prev = True
            if first_rank:
                # Rank 0 receives for chunk c + 1 what rank P - 1's chunk c sent P - 1 steps ago.
                next_forward_chunk = self.chunk_id(forward_index - (self.stages - 1), True)
                recv_prev = next_forward_chunk != last_chunk
                next_forward_chunk += 1
            else:
                next_forward_chunk = self.chunk_id(forward_index + 1, forward=True)
            recv_next = True
            if last_rank:
                next_backward_chunk = self.chunk_id(index - (self.stages - 1), False)
                recv_next = next_backward_chunk != 0
                next_backward_chunk -= 1
            else:
                next_backward_chunk = self.chunk_id(index + 1, forward=False)
            if index == num_steady - 1:
                recv_prev = False
            input_tensor, output_grad = p2p.communicate(
                output, input_grad, recv_prev, recv_next, spec
            )
            if recv_prev:
                self.input_tensors[next_forward_chunk].append(input_tensor)
            if recv_next:
                self.output_grads[next_backward_chunk].append(output_grad)

        if self.all_warmup:
            self.select(last_chunk)
            self.output_grads[last_chunk].append(p2p.recv_backward(spec))
        for index in range(num_steady, self.total):
            input_grad = self.backward(index)
            if parallel_state.is_pipeline_first_stage():
                input_grad = None
            next_chunk = self.chunk_id(index + 1, forward=False)
            recv_next = not (last_rank and next_chunk == last_chunk) and index != self.total - 1
            _, output_grad = p2p.communicate(None, input_grad, False, recv_next, spec)
            if recv_next:
                self.output_grads[next_chunk].append(output_grad)


def forward_only_pipelining(
    forward_step: StageForwardStep,
    data_iterator: Iterator,
    model: Sequence[nn.Module],
    num_micro_batches: int,
    spec: ActivationSpec,
) -> Reported:
    """Forwards only (evaluation), every micro-batch through every chunk in model order: each
    exchange waits for the one before it, so the chain cannot deadlock. Call under no_grad."""
    runner = _StageRunner(forward_step, num_micro_batches, lambda loss: loss)
    interleaved = parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None
    try:
        for _ in range(num_micro_batches):
            batch = next(data_iterator)
            for chunk_id, chunk in enumerate(model):
                if interleaved:
                    parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id)
                first = parallel_state.is_pipeline_first_stage()
                input_tensor = None if first else p2p.communicate(None, None, True, False, spec)[0]
                output = runner.forward(chunk, batch, input_tensor)
                if not parallel_state.is_pipeline_last_stage():
                    p2p.communicate(output, None, False, False, spec)
    finally:
        if interleaved:
            parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return runner.reported
