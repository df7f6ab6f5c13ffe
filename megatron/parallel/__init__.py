"""Parallelism: `parallel_state` (the process groups), `parallelize` (the named steps that turn
the plain model into this rank's part), `gradient_sync` (who reduces the gradients, decided
once), `expert_parameters` and `parameter_swaps` (marks and swaps the steps and optimizers
read), `collectives` (the one-tensor collectives under the running torch's names). Tensor
parallelism's layers are in megatron.tensor_parallel, the pipeline in megatron.pipeline."""
