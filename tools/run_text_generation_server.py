"""Megatron's text-generation server for a checkpoint of pretrain_gpt.py, on the standard
library's HTTP server.

    python tools/run_text_generation_server.py --load runs/quickstart/checkpoints --port 5000
    curl -X PUT localhost:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["The city of"], "tokens_to_generate": 32, "top_k": 1}'

`PUT /api` takes Megatron's request: "prompts" (a list of strings), "tokens_to_generate"
(default 64), and optionally "temperature" (default 1.0), "top_k" (0: all tokens; 1: greedy),
"top_p" (0: off), "random_seed". It answers {"text": [prompt + completion, ...], "segments":
[[token strings of the prompt and completion], ...], "tokens": [[their ids], ...]}. A request
that is not valid JSON or whose fields are wrong is answered 400 with {"message": "..."} naming
the field. Requests are served on threads; generation runs one request at a time (a lock), on
the GPU when there is one.
The library is gpt_pretraining.text_generation_server.
"""

import sys

from gpt_pretraining.text_generation_server import main

if __name__ == "__main__":
    sys.exit(main())
