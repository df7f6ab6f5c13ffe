"""Convert checkpoints of this project to and from Hugging Face model directories, with
Megatron-LM's converter flags.

    # export: any checkpoint (any parallel layout, either --ckpt-format) -> transformers
    python tools/checkpoint/convert.py --model-type GPT --loader megatron --saver hf \\
        --load-dir checkpoints/gpt2_125m --save-dir hf/gpt2_125m
    # import: a GPT-2, Llama, Mixtral (or exported dMoE) directory -> a release checkpoint
    python tools/checkpoint/convert.py --model-type GPT --loader hf --saver megatron \\
        --load-dir hf/Mixtral-8x7B --save-dir checkpoints/mixtral

Export picks GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM or, for a GPT-2-style dMoE,
this project's modeling file carried in the directory (trust_remote_code=True); see
gpt_pretraining/huggingface/hf_export.py. Import prints the pretrain_gpt.py flags that build the model;
train on with `--load DIR --finetune` and them. Needs `pip install -e .[hf]`.
The library is gpt_pretraining.huggingface.hf_convert.
"""

import sys

from gpt_pretraining.huggingface.hf_convert import main

if __name__ == "__main__":
    sys.exit(main())
