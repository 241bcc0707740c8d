"""The training presets: a model and its run settings, for `kha train PRESET` and `kha ab PRESET` (light: the CLI
reads their names for its help)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    """A Qwen3-style (QK norm, GQA) model and its run: the paper's attention setting, scaled. With `experts`, a
    Qwen3-MoE model (every layer sparse, `active` experts per token of width `expert_size`): the paper's main
    shape. Its router is balanced as the family balances it in transformers, by the auxiliary loss
    (`output_router_logits`, `router_aux_loss_coef`); the paper's loss-free balancing (expert biases) is not in
    transformers and is not used."""

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
    experts: int = 0
    active: int = 0
    expert_size: int = 0
    aux_loss: float = 0.001  # Qwen3-MoE's default router_aux_loss_coef
    eval_blocks: int | None = None  # kha ab's held-out (and validation) blocks; None: all of raw text's

    def config(self):
        from transformers import Qwen3Config, Qwen3MoeConfig  # here: `kha ab --help` must not import transformers

        shared = dict(
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
        if not self.experts:
            return Qwen3Config(**shared)
        return Qwen3MoeConfig(
            **shared,
            num_experts=self.experts,
            num_experts_per_tok=self.active,
            moe_intermediate_size=self.expert_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=True,  # the auxiliary load-balancing loss joins the training loss
            router_aux_loss_coef=self.aux_loss,
            norm_topk_prob=True,
        )


PRESETS = {
    # a smoke test of the whole loop and every column of kha ab's table, in minutes on 2 CPU cores (its numbers mean
    # nothing: 2 layers of width 64)
    "cpu-smoke": Preset(64, 2, 4, 2, 16, 1024, 64, 4, 60, 3e-3, eval_blocks=64),
    # about 15 minutes for 3 seeds x 2 runs on 2 CPU cores
    "cpu-tiny": Preset(256, 4, 8, 2, 32, 4096, 256, 8, 300, 3e-3),
    # the paper's MoE shape scaled to a CPU: QK norm, 8 query heads per KV head (paper 32/4), 32 experts with 2
    # active (the paper's 1/16), every layer sparse
    "cpu-tiny-moe": Preset(256, 4, 8, 1, 32, 4096, 256, 8, 300, 3e-3, experts=32, active=2, expert_size=64),
    # one GPU, minutes
    "gpu-small": Preset(768, 12, 12, 4, 64, 8192, 1024, 16, 2000, 1e-3),
    # the paper's attention shape (32 query / 4 KV heads, head_dim 128): hours on one GPU
    "paper": Preset(2048, 16, 32, 4, 128, 16384, 2048, 16, 5000, 6e-4),
    # the paper's MoE at its size: 128 experts, 8 active, Qwen3-style attention (QK norm, head_dim 128, 32/4 heads);
    # 6.3B parameters, 0.7B active per token (the paper's ablation model: A0.8B-6.6B)
    "paper-moe": Preset(1536, 20, 32, 4, 128, 16384, 2048, 16, 5000, 6e-4, experts=128, active=8, expert_size=512),
    # Table 5's dense comparison (the paper's dense models: 0.61B-3.94B, 100B tokens; KHA-Linear beat KHA-MLP
    # there): a 1.6B dense model with the paper's attention shape
    "paper-dense": Preset(2048, 28, 32, 4, 128, 16384, 2048, 16, 5000, 6e-4),
}
