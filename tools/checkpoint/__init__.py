"""Checkpoint tools: reading a checkpoint of any layout as one process's model, and converting
it to and from Hugging Face model directories (tools/checkpoint/convert.py)."""
