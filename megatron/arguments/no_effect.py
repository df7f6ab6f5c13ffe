"""The help text of flags Megatron-LM accepts that select a fused CUDA kernel or an overlap we do
not implement separately: they parse so existing launch scripts run, and change nothing."""

NO_EFFECT = "Accepted for Megatron-LM compatibility; has no effect in this framework."
