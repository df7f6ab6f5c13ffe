"""Loss and perplexity of a checkpoint on an indexed dataset, without training.

    python tools/evaluate.py --load checkpoints --data-path my-gpt2_text_document \\
        [--split 969,30,1 --split-name valid | --whole-dataset] [--eval-iters N] [--bf16]

Reads the checkpoint of any parallel layout and format as one process's model
(gpt_pretraining/checkpoint_model.py) and runs it over the samples training cuts from the
dataset: megatron.data.gpt_dataset's GPTDataset, samples of seq_length + 1 tokens in the order
training serves them for the same --split, --seq-length and --seed (each defaults to the
checkpoint's), made into inputs, labels and loss mask by the training run's `get_batch`. Every
sample of the split is evaluated once (one epoch, nothing repeated), or with --eval-iters N the
first N micro-batches of --micro-batch-size samples. It prints Megatron's validation line:

    validation loss on PREFIX (valid split of 969,30,1) | lm loss value: X | lm loss PPL: Y | tokens: N |

The loss is the token-weighted mean of the per-token losses over every token the loss mask
keeps (all of them, or all but those after an end-of-document token with --eod-mask-loss),
summed in fp64. Training's validation averages micro-batch means instead; the two agree
whenever every micro-batch keeps the same number of tokens (always without --eod-mask-loss).
PPL is Megatron's exp(min(20, loss)). The weights stay fp32; --bf16 runs the forward under
bf16 autocast, as training does. The library is gpt_pretraining.evaluation.
"""

import sys

from gpt_pretraining.evaluation import main

if __name__ == "__main__":
    sys.exit(main())
