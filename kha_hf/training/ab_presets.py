"""The model and run settings of `kha ab`'s presets (light: the CLI reads their names for its help)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ABPreset:
    """A Qwen3-style (QK norm, GQA) model and its run: the paper's attention setting, scaled."""

    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    seq_len: int
    batch_size: int
    max_steps: int
    lr: float

    def config(self):
        from transformers import Qwen3Config  # here: `kha ab --help` must not import transformers

        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.hidden_size * 3,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            max_position_embeddings=max(4096, self.seq_len),
            tie_word_embeddings=True,
        )


AB_PRESETS = {
    # about 15 minutes for 3 seeds x 2 runs on 2 CPU cores
    "cpu-tiny": ABPreset(256, 4, 8, 2, 32, 4096, 256, 8, 300, 3e-3),
    # one GPU, minutes
    "gpu-small": ABPreset(768, 12, 12, 4, 64, 8192, 1024, 16, 2000, 1e-3),
    # the paper's attention shape (32 query / 4 KV heads, head_dim 128): hours on one GPU
    "paper": ABPreset(2048, 16, 32, 4, 128, 16384, 2048, 16, 5000, 6e-4),
}
