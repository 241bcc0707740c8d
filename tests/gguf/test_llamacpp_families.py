"""Which of kha's families the installed llama.cpp knows, and tiny exports of the exportable ones run in it.

Catches: an export llama.cpp refuses (a missing key or tensor, a wrong shape: its loader checks every tensor against
the architecture), a graph difference the transformers loader cannot see (Llama's q/k permutation with biases, which
transformers' GGUF loader does not read; Gemma 3's sliding-window pattern and local RoPE base; Phi-3's fused
projections), and a llama.cpp build that lost an architecture.
"""

from __future__ import annotations

import pytest
import torch

from kha_hf.cli import main
from tests.gguf.conftest import EXPORTABLE, LLAMA_BIAS, run_llamacpp, tiny_kha

# llama.cpp's architecture for each kha family, as llama.cpp's convert_hf_to_gguf.py (llama-cpp-python 0.3.36)
# registers the family's transformers class; None: that converter has no entry for it.
LLAMA_CPP_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "qwen2_moe": "qwen2moe",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "qwen3_next": "qwen3next",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "olmo3": "olmo2",
    "gpt_oss": "gpt-oss",
    "deepseek_v3": "deepseek2",
    "smollm3": "smollm3",
    "granite": "granite",
    "glm4": "glm4",
    "cohere2": "cohere2",
    "exaone4": "exaone4",
    "seed_oss": "seed_oss",
    "hunyuan_v1_dense": "hunyuan-dense",
    "ministral": None,  # MinistralForCausalLM: not registered there
}


def greedy(model, ids: list[int], n: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, model(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x[0, len(ids) :].tolist()


@pytest.mark.parametrize("family", [*sorted(EXPORTABLE), "llama_bias"])
def test_llama_cpp_runs_tiny_folded_exports_token_for_token(family, llamacpp, tmp_path):
    name, overrides = ("llama", LLAMA_BIAS) if family == "llama_bias" else (family, {})
    model, base = tiny_kha(tmp_path / "kha", name, **overrides)
    assert main(["fold", str(tmp_path / "kha"), str(tmp_path / "m.gguf"), "--outtype", "f32"]) == 0
    prompts = [torch.randint(3, 300, (12,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    expected = [greedy(model, p, 8) for p in prompts]
    assert expected != [greedy(base, p, 8) for p in prompts], "the knocks change no token: the test proves nothing"
    got = run_llamacpp(
        llamacpp, {"kind": "generate", "model": str(tmp_path / "m.gguf"), "prompts": prompts, "n": 8}, tmp_path
    )
    assert got["tokens"] == expected


def test_which_families_the_installed_llama_cpp_knows(llamacpp, tmp_path, capsys):
    """Every exportable family's tiny export loads; for the others a file naming only the architecture tells a
    known architecture (llama.cpp then asks for its hyper-parameters) from an unknown one (llama.cpp's error)."""
    import gguf

    files = {}
    for i, family in enumerate(sorted(EXPORTABLE)):
        # neutral folder names: the file's general.name is the folder's, and llama.cpp gives a name containing "phi3"
        # Phi-3's special tokens (it looks up "</s>", "<s>", "<unk>", which the tiny tokenizer lacks)
        tiny_kha(tmp_path / f"m{i}", family)
        assert main(["fold", str(tmp_path / f"m{i}"), str(tmp_path / f"m{i}.gguf")]) == 0
        files[family] = tmp_path / f"m{i}.gguf"
    probes = {}
    for family, arch in LLAMA_CPP_ARCH.items():
        if family in EXPORTABLE or arch is None:
            continue
        path = tmp_path / f"probe-{family}.gguf"
        writer = gguf.GGUFWriter(path, arch)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        probes[family] = path
    probes["(an unknown architecture)"] = tmp_path / "probe-unknown.gguf"
    writer = gguf.GGUFWriter(probes["(an unknown architecture)"], "kha-no-such-arch")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    paths = [str(p) for p in [*files.values(), *probes.values()]]
    result = run_llamacpp(llamacpp, {"kind": "load", "models": paths}, tmp_path)["models"]
    report = []
    for family, path in files.items():
        outcome = result[str(path)]
        assert outcome["loaded"], f"llama.cpp refuses the {family} export: {outcome['errors']}"
        report.append(f"{family}: exported by kha, loads in llama.cpp ({LLAMA_CPP_ARCH[family]})")
    unknown = []
    for family, path in probes.items():
        errors = " | ".join(result[str(path)]["errors"])
        assert not result[str(path)]["loaded"]
        if "unknown model architecture" in errors:
            unknown.append(family)
            report.append(f"{family}: llama.cpp does not know it: {errors}")
        else:
            report.append(f"{family}: llama.cpp knows {LLAMA_CPP_ARCH.get(family)} (not exported by kha)")
    with capsys.disabled():
        print("\n" + "\n".join(report))
    assert unknown == ["(an unknown architecture)"], f"the installed llama.cpp lacks {unknown}"
