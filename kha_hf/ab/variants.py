"""The variants of a from-scratch ablation (`kha ab PRESET --variants ...`) and the paper's number for each
(light: the CLI reads them for its help and checks names before importing torch).

A variant is a knock preset (`kha_hf.KNOCK_PRESETS`: the paper's ablation rows), optionally with `_random`: the
same knocks initialised at random instead of the identity (the paper's Sec. 3.3 control).
"""

from __future__ import annotations

from dataclasses import dataclass

RANDOM_SUFFIX = "_random"

# The paper's loss deltas against the baseline (its ablation table: an A0.8B-6.6B MoE, 75B tokens, 4 KV heads;
# ../shared/KHA_NOTES.md). None: the paper gives no number (random init "converged much higher").
PAPER_DELTAS: dict[str, float | None] = {
    "linear_q": -0.007,
    "linear_k": -0.008,
    "linear_v": -0.017,
    "linear_qkv": -0.018,
    "mlp_q": -0.008,
    "mlp_k": -0.008,
    "mlp_v": -0.024,
    "mlp_qkv": -0.024,
    "gate_v": +0.063,
    "mlp_v_random": None,
}
PAPER_SETTING = "A0.8B-6.6B MoE, 75B tokens"


@dataclass(frozen=True)
class Variant:
    name: str  # as given: "mlp_v", "mlp_v_random"
    knock: str  # the preset
    knock_init: str  # "identity" or "random"

    @property
    def paper_delta(self) -> float | None:
        return PAPER_DELTAS.get(self.name)


def parse_variants(text: str | list[str]) -> list[Variant]:
    """'mlp_v,linear_v,gate_v,mlp_v_random' -> Variants; ValueError in one line naming what is unknown."""
    from ..modeling.configuration_kha import CONTROL_PRESETS, KNOCK_PRESETS

    names = text if isinstance(text, list) else [part.strip() for part in str(text).split(",") if part.strip()]
    if not names:
        raise ValueError("give at least one variant")
    repeated = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if repeated is not None:
        raise ValueError(f"variant {repeated[:60]!r} is named twice")
    variants = []
    for name in names:
        knock = name.removesuffix(RANDOM_SUFFIX)
        random = knock != name
        if knock not in KNOCK_PRESETS or (random and knock in CONTROL_PRESETS):
            raise ValueError(
                f"unknown variant {name[:60]!r}: choose knock presets ({', '.join(KNOCK_PRESETS)}), each optionally "
                f"with {RANDOM_SUFFIX} for random knock initialisation (e.g. mlp_v_random)"
            )
        variants.append(Variant(name, knock, "random" if random else "identity"))
    return variants


PAPER_ABLATION = ",".join(PAPER_DELTAS)  # every row of the paper's ablation table
