"""The tokenizer of a checkpoint folder as GGUF metadata (`tokenizer.ggml.*`), so llama.cpp needs no other file.

Read from the folder's `tokenizer.json` (a fast tokenizer, what `save_pretrained` writes, and what `kha convert` writes
for a GGUF source) with transformers, as llama.cpp's own convert_hf_to_gguf.py does:
- byte-level BPE (GPT-2 style: Llama 3, Qwen, SmolLM) -> `gpt2`: tokens, merges, and the pre-tokenizer by name,
  found by llama.cpp's hash of a fixed text's token ids (`gguf_pretokenizers`); a bare `ByteLevel` pre-tokenizer with
  GPT-2's regex is `gpt-2`; anything else is refused unless the caller names the type;
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Gemma) -> `llama`: tokens with scores that give
  llama.cpp's merge loop the tokenizer's merge order (score = -rank of the merge that makes the token);
- Unigram -> `llama` with the Unigram scores.
Special token ids, the chat template and add_bos/add_eos come from the folder (gguf's SpecialVocab); add_bos/add_eos
and the SentencePiece space prefix are then set from what the tokenizer really does to a short text.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ..common.errors import KHAError
from .gguf_pretokenizers import check_hash, known_pre_type

SPIECE_SPACE = "\u2581"
UNREACHABLE = -1e9  # the score of a token no merge makes


def read_vocab(folder: Path, vocab_size: int, pre: str | None = None) -> tuple[dict, object]:
    """FOLDER's tokenizer as GGUF metadata for a model with VOCAB_SIZE embedding rows: GGUFWriter's `add_KEY(value)`
    calls as KEY -> value (tokenizer model "gpt2" or "llama", pre-type, tokens, scores, gguf.TokenType per token,
    merges, space prefix), and the gguf.SpecialVocab that adds the special tokens and chat template; KHAError (one
    line) when the folder lacks what GGUF needs. PRE names llama.cpp's pre-tokenizer type for a BPE tokenizer whose
    hash is unknown."""
    import gguf

    path = folder / "tokenizer.json"
    if not path.is_file():
        other = [n for n in ("tokenizer.model", "vocab.json", "tokenizer_config.json") if (folder / n).is_file()]
        has = f" (it has {', '.join(other)})" if other else ""
        raise KHAError(
            f"{folder} has no tokenizer.json{has}: a GGUF file carries its tokenizer, which kha reads from a fast "
            "tokenizer's tokenizer.json; save one there (AutoTokenizer.from_pretrained(BASE).save_pretrained(DIR))"
        )
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        kind = spec["model"]["type"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise KHAError(f"cannot read {path}: {err}") from err
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # a broken tokenizer folder: its own words, one line
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise KHAError(f"cannot load the tokenizer of {folder}: {reason}") from err
    vocab = tokenizer.get_vocab()
    n = max(vocab.values()) + 1 if vocab else 0
    if n > vocab_size:
        raise KHAError(
            f"the tokenizer of {folder} has token ids up to {n - 1}, but the model has {vocab_size} embedding rows"
        )
    byte_fallback = bool(spec["model"].get("byte_fallback"))
    if kind == "BPE" and not byte_fallback:
        model = "gpt2"
        pre = pre or known_pre_type(tokenizer) or _structural_pre(spec)
        if pre is None:
            raise KHAError(
                f"the BPE pre-tokenizer of {folder}/tokenizer.json is not one llama.cpp knows (hash "
                f"{check_hash(tokenizer)[:16]}...): llama.cpp would split text differently; if you know its type, "
                "pass it (--tokenizer-pre NAME, e.g. llama-bpe, qwen2, smollm, gpt-2)"
            )
    elif kind in ("BPE", "Unigram"):
        model, pre = "llama", pre or "default"
    else:
        raise KHAError(f"{folder}/tokenizer.json is a {kind} tokenizer; kha's GGUF export writes BPE and Unigram ones")

    tokens, types = _tokens_and_types(tokenizer, vocab, vocab_size, gguf)
    meta = {"tokenizer_model": model, "tokenizer_pre": pre, "token_list": tokens}
    if model == "llama":
        meta["token_scores"] = _scores(spec, vocab, vocab_size, kind)
    meta["token_types"] = types
    logging.getLogger("gguf").setLevel(logging.ERROR)  # SpecialVocab logs every choice at INFO/WARNING
    special = gguf.SpecialVocab(folder, load_merges=model == "gpt2", n_vocab=len(tokens))
    if model == "gpt2" and not special.merges:
        raise KHAError(
            f"{folder}/tokenizer.json has no merges: llama.cpp reads a BPE tokenizer's merges from the GGUF file, "
            "which cannot store an empty list"
        )
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    add_bos = tokenizer.bos_token_id is not None and len(ids) > len(plain) and ids[0] == tokenizer.bos_token_id
    add_eos = tokenizer.eos_token_id is not None and len(ids) > len(plain) and ids[-1] == tokenizer.eos_token_id
    special.add_special_token.update(bos=add_bos, eos=add_eos)
    if model == "gpt2":
        meta["token_merges"] = special.merges
    else:  # llama.cpp's SentencePiece tokenizer prepends a space unless told not to
        first = tokenizer.convert_ids_to_tokens(tokenizer("hello", add_special_tokens=False)["input_ids"][:1])
        meta["add_space_prefix"] = bool(first) and first[0].startswith(SPIECE_SPACE)
    return meta, special


def _structural_pre(spec: dict) -> str | None:
    """`gpt-2` for a bare ByteLevel pre-tokenizer with GPT-2's own regex (what a fresh `tokenizers` BPE gets)."""
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not spec.get("normalizer"):
        return "gpt-2"
    return None


def _tokens_and_types(tokenizer, vocab: dict[str, int], vocab_size: int, gguf) -> tuple[list[str], list[int]]:
    """One entry per embedding row: the token text and its type; rows without a token are `[PADi]`, unused."""
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.added_tokens_decoder  # id -> AddedToken
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if i in added:
            if added[i].special:
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace(SPIECE_SPACE, " ")  # llama.cpp takes user-defined tokens pre-normalised
                types.append(gguf.TokenType.USER_DEFINED)
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            types.append(gguf.TokenType.BYTE)
        elif tokenizer.unk_token_id == i:
            types.append(gguf.TokenType.UNKNOWN)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _scores(spec: dict, vocab: dict[str, int], vocab_size: int, kind: str) -> list[float]:
    """SentencePiece scores: Unigram's own; for BPE, -rank of the merge that makes each token, so that llama.cpp's
    highest-score-first merging follows the tokenizer's merge order (a token no merge makes: the lowest score)."""
    scores = [UNREACHABLE] * vocab_size
    if kind == "Unigram":
        for i, (_piece, score) in enumerate(spec["model"]["vocab"]):
            if i < vocab_size:
                scores[i] = float(score)
        return scores
    for rank, merge in enumerate(spec["model"].get("merges") or []):
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        i = vocab.get(left + right)
        if i is not None and i < vocab_size and scores[i] == UNREACHABLE:
            scores[i] = -float(rank + 1)
    return scores
