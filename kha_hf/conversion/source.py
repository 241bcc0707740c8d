"""Where a checkpoint comes from: a local folder, a Hub id, or a GGUF file (dequantised to safetensors)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint.loading import check_model_ref, describe_error, find_gguf
from ..common.errors import KHAError

HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "LICENSE*"]
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")


@dataclass(frozen=True)
class Source:
    folder: Path  # a folder with config.json and safetensors weights
    name: str  # for messages and titles: the Hub id or the folder/file name
    gguf_file: Path | None = None
    hub_repo: str | None = None  # the Hub id when SRC was one (the model card's base_model)


def download_from_hub(repo_id: str, revision: str | None = None, token: str | None = None) -> Path:
    """Fetch config, tokenizer and safetensors files of a Hub model into the local HF cache."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, token=token, allow_patterns=HUB_PATTERNS))
    except Exception as err:  # offline, unknown repo, gated, network: all end the same way for the user
        raise KHAError(f"cannot fetch {repo_id!r} from the Hugging Face Hub: {describe_error(err)}") from err


def resolve_source(src: str | Path, revision: str | None = None, token: str | None = None) -> Source:
    """Classify SRC; errors name what was expected."""
    path = Path(src).expanduser()
    if path.exists():
        gguf = find_gguf(path)
        if gguf is not None:
            return Source(folder=gguf.parent, name=gguf.name, gguf_file=gguf)
        if path.is_file():
            raise KHAError(f"{path} is a file; SRC must be a checkpoint folder, a .gguf file or a Hub id")
        check_local_folder(path)
        return Source(folder=path, name=path.resolve().name)
    check_model_ref(src, "SRC")  # a missing local path is reported as such, not as a Hub failure
    return Source(folder=download_from_hub(str(src), revision, token), name=str(src), hub_repo=str(src))


def check_local_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise KHAError(f"{folder} has no config.json: not a transformers checkpoint folder")
    has_safetensors = any(folder.glob("*.safetensors"))
    pickles = [name for name in PICKLE_WEIGHTS if (folder / name).exists()] + [p.name for p in folder.glob("*.bin")]
    if pickles and not has_safetensors:
        raise KHAError(
            f"{folder} holds pickle weights ({pickles[0]}), which kha does not read: pickles can run code and "
            "cannot be streamed. Re-save as safetensors first: "
            "AutoModelForCausalLM.from_pretrained(folder).save_pretrained(new_folder)"
        )


def dequantize_gguf(gguf_file: Path, out: Path) -> None:
    """Load a GGUF file through transformers (dequantised, float32) and save it as a safetensors checkpoint.

    This is the one conversion path that holds the model in memory: GGUF tensors are quantised blocks that must be
    decoded whole. transformers refuses to save a model it loaded from GGUF, so the weights move into a model
    rebuilt from the config without `quantization_config`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..checkpoint.gguf_header import check_gguf_header

    check_gguf_header(gguf_file)  # its numbers against its tensors, before transformers allocates from them
    folder, name = gguf_file.parent, gguf_file.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as err:
        raise KHAError(f"cannot read GGUF file {gguf_file}: {err}") from err
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_model_name_or_path", None)  # the GGUF's display name, not a path or a Hub id
    model_type = config_dict.pop("model_type")
    clean_config = AutoConfig.for_model(model_type, **config_dict)
    with torch.device("meta"):
        clean = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
    clean.load_state_dict(loaded.state_dict(), assign=True)
    for module_name, module in clean.named_modules():  # non-persistent buffers (rotary inv_freq)
        for buffer_name, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta:
                source = loaded.get_submodule(module_name).get_buffer(buffer_name)
                module.register_buffer(buffer_name, source, persistent=False)
    clean.tie_weights()
    clean.generation_config = loaded.generation_config
    clean.save_pretrained(out)
    tokenizer.save_pretrained(out)
