"""Token-level perplexity of a causal LM on a text file, over strided windows.

The `evaluate` library's perplexity metric is used where it can run for both compared models: it is fetched from
the Hub and loads each model by id itself (so not for GGUF files, and not offline). Otherwise kha's own
implementation runs for both: the strided sliding-window recipe of the transformers docs, where every token is
scored once with up to `max_length - stride` tokens of context before it. One method serves both models, so their
numbers compare.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..common.errors import KHAError
from ..common.text_files import read_text_file


def strided_perplexity(model, tokenizer, text: str, max_length: int = 512, stride: int = 256) -> tuple[float, int]:
    """(perplexity, number of scored tokens)."""
    ids = tokenizer(text, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    seq_len = ids.shape[1]
    if seq_len < 2:  # one token (or none): nothing is predicted, so there is no perplexity
        raise KHAError(f"the perplexity text holds {seq_len} token(s); at least 2 are needed")
    nll, scored, prev_end = 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        window = ids[:, begin:end]
        labels = window.clone()
        labels[:, : -(end - prev_end)] = -100  # score only tokens not scored by the previous window
        with torch.no_grad():
            loss = model(window, labels=labels).loss
        n = int((labels[:, 1:] != -100).sum())
        nll += loss.item() * n
        scored += n
        prev_end = end
        if end == seq_len:
            break
    return math.exp(nll / scored), scored


def load_evaluate_metric(model_refs: list[str]):
    """evaluate's perplexity metric if it can serve every model (Hub reachable, no GGUF), else None."""
    if any(str(ref).endswith(".gguf") or Path(ref).is_file() for ref in model_refs):
        return None
    try:
        import evaluate

        return evaluate.load("perplexity", module_type="metric")
    except Exception:  # offline or missing: kha's own implementation serves both models
        return None


def perplexity(
    model, tokenizer, path: str | Path, metric=None, model_ref: str | None = None, max_length: int = 512
) -> dict:
    """{"perplexity", "tokens", "method"} for the text in PATH (with `metric`: through evaluate)."""
    text = read_text_file(path, "--perplexity file")
    if metric is not None:
        chunks = [text[i : i + 2000] for i in range(0, len(text), 2000)]
        result = metric.compute(predictions=chunks, model_id=str(model_ref), max_length=max_length)
        return {"perplexity": float(result["mean_perplexity"]), "tokens": None, "method": "evaluate"}
    ppl, tokens = strided_perplexity(model, tokenizer, text, max_length=max_length, stride=max_length // 2)
    return {"perplexity": ppl, "tokens": tokens, "method": "kha strided windows"}
