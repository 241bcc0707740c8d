"""Where each family's knocks must act, written out from transformers' own attention code, independently of
`kha_hf/modeling/families.py` (the table under test): the tests compare the table with this file and build their
hand-written references from it, so a wrong row (blocks or segments in the wrong order, a gate knocked instead of a
query) fails them.

`expected_rows(model_type, config)` -> {projection: {"q" | "k" | "v": [(start, stop), ...]}}: the output features of
each head's query/key/value part in that projection's output, as the family's forward slices them (transformers
5.24; the source line is quoted for each special case).
"""

from __future__ import annotations


def _per_head(start: int, heads: int, stride: int, size: int) -> list[tuple[int, int]]:
    return [(start + h * stride, start + h * stride + size) for h in range(heads)]


def expected_rows(model_type: str, config) -> dict[str, dict[str, list[tuple[int, int]]]]:
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if model_type == "phi3":
        # Phi3Attention.forward: query_pos = num_attention_heads * head_dim; q = qkv[..., :query_pos];
        # k = qkv[..., query_pos : query_pos + kv_heads * head_dim]; v = qkv[..., query_pos + kv_heads * head_dim :]
        q_end, k_end = heads * head_dim, heads * head_dim + kv_heads * head_dim
        return {
            "qkv_proj": {
                "q": _per_head(0, heads, head_dim, head_dim),
                "k": _per_head(q_end, kv_heads, head_dim, head_dim),
                "v": _per_head(k_end, kv_heads, head_dim, head_dim),
            }
        }
    if model_type == "qwen3_next":
        # Qwen3NextAttention.forward: query_states, gate = torch.chunk(q_proj(x).view(..., -1, head_dim * 2), 2, -1):
        # per head [query | output gate]; the gate is not a query and takes no knock
        return {
            "q_proj": {"q": _per_head(0, heads, 2 * head_dim, head_dim)},
            "k_proj": {"k": _per_head(0, kv_heads, head_dim, head_dim)},
            "v_proj": {"v": _per_head(0, kv_heads, head_dim, head_dim)},
        }
    if model_type == "deepseek_v3":
        # DeepseekV3Attention: q = q_b_proj(...) (or q_proj) .view(..., -1, qk_head_dim), split [nope, rope]: the
        # shared RoPE part takes no knock; kv_b_proj(...).view(..., -1, nope + v_head_dim), split [k_nope, value]
        nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        query = {"q": _per_head(0, heads, nope + rope, nope)}
        return {
            "q_proj": query,
            "q_b_proj": query,
            "kv_b_proj": {
                "k": _per_head(0, heads, nope + v_dim, nope),
                "v": _per_head(nope, heads, nope + v_dim, v_dim),
            },
        }
    # every other family: q_proj(x).view(..., -1, head_dim), k_proj / v_proj likewise with the key/value heads
    return {
        "q_proj": {"q": _per_head(0, heads, head_dim, head_dim)},
        "k_proj": {"k": _per_head(0, kv_heads, head_dim, head_dim)},
        "v_proj": {"v": _per_head(0, kv_heads, head_dim, head_dim)},
    }


def table_rows(layout, config) -> dict[str, dict[str, list[tuple[int, int]]]]:
    """The same view of a layout of the table (what `kha fold` and the knocks use)."""
    from kha_hf.modeling.families import segment_rows

    rows = {}
    for projection, blocks in layout.items():
        targets = {s.target for b in blocks for s in b.segments if s.target is not None}
        rows[projection] = {t: segment_rows(config, blocks, t) for t in sorted(targets)}
    return rows
