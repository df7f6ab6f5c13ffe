"""Hugging Face remote code for this project's GPT-2 dMoE: the configuration and modeling files an
exported directory carries (loaded with `trust_remote_code=True`), and `writer`, which puts them
there."""
