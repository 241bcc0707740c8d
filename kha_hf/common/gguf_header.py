"""Check a GGUF file's numbers against its own tensors before transformers builds a model from them.

transformers' GGUF loader builds the model from the file's metadata (`llama.block_count`, `embedding_length`, ...)
and only then reads the tensors: a 0.5 MB file that says `block_count = 200000` makes it allocate layer after layer
without bound (found by the round-5 attack: RSS grew 20 MB/s to 2.95 GB with no output). `check_gguf_header` reads
the metadata and the tensor table only (`gguf.GGUFReader` memory-maps the file; no tensor data is read) and refuses,
in one line, a file whose numbers disagree with its tensors, as `checkpoint.Checkpoint.check` does for
safetensors checkpoints.
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import KHAError

MAX_LAYERS = 4096  # as checks.MAX_LAYERS: the deepest open decoders have about 128
MAX_CONTEXT = 1 << 24  # 16M positions: beyond any released model's context
MAX_HEADS = 4096
BLOCK = re.compile(r"blk\.(\d+)\.")


def _integer(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        value = field.contents()
    except Exception:  # a malformed field: the loader's own error will name it
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def check_gguf_header(path: Path) -> None:
    """KHAError (one line) when PATH's layer count, widths, vocabulary, head counts or context contradict its
    tensors or exceed any model's; nothing is allocated from the file's numbers."""
    try:
        from gguf import GGUFReader
    except ImportError as err:  # transformers reads GGUF through the same package
        raise KHAError("reading a GGUF file needs the gguf package: pip install 'kha-hf[gguf]'") from err
    try:
        reader = GGUFReader(path)
    except Exception as err:  # a truncated or hostile file: GGUFReader raises ValueError, struct errors, ...
        raise KHAError(f"{path.name} is not a readable GGUF file: {err}") from err
    field = reader.fields.get("general.architecture")
    try:
        arch = field.contents() if field is not None else None
    except Exception:
        arch = None
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
    for key, cap in (
        (f"{arch}.attention.head_count", MAX_HEADS),
        (f"{arch}.attention.head_count_kv", MAX_HEADS),
        (f"{arch}.context_length", MAX_CONTEXT),
        (f"{arch}.expert_count", MAX_HEADS),
    ):
        value = _integer(reader, key)
        if value is not None and not 0 <= value <= cap:
            raise KHAError(f"{where}: {key} {value} is beyond any model's ({cap} at most)")
    query = shapes.get("blk.0.attn_q.weight")  # [hidden, heads * head_dim]
    heads = _integer(reader, f"{arch}.attention.head_count")
    if query is not None and len(query) == 2 and heads and query[1] % heads:
        raise KHAError(f"{where}: {heads} attention heads do not divide attn_q's {query[1]} outputs")
