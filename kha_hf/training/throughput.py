"""Throughput of a training run: model FLOPs a token from the model's shape, the FLOP/s achieved, and the model
FLOPs utilisation (MFU) against a peak the user gives (`--peak-flops`).

FLOPs a trained token (PaLM, appendix B): 6 x the parameters a token passes through, plus 12 x layers x heads x
head_dim x sequence length for the attention scores and their weighted sum (forward and backward; a causal mask's
skipped half is counted, as PaLM and nanoGPT count it). The parameters a token passes through: every weight but the
input embedding (a lookup, no multiply); the output head counted even when tied to it; an MoE layer's experts at the
share a token uses (`num_experts_per_tok / num_experts`); a knock once per head it serves (one head_dim x head_dim
map shared by every head is applied to each of them).
"""

from __future__ import annotations

from torch import nn

from .params import is_knock_parameter


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs (forward + backward) of one token of a block of SEQ_LEN tokens through MODEL."""
    config = _text_config(model)
    heads = getattr(config, "num_attention_heads", 0) or 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    active = getattr(config, "num_experts_per_tok", None)
    embedding = model.get_input_embeddings()
    skipped = {id(p) for p in embedding.parameters()} if embedding is not None else set()
    head = model.get_output_embeddings()
    through = 0.0
    for name, param in model.named_parameters():
        if id(param) in skipped:
            continue
        count = param.numel()
        if is_knock_parameter(name):
            count *= heads if ".q_knock." in name else kv_heads
        elif experts and active and ".experts." in name:
            count *= active / experts
        through += count
    if head is not None and id(head.weight) in skipped:  # tied: the head's multiply is real compute
        through += head.weight.numel()
    layers = getattr(config, "num_hidden_layers", 0) or 0
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    return 6 * through + 12 * layers * heads * head_dim * seq_len


def parameter_line(model: nn.Module) -> str:
    """'12.9M parameters (6.3M of them the embedding)': the model as built."""
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings()
    embedded = sum(p.numel() for p in embedding.parameters()) if embedding is not None else 0
    return f"{total / 1e6:.1f}M parameters ({embedded / 1e6:.1f}M of them the embedding)"


def throughput_logs(tokens_per_second: float, flops_token: float, peak: float | None, devices: int) -> dict:
    """What a training log adds: the model FLOP/s achieved and, with PEAK (one device's FLOP/s), the MFU over
    DEVICES devices."""
    achieved = tokens_per_second * flops_token
    logs = {"model_flops_per_second": float(f"{achieved:.4g}")}
    if peak:
        logs["mfu"] = round(achieved / (peak * max(1, devices)), 5)
    return logs
