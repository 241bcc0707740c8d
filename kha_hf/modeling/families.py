"""The base families KHA knows, and where in each one's projections the knocks act. A family is one table row.

A projection's output features are a run of blocks; a block is a number of heads, each head a run of segments; a
segment is `q`, `k` or `v` features (knocked) or features the knocks leave alone (None: MLA's shared RoPE part,
Qwen3-Next's output gate). The standard layout is one block of heads of one segment per projection:
`q_proj` = num_attention_heads x [q: head_dim], `k_proj` / `v_proj` = num_key_value_heads x [k / v: head_dim].

    Phi-3's fused qkv_proj: [q heads][k heads][v heads], three blocks.
    DeepSeek-V3 (MLA): q_b_proj (or q_proj) = heads x [q: qk_nope_head_dim][None: qk_rope_head_dim],
                       kv_b_proj = heads x [k: qk_nope_head_dim][v: v_head_dim].
    Qwen3-Next: q_proj = heads x [q: head_dim][None: head_dim (the output gate)].

Everything else about a family (norms, RoPE, soft-capping, sinks, windows, scaling) stays the family's own code:
`derive.py` derives each family's knocked attention from its own transformers source.

A model type not in the table is tried with the standard layout (`family_spec`): its attention class must call
`q_proj`, `k_proj` and `v_proj`, and their sizes must match the layout (checked when the model is built and when a
checkpoint is converted); otherwise it is refused by name.

This file is copied next to saved checkpoints (remote code): it may import only torch, transformers and siblings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TARGETS = ("q", "k", "v")
HEAD_DIM = "head_dim"  # the per-head size; configs that leave it unset get hidden_size // num_attention_heads
NOT_ATTENTION_LAYER_TYPES = {"linear_attention", "mamba", "conv"}  # hybrid models: layers without softmax attention


@dataclass(frozen=True)
class Segment:
    target: str | None  # "q", "k", "v", or None for features the knocks leave alone
    size: str  # the config attribute that gives the per-head size


@dataclass(frozen=True)
class Block:
    heads: str  # the config attribute that gives the number of heads
    segments: tuple[Segment, ...]


Layout = dict[str, tuple[Block, ...]]  # projection attribute -> its blocks, in output-feature order


def _heads(heads: str, *segments: tuple[str | None, str]) -> tuple[Block, ...]:
    return (Block(heads, tuple(Segment(t, s) for t, s in segments)),)


Q_HEADS, KV_HEADS = "num_attention_heads", "num_key_value_heads"
STANDARD: Layout = {
    "q_proj": _heads(Q_HEADS, ("q", HEAD_DIM)),
    "k_proj": _heads(KV_HEADS, ("k", HEAD_DIM)),
    "v_proj": _heads(KV_HEADS, ("v", HEAD_DIM)),
}
FUSED_QKV: Layout = {
    "qkv_proj": (
        Block(Q_HEADS, (Segment("q", HEAD_DIM),)),
        Block(KV_HEADS, (Segment("k", HEAD_DIM),)),
        Block(KV_HEADS, (Segment("v", HEAD_DIM),)),
    )
}
_MLA_Q = _heads(Q_HEADS, ("q", "qk_nope_head_dim"), (None, "qk_rope_head_dim"))
MLA: Layout = {
    "q_proj": _MLA_Q,  # without q-LoRA
    "q_b_proj": _MLA_Q,  # with q-LoRA (q_a_proj -> norm -> q_b_proj)
    "kv_b_proj": _heads(Q_HEADS, ("k", "qk_nope_head_dim"), ("v", "v_head_dim")),
}
GATED_QUERY: Layout = {**STANDARD, "q_proj": _heads(Q_HEADS, ("q", HEAD_DIM), (None, HEAD_DIM))}


@dataclass(frozen=True)
class Family:
    layout: Layout = field(default_factory=lambda: STANDARD)
    linear_only: bool = False  # MLA: a value MLP cannot be absorbed into the latent (the paper uses KHA-Linear)
    verified: bool = True  # False: a model type not in the table, tried with the standard layout


# model_type -> Family: the families tested here (tiny random configs of each; see tests/modeling/test_families.py)
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "ministral": Family(),
    "qwen2": Family(),
    "qwen2_moe": Family(),
    "qwen3": Family(),
    "qwen3_moe": Family(),
    "qwen3_next": Family(GATED_QUERY),  # knocks on its softmax-attention layers only
    "mixtral": Family(),
    "gemma2": Family(),
    "gemma3_text": Family(),
    "phi3": Family(FUSED_QKV),
    "olmo2": Family(),
    "olmo3": Family(),
    "gpt_oss": Family(),
    "deepseek_v3": Family(MLA, linear_only=True),
    "smollm3": Family(),
    "granite": Family(),
    "glm4": Family(),
    "cohere2": Family(),
    "exaone4": Family(),
    "seed_oss": Family(),
    "hunyuan_v1_dense": Family(),
}
SUPPORTED_BASE_MODEL_TYPES = tuple(FAMILIES)


def family_spec(model_type: str) -> Family:
    """The table row of MODEL_TYPE, or the standard layout for a model type transformers knows and the table does
    not (checked against the family's attention code by `derive.py`, against sizes when the model is built)."""
    return FAMILIES.get(model_type) or Family(verified=False)


def config_size(config: Any, name: str) -> int:
    """A per-head size or head count from CONFIG (head_dim defaults to hidden_size // num_attention_heads)."""
    value = getattr(config, name, None)
    if value is None and name == HEAD_DIM:
        value = config.hidden_size // config.num_attention_heads
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"the config's {name} must be a positive integer for KHA, got {value!r}")
    return value


