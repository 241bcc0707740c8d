"""kha-hf-vllm: KHA checkpoints in vLLM with no extra flags. The code is kha-hf's, copied at build time:
`kha_hf_vllm.modeling` (= kha_hf/modeling) and `kha_hf_vllm.vllm_plugin` (= kha_hf/vllm_plugin, the entry point)."""
