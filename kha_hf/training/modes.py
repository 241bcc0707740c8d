"""What trains: `knocks` (only the knocks), `lora` (knocks fully + LoRA adapters via PEFT), or `full`."""

from __future__ import annotations

from torch import nn

from ..common.errors import KHAError
from .params import KNOCK_MODULE_NAMES, is_knock_parameter

MODES = ("knocks", "lora", "full")
DEFAULT_LR = {"knocks": 1e-3, "lora": 2e-4, "full": 5e-5}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prepare_for_mode(model: nn.Module, mode: str, lora_r: int = 16, lora_alpha: int = 32) -> nn.Module:
    """Set requires_grad (knocks, full) or wrap in a PEFT LoRA model whose `modules_to_save` are the knocks."""
    if mode not in MODES:
        raise KHAError(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    if not any(is_knock_parameter(n) for n, _ in model.named_parameters()):
        raise KHAError("the model has no knocks: convert it to KHA first (kha convert)")
    if mode == "knocks":
        for name, param in model.named_parameters():
            param.requires_grad_(is_knock_parameter(name))
        return model
    if mode == "full":
        model.requires_grad_(True)
        return model
    from peft import LoraConfig

    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m) is nn.Linear}
    knock_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()} & set(KNOCK_MODULE_NAMES)
    config = LoraConfig(
        r=lora_r,
        lora_alpha=lora_alpha,
        lora_dropout=0.0,
        target_modules=sorted(set(LORA_TARGETS) & linear_names),
        # Knocks train fully and are saved with the adapter; LoRA cannot wrap them meaningfully (tiny d_h x d_h).
        modules_to_save=sorted(knock_names),
        task_type="CAUSAL_LM",
    )
    return wrap_with_peft(model, config)


def lora_targets(knock: str) -> list[str]:
    """The projections the knocks of KNOCK act on: v_proj for value knocks, q/k/v_proj for Q/K/V knocks."""
    from ..modeling.configuration_kha import KNOCK_PRESETS

    q, k, v = KNOCK_PRESETS[knock]
    return [f"{t}_proj" for t, kind in zip("qkv", (q, k, v), strict=True) if kind != "none"]


def matched_lora_rank(model: nn.Module, targets: list[str], knock_parameters: int) -> tuple[int, int]:
    """(rank, LoRA parameter count) on TARGETS closest to KNOCK_PARAMETERS: a rank r adds r·(in+out) per module."""
    per_rank = sum(
        m.in_features + m.out_features
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets
    )
    if per_rank == 0:
        raise KHAError(f"the base model has no {', '.join(targets)} modules for the LoRA control")
    rank = max(1, round(knock_parameters / per_rank))
    return rank, rank * per_rank


def with_lora(model: nn.Module, targets: list[str], rank: int) -> nn.Module:
    """MODEL wrapped by PEFT with a LoRA of RANK on TARGETS (everything else frozen): the matched control."""
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    return wrap_with_peft(model, config)


def with_ia3(model: nn.Module) -> nn.Module:
    """MODEL wrapped by PEFT with IA3 (learned scales of features, everything else frozen) at PEFT's standard
    placement for the family; for a family PEFT's table lacks, at its Llama placement: the keys, the values and the
    MLP's down projection's input. Its size is fixed by the architecture: one scale per feature."""
    from peft import IA3Config
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_IA3_TARGET_MODULES_MAPPING as STANDARD

    linear_names = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    if model.config.model_type in STANDARD:
        targets = list(STANDARD[model.config.model_type])
        config = IA3Config(task_type="CAUSAL_LM")
    else:
        if "v_proj" not in linear_names:
            raise KHAError(
                f"the IA3 control needs separate k_proj/v_proj projections, which {model.config.model_type} does "
                "not have"
            )
        targets = [name for name in ("k_proj", "v_proj", "down_proj") if name in linear_names]
        feedforward = [name for name in ("down_proj",) if name in linear_names]
        config = IA3Config(target_modules=targets, feedforward_modules=feedforward, task_type="CAUSAL_LM")
    absent = [name for name in targets if name not in linear_names]
    if absent:  # MoE experts in transformers 5 are fused 3-D tensors, not linear layers: PEFT cannot wrap them
        print(
            f"IA3 on {model.config.model_type}: no linear {', '.join(absent)} to scale (fused expert weights?); "
            f"it scales {', '.join(n for n in targets if n in linear_names)} only"
        )
    return wrap_with_peft(model, config)


def with_shared_oft(model: nn.Module) -> nn.Module:
    """MODEL wrapped by PEFT with OFT on `o_proj`: one orthogonal head_dim x head_dim block per layer (Cayley
    parametrised, head_dim·(head_dim−1)/2 parameters), shared by every head, rotating each head's attention output.
    Attention is linear in V, so this is an orthogonal linear value knock applied after the softmax: the
    orthogonal counterpart of `linear_v` with about half its parameters."""
    from peft import OFTConfig

    heads = model.config.get_text_config().num_attention_heads
    if not isinstance(heads, int) or heads < 1:
        raise KHAError(f"the OFT control needs the number of attention heads, got {heads!r}")
    # o_proj's input is the heads' outputs side by side, so a block of in_features / heads is one head (this also
    # holds where values are narrower than queries and keys, as in MLA)
    widths = {
        m.in_features for name, m in model.named_modules() if name.endswith("o_proj") and isinstance(m, nn.Linear)
    }
    if len(widths) != 1 or next(iter(widths)) % heads:
        raise KHAError(
            f"the OFT control needs o_proj layers of one input width divisible by the {heads} heads; "
            f"{model.config.model_type} has {sorted(widths) or 'no o_proj'}"
        )
    # peft 0.21 approximates the Cayley transform by a 5-term Neumann series by default, which stops being
    # orthogonal once the weights grow (singular values 0.05-234 after 24 steps at lr 3e-2 on SmolLM2): the exact
    # transform (one head_dim x head_dim solve per layer) keeps the control what it claims to be
    oft = OFTConfig(
        r=0,
        oft_block_size=widths.pop() // heads,
        block_share=True,
        use_cayley_neumann=False,
        target_modules=["o_proj"],
        task_type="CAUSAL_LM",
    )
    return wrap_with_peft(model, oft)


def wrap_with_peft(model: nn.Module, config) -> nn.Module:
    """`peft.get_peft_model`, without the FutureWarning it triggers by reading the deprecated
    `is_gradient_checkpointing` property (peft 0.21.2 with transformers 5.24); every other warning still shows."""
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        return get_peft_model(model, config)
