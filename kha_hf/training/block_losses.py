"""Per-block losses of a causal LM on fixed-length token blocks: the unit the A/B comparisons resample."""

from __future__ import annotations

import torch
from torch.nn import functional as F


@torch.no_grad()
def block_losses(model, blocks, batch_size: int = 4) -> list[float]:
    """Mean next-token cross-entropy of each block of BLOCKS (a TokenBlocks), in block order.

    For equal-length blocks their mean is the Trainer's eval_loss; kept per block so that differences between two
    models can be paired block by block and resampled.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses: list[float] = []
    ids_all = blocks.blocks
    for start in range(0, len(ids_all), batch_size):
        ids = ids_all[start : start + batch_size].to(device)
        logits = model(input_ids=ids).logits[:, :-1].float()  # (B, T-1, V)
        tokens = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, T-1)
        losses.extend(tokens.mean(dim=1).tolist())
    model.train(was_training)
    return losses
