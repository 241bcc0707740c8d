"""Load any model the tools accept: a folder or Hub id (KHA or stock), or a GGUF file (dequantised)."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import KHAError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise KHAError(f"unknown dtype {name!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[name]


def load_causal_lm(
    ref: str | Path, dtype: str = "float32", device: str = "cpu", attn_implementation: str | None = None
):
    """(model, tokenizer) for REF, in eval mode on DEVICE. KHA checkpoints load through their own code
    (`trust_remote_code`), which is what a user without kha_hf gets too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .conversion.source import find_gguf

    path = Path(ref)
    gguf = find_gguf(path) if path.exists() else None
    kwargs = {"dtype": torch_dtype(dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    try:
        if gguf is not None:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        else:
            model = AutoModelForCausalLM.from_pretrained(ref, trust_remote_code=True, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(ref)
    except OSError as err:
        raise KHAError(f"cannot load model {str(ref)!r}: {str(err).strip().splitlines()[0]}") from err
    return model.to(device).eval(), tokenizer
