"""The README.md (model card) written next to converted checkpoints, with Hub metadata."""

from __future__ import annotations

from ..modeling.configuration_kha import KHAConfig

CITATION = """@article{zhou2025knocking,
  title   = {Knocking-Heads Attention},
  author  = {Zhou, Zhanchao and Chen, Xiaodong and Chen, Haoxing and Lan, Zhenzhong and Li, Jianguo},
  journal = {arXiv preprint arXiv:2510.23052},
  year    = {2025}
}"""


def model_card(config: KHAConfig, base_model: str, note: str = "") -> str:
    knocks = ", ".join(f"{t.upper()}: {getattr(config, f'knock_{t}')}" for t in ("q", "k", "v"))
    layers = "all" if config.knock_layers is None else ", ".join(map(str, config.knock_layers))
    return f"""---
base_model: {base_model}
library_name: transformers
pipeline_tag: text-generation
tags:
- kha
- knocking-heads-attention
- {config.base_model_type}
- kha-hf
---

# {base_model} with Knocking-Heads Attention

This checkpoint is [{base_model}](https://huggingface.co/{base_model}) upgraded to Knocking-Heads Attention
([arXiv 2510.23052](https://arxiv.org/abs/2510.23052)) by [kha-hf](https://github.com/kha-hf/kha-hf).
{note}
| setting | value |
|---|---|
| base family | `{config.base_model_type}` |
| knock preset | `{config.knock_preset or "custom"}` |
| knocks | {knocks} |
| knocked layers | {layers} |
| head dim | {config.kha_head_dim} |

The knocks start at the identity, so before any training this model computes exactly what the base model computes.

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("PATH_OR_REPO", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("PATH_OR_REPO")
```

## Citation

```bibtex
{CITATION}
```
"""
