"""Tiny KHA checkpoints for the server tests (a 2-layer model, the tiny tokenizer, a plain chat template)."""

from __future__ import annotations

from transformers import AutoTokenizer

from tests.helpers import save_tiny_checkpoint

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def tiny_kha(folder, max_positions: int, eos: bool = True, chat_template: str = CHAT_TEMPLATE):
    """A tiny KHA-MLP checkpoint in FOLDER with a MAX_POSITIONS context; without EOS, generation never stops
    early (it runs to max_new_tokens). Returns the model saved."""
    model = save_tiny_checkpoint(folder, knock="mlp_v", max_position_embeddings=max_positions)
    if not eos:
        model.generation_config.eos_token_id = None
        model.generation_config.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return model