def knock_dims(config: Any, layout: Layout) -> dict[str, int]:
    """target -> the feature size its knock acts on (the same in every projection that holds that target)."""
    dims: dict[str, int] = {}
    for blocks in layout.values():
        for block in blocks:
            for segment in block.segments:
                if segment.target is not None:
                    size = config_size(config, segment.size)
                    if dims.setdefault(segment.target, size) != size:
                        raise ValueError(f"{segment.target} features of two sizes in one layout: {dims} vs {size}")
    return dims


def projection_features(config: Any, blocks: tuple[Block, ...]) -> int:
    """The output features a projection must have under the layout."""
    return sum(
        config_size(config, block.heads) * sum(config_size(config, s.size) for s in block.segments) for block in blocks
    )


def segment_rows(config: Any, blocks: tuple[Block, ...], target: str) -> list[tuple[int, int]]:
    """(start, stop) output rows of every head's TARGET segment in a projection: what a linear knock folds into."""
    rows, offset = [], 0
    for block in blocks:
        sizes = [config_size(config, s.size) for s in block.segments]
        for _ in range(config_size(config, block.heads)):
            for segment, size in zip(block.segments, sizes, strict=True):
                if segment.target == target:
                    rows.append((offset, offset + size))
                offset += size
    return rows


def knock_plan(config: Any, blocks: tuple[Block, ...], knocked: set[str]) -> tuple | None:
    """How the knocks of the KNOCKED targets act on a projection's output, for `knocks.apply_knock_plan`:
    ((block features, per-head size, ((segment size, knock attribute `q_knock`/... or None), ...)), ...),
    or None when no knock acts on the projection."""
    plan = []
    for block in blocks:
        sizes = [config_size(config, s.size) for s in block.segments]
        segments = tuple(
            (size, f"{s.target}_knock" if s.target in knocked else None)
            for s, size in zip(block.segments, sizes, strict=True)
        )
        plan.append((config_size(config, block.heads) * sum(sizes), sum(sizes), segments))
    return tuple(plan) if any(attr for *_, segments in plan for _, attr in segments) else None


def attention_layers(config: Any) -> list[int]:
    """Indices of the layers with softmax attention (all, except the linear-attention layers of hybrid models)."""
    types = getattr(config, "layer_types", None) or []
    skip = {i for i, kind in enumerate(types) if kind in NOT_ATTENTION_LAYER_TYPES}
    return [i for i in range(config.num_hidden_layers) if i not in skip]
