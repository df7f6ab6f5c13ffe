"""How a GPT run is composed from megatron and the packages that extend it: the extension
protocol (extension.RunExtension), the composition (run.RunComposition), the forward step and
the datasets of a run."""
