"""The run and its loop: `loop` (Megatron's `pretrain` and the training loop), `trainer` (one
optimizer step, evaluation, saving and loading), `hooks` (what extensions do around the steps),
`logging` (Megatron's log lines, TensorBoard), `wandb_logger` (Weights & Biases),
`metric_writers` (both behind one object), `profiling`. Hung ranks are named by
megatron.parallel.progress_board, beside the process groups."""
