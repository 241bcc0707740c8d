"""`KHAPlugin`: kha-hf's Axolotl 0.19 plugin (`plugins: [kha_hf.integrations.axolotl.KHAPlugin]`).

- `adapter: knock` (`get_adapter_capabilities`): Axolotl builds the knock adapter through `load_adapter`, a
  `KnockConfig` from the `knock:` block (`args.KnockArgs`) on a stock model of any family KHA supports, or loads the
  trained one from `lora_model_dir` (`axolotl merge-lora`, inference, resumed runs).
- A KHA checkpoint as `base_model` (`register`): importing kha_hf registers `model_type: kha` with transformers'
  Auto classes before Axolotl reads the config; the checkpoint gets `kha train`'s one-line checks first; and
  Axolotl's Triton LoRA kernels for q/k/v and o, which Axolotl switches on by itself for `adapter: lora`, are
  switched off: they rewrite the attention class's source, and a KHA attention applies its knocks between the
  projections and the attention kernel, which that rewrite does not know (Axolotl: "could not import attention
  class for model_type: kha").
- Merging (`axolotl merge-lora`): knock adapters merge through PEFT's `merge_and_unload` (Axolotl's `legacy`
  method); the plugin chooses it, as the shard-by-shard method knows LoRA's tensors only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from axolotl.integrations.base import AdapterCapabilities, BasePlugin
from axolotl.utils.logging import get_logger

from .args import KNOCK_ADAPTER, KnockArgs, base_config_fields

LOG = get_logger(__name__)
ATTENTION_KERNELS = ("lora_qkv_kernel", "lora_o_kernel")  # the Triton kernels that rewrite the attention class


def _get(cfg: Any, key: str) -> Any:
    return cfg.get(key) if hasattr(cfg, "get") else getattr(cfg, key, None)


def knock_args(cfg: Any) -> KnockArgs:
    """The `knock:` block of CFG as `KnockArgs` (defaults where absent)."""
    block = _get(cfg, "knock")
    if isinstance(block, KnockArgs):
        return block
    if block is None:
        return KnockArgs()
    return KnockArgs(**(block.to_dict() if hasattr(block, "to_dict") else dict(block)))


def check_kha_base(folder: Path) -> None:
    """A KHA checkpoint as base_model, opened and checked once as kha train opens it (a config that does not
    describe the weights, a task head trained as a causal LM...), exactly the knock tensors its config describes, and
    finite knock values (a NaN knock trained to a NaN model that Axolotl logged as loss 0), each refused in one line
    before Axolotl loads anything."""
    from ...checkpoint.knock_reader import open_kha_checkpoint

    open_kha_checkpoint(folder, causal_lm=True).read_knocks()


class KHAPlugin(BasePlugin):
    """Knock adapters (`adapter: knock`, a `knock:` block) and KHA checkpoints as `base_model` in Axolotl."""

    def get_input_args(self) -> str:
        return "kha_hf.integrations.axolotl.args.KHAArgs"

    def get_adapter_capabilities(self) -> list[AdapterCapabilities]:
        # not lora_like: Axolotl's LoRA loader and ReLoRA restarts know LoRA's tensors only
        return [AdapterCapabilities(name=KNOCK_ADAPTER)]

    def register(self, cfg: dict) -> None:
        import kha_hf  # noqa: F401  (registers KHAConfig / KHAForCausalLM with the Auto classes, KNOCK with peft)

        if not hasattr(cfg, "get"):
            return
        if cfg.get("adapter") == KNOCK_ADAPTER:
            self._choose_merge_method(cfg)
            if cfg.get("merge_lora"):
                self._refuse_unmergeable(cfg)
        try:  # config.json as read, nothing built: a config claiming 10^9 layers costs nothing here
            read = base_config_fields(dict(cfg))
        except ValueError:
            return  # no model config: KHAArgs' validation refuses it (adapter: knock), else Axolotl's loading
        if read is None or read[0].get("model_type") != "kha":
            return
        # both folders: base_model_config may name a sound config beside the weights Axolotl loads from base_model
        names = (cfg.get("base_model_config"), cfg.get("base_model"))
        for folder in dict.fromkeys(Path(str(name)) for name in names if name):
            if folder.is_dir():
                check_kha_base(folder)
        if cfg.get("adapter") in ("lora", "qlora"):
            self._attention_kernels_off(cfg)

    @staticmethod
    def _refuse_unmergeable(cfg: Any) -> None:
        """`axolotl merge-lora` of an MLP knock adapter: one line before any model loads (PEFT's merge would refuse
        it only after loading the base and the adapter)."""
        folder = Path(str(cfg.get("lora_model_dir") or cfg.get("output_dir") or ""))
        if not (folder / "adapter_config.json").is_file():
            return  # Axolotl reports a missing adapter itself
        from peft import PeftConfig

        saved = PeftConfig.from_pretrained(str(folder))
        mlp = [target for target, kind in getattr(saved, "knock_types", {}).items() if kind == "mlp"]
        if mlp:
            raise ValueError(
                f"the knock adapter in {folder} has MLP knocks ({', '.join(mlp)}), which are non-linear and cannot be "
                "merged into the projections: make a KHA model of base + adapter instead (kha convert BASE DST "
                "--adapter DIR, or kha_hf.peft.to_kha_model), which kha serve and vLLM serve"
            )

    @staticmethod
    def _choose_merge_method(cfg: Any) -> None:
        method = cfg.get("merge_method")
        if method is None:
            cfg["merge_method"] = "legacy"  # PEFT's merge_and_unload, which knock adapters implement
        elif method != "legacy" and cfg.get("merge_lora"):
            raise ValueError(
                f"merge_method {method!r} merges LoRA tensors only; a knock adapter merges with merge_method: legacy "
                "(PEFT's merge_and_unload), which the plugin picks when merge_method is unset"
            )

    @staticmethod
    def _attention_kernels_off(cfg: Any) -> None:
        asked = [key for key in ATTENTION_KERNELS if cfg.get(key)]
        if asked:
            raise ValueError(
                f"{' and '.join(asked)} cannot run on a KHA model: its attention applies the knocks between the "
                "q/k/v projections and the attention kernel, which Axolotl's kernel rewrite does not know; set "
                f"{' and '.join(f'{key}: false' for key in asked)} (lora_mlp_kernel and lora_embedding_kernel work)"
            )
        for key in ATTENTION_KERNELS:
            cfg[key] = False
        LOG.info("kha-hf: lora_qkv_kernel and lora_o_kernel off for this KHA model (knocks sit inside the attention)")

    def load_adapter(self, model: Any, cfg: Any, inference: bool = False, config_only: bool = False) -> Any:
        if _get(cfg, "adapter") != KNOCK_ADAPTER:
            return None
        from peft import PeftConfig, PeftModel, get_peft_model

        from ...peft import KNOCK_PEFT_TYPE, KnockConfig

        config = KnockConfig(**knock_args(cfg).knock_config_kwargs())
        if config_only:
            return None, config
        adapter_dir = _get(cfg, "lora_model_dir")
        if adapter_dir:
            # a trained adapter (merge-lora, inference, a resumed run): load it, never build a fresh one, which
            # would "merge" identity knocks into a model equal to the base
            LOG.info(f"kha-hf: loading the knock adapter from {adapter_dir}")
            saved = PeftConfig.from_pretrained(str(adapter_dir))
            held = getattr(saved.peft_type, "value", saved.peft_type)
            if held != KNOCK_PEFT_TYPE:
                raise ValueError(
                    f"adapter: knock, but lora_model_dir {adapter_dir} holds a {held} adapter: set adapter to what it "
                    "holds, or point lora_model_dir at a knock adapter"
                )
            model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=not inference)
            asked, config = config, model.peft_config["default"]
            if _get(cfg, "knock") is not None and (asked.knock_types, asked.knock_layers) != (
                config.knock_types,
                config.knock_layers,
            ):  # a resumed run whose YAML was edited: the saved adapter wins, and the user should know
                LOG.warning(
                    f"kha-hf: the knock: block asks for {asked.knock_types} on layers {asked.knock_layers or 'all'}, "
                    f"the adapter in {adapter_dir} holds {config.knock_types} on {config.knock_layers or 'all'}: "
                    "using the saved adapter"
                )
        else:
            model = get_peft_model(model, config)  # refuses a modules_to_save naming no module, or a knocked one
        if not inference:
            model.print_trainable_parameters()
        return model, config
