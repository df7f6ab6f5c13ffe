"""Pretrain a GPT model with Megatron-LM's flags.

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 12 --hidden-size 768 ... \\
        --data-path my-gpt2_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

The run is composed in the installed package: gpt_pretraining.GPT_RUN builds the config, the
model, the training hooks and the forward step (megatron with the MoE layers), and
gpt_pretraining.pretrain.main sets up and trains with megatron.training.loop.pretrain.
"""

from gpt_pretraining.pretrain import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
