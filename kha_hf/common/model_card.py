"""Model cards (README.md) with true Hub metadata, written next to converted, folded and trained checkpoints.

`base_model` is a Hub id or absent, never a local folder or a .gguf file name: it comes from the source's Hub id, the
source card's own `base_model`, or a GGUF file's `general.*` source metadata. `license`, `language`, `datasets` and
`pipeline_tag` are carried from the source card or the GGUF metadata, and the source card's body is kept below our
section. Cards are read and written with huggingface_hub's `ModelCard`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

CITATION = """@article{zhou2025knocking,
  title   = {Knocking-Heads Attention},
  author  = {Zhou, Zhanchao and Chen, Xiaodong and Chen, Haoxing and Lan, Zhenzhong and Li, Jianguo},
  journal = {arXiv preprint arXiv:2510.23052},
  year    = {2025}
}"""
KHA_TAGS = ["kha", "knocking-heads-attention", "kha-hf"]
CARRIED = ("license", "language", "datasets", "pipeline_tag")
HUB_URL = re.compile(r"^https?://huggingface\.co/(?:models/)?([A-Za-z0-9][\w.-]*/[\w.-]+?)/?$")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass
class SourceCard:
    """What a converted checkpoint inherits from its source: Hub metadata and the source card's body."""

    base_model: str | None = None
    metadata: dict = field(default_factory=dict)  # license, language, datasets, pipeline_tag
    body: str = ""


def hub_id(text) -> str | None:
    """A Hub id from 'owner/name' or a huggingface.co URL, else None (local paths and file names are not ids)."""
    if not isinstance(text, str):
        return None
    text = text.strip()
    if match := HUB_URL.match(text):
        return match.group(1)
    if HUB_ID.match(text) and not Path(text).expanduser().exists() and not text.endswith(".gguf"):
        return text
    return None


def read_source_card(folder: Path | None, hub_repo: str | None = None, gguf_file: Path | None = None) -> SourceCard:
    """Metadata and body of the source's README.md and/or GGUF header; `hub_repo` when SRC was a Hub id."""
    source = SourceCard(base_model=hub_id(hub_repo) if hub_repo else None)
    if gguf_file is not None:
        _read_gguf(gguf_file, source)
    readme = folder / "README.md" if folder is not None else None
    if readme is not None and readme.is_file():
        from huggingface_hub import ModelCard

        try:
            card = ModelCard.load(readme)
        except Exception:  # a README without valid front matter: keep its text, no metadata
            source.body = readme.read_text(encoding="utf-8", errors="replace")
            return source
        data = card.data.to_dict()
        for key in CARRIED:
            if data.get(key) is not None:
                source.metadata.setdefault(key, data[key])
        if source.base_model is None:
            bases = data.get("base_model")
            bases = bases if isinstance(bases, list) else [bases]
            source.base_model = next((hub_id(b) for b in bases if hub_id(b)), None)
        source.body = card.text.strip()
    return source


def _read_gguf(path: Path, source: SourceCard) -> None:
    """license, languages and source repo from a GGUF header (`general.*` keys of the GGUF spec)."""
    try:
        from gguf import GGUFReader

        fields = GGUFReader(str(path)).fields
    except Exception:  # gguf missing or unreadable header: no metadata, the conversion itself reports errors
        return

    def value(key):
        try:
            return fields[key].contents() if key in fields else None
        except Exception:
            return None

    if value("general.license"):
        source.metadata["license"] = value("general.license")
    if value("general.languages"):
        source.metadata["language"] = list(value("general.languages"))
    if datasets := [d for i in range(8) if (d := hub_id(value(f"general.datasets.{i}.repo_url")))]:
        source.metadata["datasets"] = datasets
    repos = ("general.source.huggingface.repository", "general.source.repo_url", "general.source.url")
    found = (hub_id(value(key)) for key in (*repos, "general.base_model.0.repo_url"))
    source.base_model = next(filter(None, found), source.base_model)


def kha_card(config, source: SourceCard, title: str, description: str) -> str:
    """README.md text: Hub front matter, our section, then the source card's body."""
    from huggingface_hub import ModelCardData

    data = ModelCardData(
        base_model=source.base_model,
        library_name="transformers",
        pipeline_tag=source.metadata.get("pipeline_tag", "text-generation"),
        license=source.metadata.get("license"),
        language=source.metadata.get("language"),
        datasets=source.metadata.get("datasets"),
        tags=[*KHA_TAGS, config.base_model_type],
    )
    knocks = ", ".join(f"{t.upper()}: {getattr(config, f'knock_{t}', 'none')}" for t in ("q", "k", "v"))
    layers = "all" if getattr(config, "knock_layers", None) is None else ", ".join(map(str, config.knock_layers))
    base = f"[{source.base_model}](https://huggingface.co/{source.base_model})" if source.base_model else "its base"
    text = f"""---
{data.to_yaml()}
---

# {title}

{description.format(base=base)}

| setting | value |
|---|---|
| base family | `{config.base_model_type}` |
| knock preset | `{getattr(config, "knock_preset", None) or "custom"}` |
| knocks | {knocks} |
| knocked layers | {layers} |

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO", trust_remote_code=True)
```

`trust_remote_code=True` runs the model code in this repository (`configuration_kha.py`, `modeling_kha.py`,
`knocks.py`); the tokenizer needs it too because transformers reads the model's config before the tokenizer's.
With `pip install kha-hf` and `import kha_hf`, neither call needs it.

Knocking-Heads Attention: [arXiv 2510.23052](https://arxiv.org/abs/2510.23052), implemented by
[kha-hf](https://github.com/kha-hf/kha-hf).

```bibtex
{CITATION}
```
"""
    if source.body:
        text += f"\n## The base model's card\n\n{source.body}\n"
    return text


def carry_training_card(source_dir: Path, output_dir: Path, note: str) -> None:
    """The trained model's card: the source checkpoint's card (Hub metadata, knocks table) plus a training note."""
    from huggingface_hub import ModelCard

    source = Path(source_dir) / "README.md"
    target = Path(output_dir) / "README.md"
    if not source.is_file():
        return  # save_pretrained already wrote a short tagged card
    try:
        card = ModelCard.load(source)
    except Exception:  # a README without valid front matter: keep the tagged card save_pretrained wrote
        return
    card.text = card.text.rstrip() + f"\n\n## Training\n\n{note}\n"
    card.data.tags = list(dict.fromkeys([*(card.data.tags or []), *KHA_TAGS]))
    card.save(target)
