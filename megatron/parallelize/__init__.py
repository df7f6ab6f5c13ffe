"""Parallelism applied to a model, a layer above the process groups (megatron.parallel) and the
parallel layers (megatron.tensor_parallel) it uses: `steps` (`parallelize`, the named steps that
turn the plain model into this rank's part), `tensor_parallelism` (each module's tensor-parallel
style), `fp8_projections` (the projections' FP8 products), `data_parallel` (the run's data-
parallel mode, the one owner of how replicas keep and reduce parameters and gradients) and
`gradient_sync` (the reductions left after the last backward)."""
