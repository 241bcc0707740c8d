"""The knock modules of Knocking-Heads Attention (arXiv 2510.23052, Sec. 3).

A knock is shared by all heads of one layer and acts on each head's features, i.e. on the last dimension of a
(B, T, n_heads, d_h) tensor, right after the q/k/v projection. Every kind starts as the exact identity, except under
the paper's random-initialisation control (`init="random"`, Sec. 3.3), which only from-scratch A/B runs use.

This file is copied next to saved checkpoints (remote code): it may import only torch and siblings.
"""

from __future__ import annotations

import torch
from torch import nn

KNOCK_STARTS = ("identity", "zeros", "random")


class KnockLinear(nn.Linear):
    """A bias-free d_h x d_h linear map with a fixed starting value: the identity, zeros, or (the paper's Sec. 3.3
    control) nn.Linear's own random draw, kaiming-uniform with bound 1/sqrt(d_h), from torch's global generator.

    Follows the nn.Linear convention, so `weight` holds T transposed: `forward(x) = x @ T = x @ weight.T`.
    """

    def __init__(self, head_dim: int, start: str = "identity", device=None, dtype=None) -> None:
        if start not in KNOCK_STARTS:
            raise ValueError(f"start must be one of {', '.join(KNOCK_STARTS)}, got {start!r}")
        self.start = start  # read by reset_parameters, which nn.Linear.__init__ calls
        super().__init__(head_dim, head_dim, bias=False, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        if self.weight.is_meta:
            # Built without storage (transformers' and vLLM's loaders build on the meta device, then load or
            # initialise real tensors): nothing to fill, and torch.eye cannot write into a meta tensor.
            return
        with torch.no_grad():
            if self.start == "identity":
                nn.init.eye_(self.weight)
            elif self.start == "zeros":
                nn.init.zeros_(self.weight)
            else:
                super().reset_parameters()  # nn.Linear's draw: what "random initialisation" means for a layer


def _start(start: str, random: bool) -> str:
    return "random" if random else start


class LinearKnock(KnockLinear):
    """KHA-Linear: `X~_i = X_i T` for every head i, T initialised to the identity (diagonal initialisation)."""

    def __init__(self, head_dim: int, device=None, dtype=None, random: bool = False) -> None:
        super().__init__(head_dim, _start("identity", random), device=device, dtype=dtype)


class MLPKnock(nn.Module):
    """KHA-MLP: `X~_i = 2 * ((X_i W_up) * sigmoid(X_i W_gate)) W_down`, shared by all heads; the paper's value MLP,
    and its Q-only, K-only and QKV ablation rows on the other targets.

    W_up = W_down = I and W_gate = 0 at init, so `2 * sigmoid(0) = 1` and the module is exactly the identity.
    """

    def __init__(self, head_dim: int, device=None, dtype=None, random: bool = False) -> None:
        super().__init__()
        self.up = KnockLinear(head_dim, _start("identity", random), device=device, dtype=dtype)
        self.gate = KnockLinear(head_dim, _start("zeros", random), device=device, dtype=dtype)
        self.down = KnockLinear(head_dim, _start("identity", random), device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: (B, T, n_heads, d_h). The factor 2 multiplies the gate (2 * 0.5 = 1 exactly) rather than the output,
        # so the identity at init is bit-exact even for subnormal inputs.
        return self.down(self.up(x) * (2.0 * torch.sigmoid(self.gate(x))))


class GateKnock(nn.Module):
    """The paper's "gate alone on V" control (its ablation row that hurt, +0.063): `V~_i = 2 * (V_i ⊙ sigmoid(V_i
    W_gate))`, W_gate shared by all heads. W_gate = 0 at init, so the module is exactly the identity. Not a knock
    anyone should ship: it exists to be compared against (`gate_v`, from-scratch A/B runs only)."""

    def __init__(self, head_dim: int, device=None, dtype=None, random: bool = False) -> None:
        super().__init__()
        self.gate = KnockLinear(head_dim, _start("zeros", random), device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (2.0 * torch.sigmoid(self.gate(x)))  # (B, T, n_heads, d_h); 2 * sigmoid(0) = 1 exactly


def apply_knock_plan(plan: tuple, states: torch.Tensor, owner: nn.Module) -> torch.Tensor:
    """A projection's output (..., features) with OWNER's knocks (`owner.q_knock`, ...) applied where PLAN
    (`families.knock_plan`) puts them: per block, per head, per segment. The one knock step of KHA models (OWNER is
    the attention module) and of the PEFT knock adapter (OWNER holds one adapter's knocks)."""
    if len(plan) == 1:
        return _knock_block(plan[0], states, owner)
    parts = states.split([features for features, _, _ in plan], dim=-1)  # Phi-3: [q heads][k heads][v heads]
    return torch.cat([_knock_block(b, p, owner) for b, p in zip(plan, parts, strict=True)], dim=-1)


def _knock_block(block: tuple, states: torch.Tensor, owner: nn.Module) -> torch.Tensor:
    _, head_size, segments = block
    heads = states.unflatten(-1, (-1, head_size))  # (..., n_heads, head_size): -1 keeps TP-local head counts
    if len(segments) == 1:
        attr = segments[0][1]
        return states if attr is None else getattr(owner, attr)(heads).flatten(-2)  # shared by all heads
    pieces = heads.split([size for size, _ in segments], dim=-1)  # e.g. MLA: (q_nope, q_rope)
    knocked = [
        piece if attr is None else getattr(owner, attr)(piece)
        for (_, attr), piece in zip(segments, pieces, strict=True)
    ]
    return torch.cat(knocked, dim=-1).flatten(-2)


def finite_mask(tensor: torch.Tensor) -> torch.Tensor:
    """`torch.isfinite` of TENSOR, float8 included (torch has no isfinite for the 1-byte floats: they are upcast)."""
    if tensor.is_floating_point() and tensor.element_size() == 1:
        tensor = tensor.float()
    return torch.isfinite(tensor)


def fold_projection(weight: torch.Tensor, knock: torch.Tensor, rows: list[tuple[int, int]]) -> torch.Tensor:
    """W (out, in) or b (out,) -> `knock @ W[rows]` for each head's rows of the knock's target (each d rows), in
    float64, cast back to W's dtype; the other rows are left as they are.

    Raises OverflowError where finite folded values do not fit W's dtype (a float16 projection and a knock that
    scales it past 65504): the cast would store infinities and the model would compute NaN."""
    index = torch.cat([torch.arange(start, stop) for start, stop in rows])
    heads = weight[index].reshape(len(rows), -1, *weight.shape[1:]).double()  # (n, d, in) or (n, d)
    folded = torch.einsum("ij,nj...->ni...", knock.double(), heads)
    cast = folded.reshape(-1, *weight.shape[1:]).to(weight.dtype)
    if not finite_mask(cast).all() and torch.isfinite(folded).all():
        raise OverflowError(
            f"the folded values reach {folded.abs().max().item():.4g}, beyond the range of {weight.dtype} "
            f"(largest {torch.finfo(weight.dtype).max:.4g})"
        )
    out = weight.clone()
    out[index] = cast
    return out


KNOCK_CLASSES = {"linear": LinearKnock, "mlp": MLPKnock, "gate": GateKnock}


def build_knock(kind: str, head_dim: int | None, init: str = "identity") -> nn.Module | None:
    """'none' -> None, 'linear' -> LinearKnock, 'mlp' -> MLPKnock, 'gate' -> GateKnock, acting on HEAD_DIM features;
    INIT 'identity' (every knock of a convertible model) or 'random' (the paper's Sec. 3.3 control)."""
    if kind == "none":
        return None
    if head_dim is None:
        raise ValueError(f"a {kind} knock needs the size of the features it acts on")
    if kind not in KNOCK_CLASSES:
        raise ValueError(f"unknown knock type {kind!r}; choose one of: none, {', '.join(KNOCK_CLASSES)}")
    if init not in ("identity", "random"):
        raise ValueError(f"knock_init must be 'identity' or 'random', got {init!r}")
    return KNOCK_CLASSES[kind](head_dim, random=init == "random")
