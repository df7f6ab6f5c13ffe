"""Tokens/s of one GPT-2 training step on one GPU: a plain PyTorch step vs this project's model.

The plain step is the issue's anchor: a GPT-2 125M written directly in PyTorch (bf16 autocast,
SDPA attention, fused AdamW, micro batch 16, sequence 1024), eager and under torch.compile.
The same harness then times `megatron.model.GPTModel` with the same settings, so the model's own
cost is separated from the training loop's (pretrain_gpt.py's log line gives the loop's).

    python -m bench.gpt_step [--micro-batch-size 16] [--steps 20]

With --loss-fusion it times only the compiled model, with its output layer and loss apart and
fused (--cross-entropy-fusion-impl linear, megatron.kernels.linear_cross_entropy), and prints
each one's peak GPU memory beside its tokens/s.

    python -m bench.gpt_step --loss-fusion [--micro-batch-size 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron.config import ModelConfig
from megatron.model import GPTModel
from megatron.model.flops import num_floating_point_operations

VOCAB = 50304
H100_BF16_DENSE_TFLOPS = 989.0


class PlainBlock(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x)), approximate="tanh"))


class PlainGPT(nn.Module):
    """GPT-2 in the fewest lines: learned positions, pre-LN blocks, tied output embedding."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(PlainBlock(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        for parameter in self.parameters():
            if parameter.dim() > 1:
                nn.init.normal_(parameter, std=0.02)

    def forward(self, tokens, labels):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.norm(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1))


def time_steps(model, loss_of, batch, steps: int, warmup: int = 5) -> float:
    """Median seconds per optimizer step (forward, backward, fused AdamW)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
    tokens, labels = batch
    timings = []
    for step in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(model, tokens, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        if step >= warmup:
            timings.append(start.elapsed_time(end) / 1000.0)
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"non-finite loss {loss.item()} at step {step}")
    timings.sort()
    return timings[len(timings) // 2]


def compare_loss_fusion(config: ModelConfig, batch, steps: int, flops: float) -> None:
    """The compiled model with the logits stored, then with the output layer and the loss fused:
    tokens/s and peak memory, one after the other on this GPU."""
    batch_size, seq = batch[0].shape
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, micro batch {batch_size}")
    print("| loss | tokens/s | model TFLOP/s | peak GiB |")
    print("|---|---:|---:|---:|")
    for name, fused in (("logits, then the fused cross-entropy", False), ("linear fused", True)):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        model = GPTModel(dataclasses.replace(config, linear_cross_entropy_fusion=fused)).cuda()
        seconds = time_steps(
            torch.compile(model.train()),
            lambda m, x, y: m(x, labels=y).float().mean(),
            batch,
            steps,
        )
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(
            f"| {name} | {batch_size * seq / seconds:,.0f} | {flops / seconds / 1e12:.1f} | {peak:.2f} |"
        )
        del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--loss-fusion", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpt_step.py needs a GPU")
    torch.manual_seed(0)
    batch_size, seq = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, 50257, (batch_size, seq + 1), device="cuda")
    batch = (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    config = ModelConfig(
        num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
        seq_length=seq, max_position_embeddings=seq, padded_vocab_size=VOCAB,
        hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.01,
    )  # fmt: skip
    flops = num_floating_point_operations(config, batch_size, seq)

    def plain_loss(model, inputs, labels):
        return model(inputs, labels)

    def ours_loss(model, inputs, labels):
        return model(inputs, labels=labels).float().mean()

    if args.loss_fusion:
        compare_loss_fusion(config, batch, args.steps, flops)
        return
    rows = []
    for name, build, loss_of in (
        ("plain PyTorch GPT-2 (no dropout)", lambda: PlainGPT(12, 768, 12, seq), plain_loss),
        ("megatron.model.GPTModel (dropout 0.1)", lambda: GPTModel(config), ours_loss),
    ):
        for compiled in (False, True):
            model = build().cuda().train()
            runner = torch.compile(model) if compiled else model
            seconds = time_steps(runner, loss_of, batch, args.steps)
            tflops = flops / seconds / 1e12
            rows.append(
                (name, "torch.compile" if compiled else "eager", batch_size * seq / seconds, tflops)
            )
            del model, runner
            torch.cuda.empty_cache()

    device = torch.cuda.get_device_name()
    print(
        f"\n{device}, torch {torch.__version__}, micro batch {batch_size}, sequence {seq}, bf16 autocast"
    )
    print("| model | mode | tokens/s | model TFLOP/s | MFU vs 989 TFLOP/s |")
    print("|---|---|---:|---:|---:|")
    for name, mode, tokens_per_second, tflops in rows:
        print(
            f"| {name} | {mode} | {tokens_per_second:,.0f} | {tflops:.1f} | "
            f"{100 * tflops / H100_BF16_DENSE_TFLOPS:.1f}% |"
        )


if __name__ == "__main__":
    main()
