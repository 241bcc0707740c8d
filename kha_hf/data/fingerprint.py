"""What identifies a tokenizer for a prepared corpus: what decides its encoding, its special tokens and a probe.

Two tokenizers with the same fingerprint turn the same text into the same ids: the vocabulary (token -> id, hashed),
the special tokens and their ids, whether every encoding starts with BOS, the ids of a probe text that exercises
normalisation and pre-tokenisation (spaces, digits, accents, newlines), and, for a fast tokenizer, everything of its
definition that decides the ids (`encoding_sha256`: the model with its merges, the normalizer, the pre-tokenizer,
the post-processor and the added tokens; not the decoder, padding or truncation). A probe alone missed a normalizer
that maps "q" to "k" and a model without the 11 merges that hold "th" (#70 item 5). Manifests written before
`encoding_sha256` existed are compared on the rest.
"""

from __future__ import annotations

import hashlib
import json

PROBE = "Hello, World!  12345 naïve café\n\tdef f(x):\n    return x ** 2  # ünï\u00a0cödé 日本語"


def _sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False, sort_keys=True).encode("utf-8")).hexdigest()


def leading_bos(tokenizer) -> int | None:
    """The BOS id when TOKENIZER begins every encoding with it (Gemma, Llama 3), else None (GPT-2, SmolLM2)."""
    bos = tokenizer.bos_token_id
    ids = tokenizer("a")["input_ids"] if bos is not None else []
    return bos if ids and ids[0] == bos else None


ENCODING_PARTS = ("model", "normalizer", "pre_tokenizer", "post_processor", "added_tokens")


def encoding_sha256(tokenizer) -> str | None:
    """The hash of what decides a fast TOKENIZER's ids (ENCODING_PARTS of its tokenizer.json), or None for a slow
    one. The model's merges and vocabulary are hashed as the backend holds them, whatever file they came from."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    definition = json.loads(backend.to_str())
    return _sha256({part: definition.get(part) for part in ENCODING_PARTS})


def tokenizer_fingerprint(tokenizer, name: str | None = None) -> dict:
    """The manifest's record of TOKENIZER (NAME: where it came from, informative only)."""
    specials = {attr: getattr(tokenizer, f"{attr}_token_id", None) for attr in ("bos", "eos", "pad", "unk")}
    return {
        "name": name or getattr(tokenizer, "name_or_path", None) or None,
        "size": len(tokenizer),
        "vocab_sha256": _sha256(sorted(tokenizer.get_vocab().items())),
        "special_token_ids": specials,
        "added_tokens_sha256": _sha256(sorted(str(t) for t in tokenizer.added_tokens_decoder.values())),
        "leading_bos": leading_bos(tokenizer),
        "probe_sha256": _sha256(tokenizer(PROBE, add_special_tokens=False)["input_ids"]),
        "encoding_sha256": encoding_sha256(tokenizer),
    }


def fingerprint_difference(recorded: dict, actual: dict) -> str | None:
    """The first field in which two fingerprints differ, in words, or None when they agree (the name aside)."""
    keys = ["size", "vocab_sha256", "special_token_ids", "added_tokens_sha256", "leading_bos", "probe_sha256"]
    if "encoding_sha256" in recorded:  # a manifest written before it existed is compared on the rest
        keys.append("encoding_sha256")
    for key in keys:
        if recorded.get(key) != actual.get(key):
            if key in ("size", "special_token_ids", "leading_bos"):
                return f"{key.replace('_', ' ')} {recorded.get(key)} against {actual.get(key)}"
            return {
                "vocab_sha256": "another vocabulary",
                "added_tokens_sha256": "other added tokens",
                "probe_sha256": "another encoding of the same text",
                "encoding_sha256": "another normalizer, pre-tokenizer, merges or post-processor",
            }[key]
    return None
