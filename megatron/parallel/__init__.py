"""Parallelism's lowest layer, which every other room builds on: `parallel_state` (the process
groups), `collectives` (the one-tensor collectives under the running torch's names),
`expert_parameters` and `parameter_swaps` (the marks and swaps the layers, optimizers and
checkpoints read), `progress_board` (where each rank is, in the process groups' store, to name
the rank a timed-out collective waited for). It imports no other room; the steps that apply
parallelism to a model are in megatron.parallelize, tensor parallelism's layers in
megatron.tensor_parallel, the pipeline in megatron.pipeline."""
