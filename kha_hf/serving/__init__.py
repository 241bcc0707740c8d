"""Serving KHA checkpoints through transformers' own OpenAI-compatible server (`transformers serve`)."""
