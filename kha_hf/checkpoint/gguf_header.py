"""Check a GGUF file's numbers against its own tensors before transformers builds a model from them.

transformers' GGUF loader builds the model from the file's metadata (`llama.block_count`, `embedding_length`, ...)
and only then reads the tensors: a 0.5 MB file that says `block_count = 200000` makes it allocate layer after layer
without bound (found by the round-5 attack: RSS grew 20 MB/s to 2.95 GB with no output). `check_gguf_header` reads
the metadata and the tensor table only (`gguf.GGUFReader` memory-maps the file; no tensor data is read) and refuses,
in one line, a file whose numbers disagree with its tensors, as `reader.open_checkpoint` does for
safetensors checkpoints.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..common.errors import KHAError

MAX_LAYERS = 4096  # as checks.MAX_LAYERS: the deepest open decoders have about 128
MAX_CONTEXT = 1 << 24  # 16M positions: beyond any released model's context
MAX_HEADS = 4096
BLOCK = re.compile(r"blk\.(\d+)\.")


def _contents(reader, key: str):
    """KEY's value, or None when it is absent or malformed (the loader's own error will name a malformed one)."""
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:
        return None


def _integer(reader, key: str) -> int | None:
    value = _contents(reader, key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def check_gguf_header(path: Path) -> None:
    """KHAError (one line) when PATH's layer count, widths, vocabulary, head counts, head sizes or context contradict
    its tensors or exceed any model's, or its norm epsilon or RoPE base is not a positive finite number; nothing is
    allocated from the file's numbers."""
    try:
        from gguf import GGUFReader
    except ImportError as err:  # transformers reads GGUF through the same package
        raise KHAError("reading a GGUF file needs the gguf package: pip install 'kha-hf[gguf]'") from err
    try:
        reader = GGUFReader(path)
    except Exception as err:  # a truncated or hostile file: GGUFReader raises ValueError, struct errors, ...
        raise KHAError(f"{path.name} is not a readable GGUF file: {err}") from err
    arch = _contents(reader, "general.architecture")
    if not isinstance(arch, str) or not re.fullmatch(r"[a-z0-9_]{1,64}", arch):
        raise KHAError(f"{path.name} names no model architecture (general.architecture)")
    where = path.name
    # each tensor's shape as GGUF stores it (ne[0] first: the input dimension of a weight matrix), read once
    shapes = {t.name: [int(n) for n in t.shape] for t in reader.tensors}
    kinds: dict[int, set[str]] = {}  # layer -> the names of its tensors after `blk.<i>.`
    for name in shapes:
        if match := BLOCK.match(name):
            kinds.setdefault(int(match.group(1)), set()).add(name[match.end() :])
    blocks = set(kinds)
    layers = _integer(reader, f"{arch}.block_count")
    if layers is None or not 0 < layers <= MAX_LAYERS:
        raise KHAError(f"{where}: {arch}.block_count {layers} is not a layer count (1 to {MAX_LAYERS})")
    if blocks != set(range(layers)):
        held = f"layers 0 to {max(blocks)}" if blocks else "no layers"
        raise KHAError(f"{where}: {arch}.block_count says {layers} layers, its tensors hold {held}")
    # transformers creates every tensor the file lacks at the sizes its metadata states (a file without its real
    # tensors would allocate from its numbers alone and convert to random weights): the embedding and each layer's
    # norm, attention and MLP must be there
    needed = (("attn_norm.weight",), ("attn_q.weight", "attn_qkv.weight", "attn_q_a.weight"), ("attn_output.weight",))
    needed += (("ffn_down.weight", "ffn_down_exps.weight"),)  # a dense or a MoE MLP (DeepSeek mixes both)
    for i in sorted(kinds):
        for options in needed:
            if not any(option in kinds[i] for option in options):
                raise KHAError(f"{where}: layer {i} has no {' or '.join(options)} tensor: not a complete model")
    embedding = shapes.get("token_embd.weight")  # [hidden, vocab]
    width = _integer(reader, f"{arch}.embedding_length")
    if embedding is None or len(embedding) != 2:
        raise KHAError(f"{where} has no token_embd.weight matrix: not a complete model")
    norm = shapes.get("blk.0.attn_norm.weight")
    if norm is not None and norm[0] != width:
        raise KHAError(f"{where}: {arch}.embedding_length {width} differs from attn_norm's width {norm[0]}")
    if width != embedding[0]:
        raise KHAError(f"{where}: {arch}.embedding_length {width} differs from token_embd's width {embedding[0]}")
    vocab = _integer(reader, f"{arch}.vocab_size")
    if vocab is not None and vocab != embedding[1]:
        raise KHAError(f"{where}: {arch}.vocab_size {vocab} differs from token_embd's {embedding[1]} rows")
    up = shapes.get("blk.0.ffn_up.weight")  # [hidden, intermediate] (dense layers; MoE: ffn_up_exps)
    down = shapes.get("blk.0.ffn_down.weight")  # [intermediate, hidden]
    feed_forward = _integer(reader, f"{arch}.feed_forward_length")
    # ffn_down's input is the intermediate width in every family (Phi-3's ffn_up is gate and up fused: twice it)
    dense = down[0] if down is not None and len(down) == 2 else up[1] if up is not None and len(up) == 2 else None
    if dense is not None and feed_forward is not None and feed_forward != dense:
        raise KHAError(f"{where}: {arch}.feed_forward_length {feed_forward} differs from its tensors' {dense}")
    for key, cap, least in (
        (f"{arch}.attention.head_count", MAX_HEADS, 1),
        (f"{arch}.attention.head_count_kv", MAX_HEADS, 1),
        (f"{arch}.context_length", MAX_CONTEXT, 1),
        (f"{arch}.expert_count", MAX_HEADS, 0),  # 0: no experts
    ):
        value = _integer(reader, key)
        if value is not None and value > cap:
            raise KHAError(f"{where}: {key} {value} is beyond any model's ({cap} at most)")
        if value is not None and value < least:
            raise KHAError(f"{where}: {key} {value} must be a positive integer")
    # numbers transformers copies into the config (rms_norm_eps, rope_theta): a negative or zero epsilon converted
    # without a word, a NaN one or a base of 0 failed later in many lines naming a temporary config.json
    for key in (
        f"{arch}.attention.layer_norm_rms_epsilon",
        f"{arch}.attention.layer_norm_epsilon",
        f"{arch}.rope.freq_base",
    ):
        value = _number(reader, key)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise KHAError(f"{where}: {key} {value:g} must be a positive finite number")
    _check_heads(reader, arch, shapes, sorted(kinds), where)


