"""Where a GPT-2 125M training step spends its time on one GPU: dropout variants and top kernels.

    python -m bench.model_variants [--micro-batch-size 32]

Times megatron.model.GPTModel under torch.compile with Megatron's default dropout (0.1) and with
each dropout switched off, then prints the CUDA kernels that take most of the default step.
"""

from __future__ import annotations

import argparse

import torch

from bench.gpt_step import VOCAB, time_steps
from megatron.config import ModelConfig
from megatron.model import GPTModel


def build(seq: int, hidden_dropout: float, attention_dropout: float) -> GPTModel:
    config = ModelConfig(
        num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
        seq_length=seq, max_position_embeddings=seq, padded_vocab_size=VOCAB,
        hidden_dropout=hidden_dropout, attention_dropout=attention_dropout, init_method_std=0.01,
    )  # fmt: skip
    return GPTModel(config).cuda().train()


def loss_of(model, inputs, labels):
    return model(inputs, labels=labels).float().mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--skip-dropout-variants", action="store_true")
    parser.add_argument(
        "--compile-variants",
        action="store_true",
        help="only time Megatron's default dropout under other torch.compile settings",
    )
    args = parser.parse_args()
    batch, seq = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, 50257, (batch, seq + 1), device="cuda")
    data = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    if args.compile_variants:
        import torch._inductor.config as inductor_config

        print("\n| torch.compile setting (dropout 0.1) | ms per micro-batch step | tokens/s |")
        print("|---|---:|---:|")
        for name, mode, coordinate_descent in (
            ("default", None, False),
            ("coordinate_descent_tuning", None, True),
            ("max-autotune-no-cudagraphs", "max-autotune-no-cudagraphs", False),
        ):
            inductor_config.coordinate_descent_tuning = coordinate_descent
            torch._dynamo.reset()
            model = torch.compile(build(seq, 0.1, 0.1), mode=mode)
            seconds = time_steps(model, loss_of, data, args.steps)
            print(f"| {name} | {seconds * 1000:.1f} | {batch * seq / seconds:,.0f} |", flush=True)
            del model
            torch.cuda.empty_cache()
        return
    rows = []
    variants = (
        ((0.1, 0.1),)
        if args.skip_dropout_variants
        else ((0.1, 0.1), (0.0, 0.1), (0.1, 0.0), (0.0, 0.0))
    )
    for hidden_dropout, attention_dropout in variants:
        model = torch.compile(build(seq, hidden_dropout, attention_dropout))
        seconds = time_steps(model, loss_of, data, args.steps)
        rows.append((hidden_dropout, attention_dropout, seconds * 1000, batch * seq / seconds))
        del model
        torch.cuda.empty_cache()
    print(
        f"\n{torch.cuda.get_device_name()}, micro batch {batch}, sequence {seq}, bf16 autocast, compiled"
    )
    print("| hidden dropout | attention dropout | ms per micro-batch step | tokens/s |")
    print("|---:|---:|---:|---:|")
    for hidden_dropout, attention_dropout, milliseconds, tokens_per_second in rows:
        print(
            f"| {hidden_dropout} | {attention_dropout} | {milliseconds:.1f} | {tokens_per_second:,.0f} |"
        )

    from torch.nn.attention import SDPBackend, sdpa_kernel

    print("\n| SDPA backend (dropout 0.1) | ms per micro-batch step | tokens/s |")
    print("|---|---:|---:|")
    for backend in (
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
    ):
        with sdpa_kernel([backend]):
            try:
                model = torch.compile(build(seq, 0.1, 0.1))
                seconds = time_steps(model, loss_of, data, args.steps)
                print(f"| {backend.name} | {seconds * 1000:.1f} | {batch * seq / seconds:,.0f} |")
            except RuntimeError as error:
                print(f"| {backend.name} | failed: {str(error)[:80]} | |")
            del model
            torch.cuda.empty_cache()
    if args.skip_profile:
        return
    model = torch.compile(build(seq, 0.1, 0.1))
    time_steps(model, loss_of, data, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_of(model, *data)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    print(
        profile.key_averages().table(
            sort_by="cuda_time_total", row_limit=18, max_name_column_width=70
        )
    )


if __name__ == "__main__":
    main()
