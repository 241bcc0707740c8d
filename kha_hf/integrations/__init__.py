"""kha-hf inside other training frameworks: `axolotl`, an Axolotl plugin
(`plugins: [kha_hf.integrations.axolotl.KHAPlugin]`).

Each subpackage imports its framework; importing `kha_hf` imports none of them."""
