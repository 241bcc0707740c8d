"""`KnockLayer`: a q/k/v projection of a stock model with knock adapters on its output.

The knock acts where KHA models put it: on the projection's output (after its bias), per head, before any q/k
norm, RoPE or attention kernel. `families.knock_plan` says which output features are whose head and segment (a
plain projection, Phi-3's fused qkv, MLA's segments, Qwen3-Next's gated query); `knocks.apply_knock_plan` applies
them, the same code as KHA models run.
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.tuners_utils import BaseTunerLayer, check_adapters_to_merge
from torch import nn

from ..modeling.configuration_kha import TARGET_WORDS
from ..modeling.families import TARGETS, segment_rows
from ..modeling.knocks import apply_knock_plan, build_knock, fold_projection

# unmerge() inverts the knock on weights stored in float32: their rounding (about 6e-8) grows by the knock's condition
# number, so above 1e4 a merge and unmerge would leave the stock weights visibly changed (relative error 1.8e-5 at
# 1e4, 0.17 at 1e8, 20 at 3e11: measured by the round-5 review); such a knock is not merged
MAX_MERGE_CONDITION = 1e4


class KnockSet(nn.Module):
    """One adapter's knocks on one projection: `q_knock` / `k_knock` / `v_knock` where the projection holds that
    target (the attribute names of KHA models, so `apply_knock_plan` reads them alike)."""

    def __init__(self, types: dict[str, str], dims: dict[str, int]) -> None:
        super().__init__()
        for target in TARGETS:
            setattr(self, f"{target}_knock", build_knock(types[target], dims[target]) if target in types else None)


class KnockLayer(nn.Module, BaseTunerLayer):
    """A projection (`nn.Linear`) wrapped with knock adapters. forward: (..., in) -> (..., out)."""

    adapter_layer_names = ("knock_sets",)

    def __init__(self, base_layer: nn.Module, adapter_name: str, placement: dict[str, Any], **kwargs: Any) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.knock_sets = nn.ModuleDict()
        self.placement = placement  # plan inputs: config view, blocks of this projection, knock dims
        self._disable_adapters = False
        self.merged_adapters = []
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, placement)

    def update_layer(self, adapter_name: str, placement: dict[str, Any], inference_mode: bool = False) -> None:
        """Add ADAPTER_NAME's knocks for the targets this projection holds (types per target in PLACEMENT)."""
        self.knock_sets[adapter_name] = KnockSet(placement["types"], placement["dims"])
        self.knock_sets[adapter_name].plan = placement["plan"]
        self._move_adapter_to_device_of_base_layer(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=inference_mode)

    def forward(
        self, x: torch.Tensor, *args: Any, adapter_names: list[str] | None = None, **kwargs: Any
    ) -> torch.Tensor:
        self._check_forward_args(x, adapter_names)
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if adapter_names is not None:
            return self._mixed_batch_forward(result, adapter_names)
        if self.merged:
            return result
        for name in self.active_adapters:
            if name in self.knock_sets:
                result = self._knock(name, result)
        return result

    def _knock(self, name: str, result: torch.Tensor) -> torch.Tensor:
        """RESULT (..., out), the projection's output, with ADAPTER NAME's knocks applied (in the knocks' dtype)."""
        knocks = self.knock_sets[name]
        dtype = next(knocks.parameters()).dtype
        return apply_knock_plan(knocks.plan, result.to(dtype), knocks).to(result.dtype)

    # -- mixed adapter batches (`adapter_names=`, one adapter per row, "__base__" for none), as PEFT's LoRA does ---
    def _check_forward_args(self, x: torch.Tensor, adapter_names: list[str] | None) -> None:
        """PEFT's own errors (`LoraLayer._check_forward_args`): a list as long as the batch, and no merged adapter."""
        if adapter_names is None:
            return
        if len(x) != len(adapter_names):
            raise ValueError(
                "Length of `adapter_names` should be the same as the number of inputs, but got "
                f"{len(adapter_names)} and {len(x)} respectively."
            )
        if self.merged:
            raise ValueError(
                "Cannot pass `adapter_names` when there are merged adapters, please call `unmerge_adapter` first."
            )

    def _mixed_batch_forward(self, result: torch.Tensor, adapter_names: list[str]) -> torch.Tensor:
        """RESULT (batch, ..., out), the projection's output, with row i knocked by ADAPTER_NAMES[i]'s knocks; rows
        of "__base__", or of an adapter without knocks on this projection (e.g. k_proj under linear_v), unchanged.
        Each adapter's rows go through its own knock plan, so adapters of different presets mix."""
        result = result.clone()  # the base layer's output is not changed in place
        for name in dict.fromkeys(adapter_names):
            if name == "__base__" or name not in self.knock_sets:
                continue
            rows = [i for i, item in enumerate(adapter_names) if item == name]
            result[rows] = self._knock(name, result[rows])
        return result

    # -- merging (linear knocks only): the fold rule of `kha fold`, per head, biases included --------------------
    def _fold_rows(self, name: str, action: str = "merge") -> list[tuple[str, list[tuple[int, int]], torch.Tensor]]:
        knocks = self.knock_sets[name]
        folds = []
        for target in TARGETS:
            knock = getattr(knocks, f"{target}_knock")
            if knock is None:
                continue
            if not isinstance(knock, nn.Linear):
                raise ValueError(
                    f"adapter {name!r}: the {TARGET_WORDS[target]} knock is an MLP (KHA-MLP), which is non-linear and "
                    "cannot be merged into the projection; make a KHA model of base + adapter instead "
                    "(`kha_hf.peft.to_kha_model(peft_model)`, then save_pretrained), which kha serve and vLLM serve"
                )
            if not torch.isfinite(knock.weight).all():  # PEFT's own wording (its tests and users match it)
                raise ValueError(
                    f"NaNs detected in the merged weights. The adapter {name} seems to be broken "
                    f"(its {target} knock holds NaN or infinite values; nothing was merged)"
                )
            condition = float(torch.linalg.cond(knock.weight.detach().double()))
            if not condition <= MAX_MERGE_CONDITION:  # inf or NaN if singular
                # unmerge() and disable_adapter() invert the knock: a singular or ill-conditioned one would leave
                # the stock projection unrecoverable in memory
                raise ValueError(
                    f"adapter {name!r}: the {target} knock is singular or ill-conditioned (condition number "
                    f"{condition:.3g}, at most {MAX_MERGE_CONDITION:.0e}), so a merge could not be undone exactly; "
                    f"refusing to {action} (nothing was changed)"
                )
            rows = segment_rows(self.placement["config"], self.placement["blocks"], target)
            folds.append((target, rows, knock.weight.detach()))
        return folds

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Fold the linear knocks of ADAPTER_NAMES into the weight and bias: `W_h' = T^T W_h`, `b_h' = T^T b_h`."""
        adapter_names = check_adapters_to_merge(self, adapter_names)
        base = self.get_base_layer()
        for name in adapter_names:
            if name not in self.knock_sets:
                continue
            folds = self._fold_rows(name)  # refuses MLP or non-finite knocks before any weight changes
            weight, bias = base.weight.data, None if base.bias is None else base.bias.data
            try:
                for _, rows, knock in folds:
                    weight = fold_projection(weight, knock, rows)
                    bias = None if bias is None else fold_projection(bias, knock, rows)
            except OverflowError as err:  # before this layer's weights change
                raise ValueError(f"adapter {name!r}: merging into {base.weight.dtype} weights: {err}") from None
            if safe_merge and not (torch.isfinite(weight).all() and (bias is None or torch.isfinite(bias).all())):
                raise ValueError(f"NaNs detected in the merged weights. The adapter {name} seems to be broken")
            base.weight.data = weight
            if bias is not None:
                base.bias.data = bias
            self.merged_adapters.append(name)

    def unmerge(self) -> None:
        """Undo merges, newest first, with the knocks' inverses (in float64: equal to the stock weights within
        float rounding, not bit for bit)."""
        base = self.get_base_layer()
        while self.merged_adapters:
            name = self.merged_adapters[-1]
            folds = self._fold_rows(name, action="unmerge")  # a knock changed since its merge: refused, still merged
            self.merged_adapters.pop()
            weight, bias = base.weight.data, None if base.bias is None else base.bias.data
            for _, rows, knock in reversed(folds):
                inverse = torch.linalg.inv(knock.double())
                weight = fold_projection(weight, inverse, rows)
                bias = None if bias is None else fold_projection(bias, inverse, rows)
            base.weight.data = weight
            if bias is not None:
                base.bias.data = bias

    def __repr__(self) -> str:
        return "knock." + super().__repr__()