def _number(reader, key: str) -> float | None:
    """KEY's value as a float where it is a number (NaN and infinities included), else None."""
    value = _contents(reader, key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _check_heads(reader, arch: str, shapes: dict[str, list[int]], layers: list[int], where: str) -> None:
    """The head counts and head sizes the metadata states against each layer's attn_q, attn_k and attn_v rows.

    The tensors are the truth: some families set the head size apart from embedding_length / head_count (Gemma 3:
    key_length 256 with 640 / 4 = 160), and transformers takes it from key_length (Gemma, Qwen3-MoE),
    rope.dimension_count (Llama, Mistral) or neither. Layers without separate q/k/v (Phi-3's fused attn_qkv, MLA's
    attn_q_a) are not checked here; head counts stored per layer (arrays) neither.
    """
    heads = _integer(reader, f"{arch}.attention.head_count")
    kv = _integer(reader, f"{arch}.attention.head_count_kv")  # absent: transformers' family default, not checked
    key_sizes: dict[int, str] = {}  # head size -> how the first layer of that size shows it
    value_sizes: dict[int, str] = {}
    for i in layers:
        query, key, value = (shapes.get(f"blk.{i}.attn_{x}.weight") for x in "qkv")  # [hidden, heads * head size]
        q = query[1] if query is not None and len(query) == 2 else None
        k = key[1] if key is not None and len(key) == 2 else None
        v = value[1] if value is not None and len(value) == 2 else None
        for count, name, rows, field in (
            (heads, "q", q, "head_count"),
            (kv, "k", k, "head_count_kv"),
            (kv, "v", v, "head_count_kv"),
        ):
            if count and rows is not None and rows % count:
                raise KHAError(
                    f"{where}: {arch}.attention.{field} {count} does not divide blk.{i}.attn_{name}.weight's "
                    f"{rows} outputs"
                )
        if heads and kv and q is not None and k is not None and q // heads != k // kv:
            raise KHAError(
                f"{where}: {arch}.attention.head_count {heads} and {arch}.attention.head_count_kv {kv} disagree with "
                f"the tensors: blk.{i}.attn_q.weight's {q} outputs make heads of {q // heads}, "
                f"blk.{i}.attn_k.weight's {k} heads of {k // kv}"
            )
        if heads and q is not None and k is not None:  # MLA's attn_q (no attn_k) has heads of another size
            key_sizes.setdefault(q // heads, f"blk.{i}.attn_q.weight: {q} outputs, {heads} heads")
        if kv and v is not None:
            value_sizes.setdefault(v // kv, f"blk.{i}.attn_v.weight: {v} outputs, {kv} KV heads")
    # a head size must be one some layer has (Gemma 4's key_length is its global layers' size, not the sliding ones')
    stated = [("attention.key_length", key_sizes, ""), ("attention.value_length", value_sizes, "")]
    if arch in ("llama", "mistral"):  # transformers' GGUF loader reads rope.dimension_count as their head_dim
        stated.append(("rope.dimension_count", key_sizes, f"; transformers builds {arch} heads of that size"))
    for field, sizes, why in stated:
        size = _integer(reader, f"{arch}.{field}")
        if size is not None and sizes and size not in sizes:
            shown = next(iter(sizes.values()))
            told = " or ".join(map(str, sorted(sizes)))
            raise KHAError(
                f"{where}: {arch}.{field} {size} differs from the tensors' head size{'s' if len(sizes) > 1 else ''} "
                f"{told} ({shown}{why})"
            )
