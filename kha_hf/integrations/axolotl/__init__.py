"""kha-hf's Axolotl plugin: knock adapters as `adapter: knock`, and KHA checkpoints as `base_model`.

```yaml
plugins: [kha_hf.integrations.axolotl.KHAPlugin]
adapter: knock
knock:
  preset: linear_qkv
```

`args.py` holds the YAML keys (`KHAArgs`, checked by Axolotl's own validation before any model loads), `plugin.py`
the hooks (`KHAPlugin`), `cli.py` the `axolotl kha-convert` / `axolotl kha-fold` commands. Written against
Axolotl 0.19's plugin API (docs/guides/axolotl.md).
"""

from .args import KHAArgs, KnockArgs
from .plugin import KHAPlugin

__all__ = ["KHAArgs", "KHAPlugin", "KnockArgs"]
