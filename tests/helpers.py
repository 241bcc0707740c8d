"""Tiny random configs of every supported base family, the one comparison helper every test uses, fresh processes."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA everywhere
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


# the exhaustive tier (tests/conftest.py): matrix points beyond CI's representatives run only with KHA_EXHAUSTIVE=1
EXHAUSTIVE = os.environ.get("KHA_EXHAUSTIVE") == "1"
# Families whose per-family tests (transformers' common tests, vLLM's plugin) are that tier: each is a base that a
# representative runs in CI, through the same KHA classes. Mistral, Ministral, Seed-OSS, GLM-4, Granite and SmolLM3
# are Llama-shaped decoders (Llama; Qwen2 and Qwen3 for biases and q/k norms); Mixtral is Qwen3-MoE's routed experts
# without a shared one (Qwen2-MoE has it); HunYuan's q/k norms are Qwen3's; OLMo 3 is OLMo 2 with sliding layers
# (Gemma 2 and Gemma 3 have those).
EXHAUSTIVE_FAMILIES = frozenset(
    {"mistral", "ministral", "seed_oss", "glm4", "granite", "smollm3", "mixtral", "hunyuan_v1_dense", "olmo3"}
)


def family_params(families) -> list:
    """FAMILIES as pytest parameters, those of EXHAUSTIVE_FAMILIES marked for the exhaustive tier."""
    import pytest

    return [pytest.param(f, marks=[pytest.mark.exhaustive] if f in EXHAUSTIVE_FAMILIES else []) for f in families]


def tiny_configs() -> dict[str, PreTrainedConfig]:
    """One tiny config per family, with each family's peculiarity switched on."""
    return {
        "llama": LlamaConfig(**COMMON),
        "llama_bias": LlamaConfig(**COMMON, attention_bias=True),
        "mistral": MistralConfig(**COMMON, sliding_window=5),
        "qwen2": Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1),
        "qwen3": Qwen3Config(
            **{**COMMON, "num_hidden_layers": 3},
            head_dim=16,
            attention_bias=True,  # biases before the q/k norm: a knock must see them
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=2,
        ),
        "qwen3_moe": Qwen3MoeConfig(
            **COMMON,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            attention_bias=True,
        ),
        "mixtral": MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=5),
    }


FAMILIES = sorted(tiny_configs())  # the six core families (seven variants): the tests of every part run on them

SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
# Every other family of the table (kha_hf/modeling/families.py), each with its peculiarity switched on.
OTHER_FAMILIES: dict[str, dict] = {
    "ministral": dict(head_dim=16, sliding_window=5, layer_types=SLIDING),
    "qwen2_moe": dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
    ),
    "qwen3_next": dict(  # hybrid: layers 0 and 2 are linear attention (no knocks), layer 1 softmax attention
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    "gemma2": dict(  # soft-capping of attention and logits, pre-attention scalar, sliding window
        head_dim=16,
        attn_logit_softcapping=30.0,
        final_logit_softcapping=20.0,
        query_pre_attn_scalar=24,
        sliding_window=5,
    ),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=5, layer_types=SLIDING),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),  # fused qkv_proj
    "olmo2": dict(pad_token_id=0, eos_token_id=2),  # q/k RMSNorm over the full width, TP colwise_gather_output
    "olmo3": dict(pad_token_id=0, eos_token_id=2, sliding_window=5, layer_types=SLIDING),
    "gpt_oss": dict(  # attention sinks, biases, MoE
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=5,
        layer_types=SLIDING,
        attention_bias=True,
    ),
    "deepseek_v3": dict(  # MLA with q-LoRA: knocks on q_b_proj's and kv_b_proj's per-head segments
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        num_key_value_heads=4,
    ),
    "smollm3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, no_rope_layers=[1, 0, 1]),  # NoPE layer 1
    "granite": dict(  # attention multiplier instead of 1/sqrt(d), residual and logit scaling
        attention_multiplier=0.3,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        logits_scaling=4.0,
        attention_bias=True,
    ),
    "glm4": dict(pad_token_id=0, eos_token_id=2, head_dim=16, partial_rotary_factor=0.5, attention_bias=True),
    "cohere2": dict(
        pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=5, layer_types=SLIDING, logit_scale=0.5
    ),  # RoPE only in sliding layers
    "exaone4": dict(head_dim=16, sliding_window=5, layer_types=SLIDING),  # q/k norm after the head split, NoPE
    "seed_oss": dict(head_dim=16, attention_bias=True),
    "hunyuan_v1_dense": dict(head_dim=16),  # q/k norm after RoPE
}
ALL_FAMILIES = FAMILIES + sorted(OTHER_FAMILIES)
MLA_FAMILIES = {"deepseek_v3"}
# Presets that together put every knock type on every target it can take (each other preset is a per-target cut of
# these: tests/modeling/test_knock_math.py checks it); per-family tests loop over these rather than all presets.
KIND_PRESETS = ("mlp_v", "linear_qkv", "mlp_v_linear_qk", "mlp_qkv", "gate_v", "mlp_q")


def tiny_config(name: str, **overrides) -> PreTrainedConfig:
    """A fresh tiny config of family (or variant) NAME, one of ALL_FAMILIES, with OVERRIDES set."""
    if name in OTHER_FAMILIES:
        config = CONFIG_MAPPING[name](**{**COMMON, **OTHER_FAMILIES[name]})
    else:
        config = copy.deepcopy(tiny_configs()[name])
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def save_tiny_checkpoint(folder, family: str = "llama", knock: str | None = None, seed: int = 0, **overrides):
    """A tiny random checkpoint of FAMILY with the tiny tokenizer (vocabulary 300, so every token id fits), stock
    or, with KNOCK, converted in memory to KHA with that preset; returns the model saved."""
    from kha_hf import KHAForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **{"vocab_size": 300, **overrides}))
    if knock is not None:
        model = KHAForCausalLM.from_base(model, knock=knock)
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return model


def tiny_base_model(name: str, attn_implementation: str = "eager", seed: int = 0, auto=None, **overrides):
    """A random stock transformers model of family `name`, in eval mode: a causal LM, or the class AUTO builds
    (`AutoModelForSequenceClassification`, ...); OVERRIDES set config fields (num_labels=...).

    Biases are random and non-zero, and q/k norm weights are not 1: with zero biases and unit norms, a knock applied
    before the bias add, or a fold that ignores the bias, computes the same numbers and no test would notice.
    """
    torch.manual_seed(seed)
    config = tiny_config(name, **overrides)
    model = (auto or AutoModelForCausalLM).from_config(config, attn_implementation=attn_implementation).eval()
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif param_name.endswith(
                ("q_norm.weight", "k_norm.weight", "query_layernorm.weight", "key_layernorm.weight")
            ):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
    return model


def randomize_knocks(model, scale: float = 0.3, seed: int = 1) -> None:
    """Move every knock weight away from its init, so knocks visibly change the outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_knock." in name:
                param.add_(scale * torch.randn(param.shape, generator=gen).to(param.dtype))


FLOAT_PATH_ULPS = 16


def assert_float_paths_agree(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Two float paths over the same weights agree to FLOAT_PATH_ULPS epsilons of the values' scale (the largest
    |EXPECTED|). For a batch of 4 against a batch of 1, or a reloaded copy whose tensors sit at other addresses: GEMM
    kernels block and vectorise by batch size, alignment and CPU (AVX2 on an AMD EPYC, AVX-512 on an Intel Xeon), so
    the same sums are added in another order (2.4e-6 on logits of 12 seen on AMD: 2 ulps). A wrong adapter on a row
    or a dropped knock moves logits by 1e-3 and more. Where the arithmetic is the same (one path run twice, identity
    knocks) tests keep `torch.equal`."""
    scale = expected.detach().abs().max().item()
    atol = FLOAT_PATH_ULPS * torch.finfo(expected.dtype).eps * max(scale, 1e-30)
    assert_close(actual, expected, atol=atol, what=what)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 0.0, what: str = "") -> None:
    """Exact (atol=0: torch.equal) or within atol; the failure message reports max and mean |difference|."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual.double() - expected.double()).abs()
    ok = torch.equal(actual, expected) if atol == 0 else bool(diff.max() <= atol)
    assert ok, f"{what}: max |diff| {diff.max().item():.3e}, mean {diff.mean().item():.3e} (atol {atol})"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def save_tiny_tokenizer(folder) -> None:
    """A small byte-level BPE tokenizer saved into FOLDER (about 260 ids: more than the tiny models' 128)."""
    from kha_hf.training.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog " * 20], vocab_size=128).save_pretrained(folder)


def run_python(
    script: str, tmp_path: Path, without_kha_hf: bool = True, env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess:
    """SCRIPT in a fresh interpreter, as a user without kha_hf would run it.

    kha_hf is made unimportable (even from an editable install) unless `without_kha_hf=False`; the process gets
    its own HF_HOME under TMP_PATH (a fresh remote-code cache), the offline hub (unless ENV says otherwise: a
    None value removes a variable), and a closed stdin, so a transformers prompt reads EOF instead of hanging.
    """
    guard = 'import sys\nsys.modules["kha_hf"] = None  # unimportable, even from an editable install\n'
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", **(env or {})}
    env.pop("HF_MODULES_CACHE", None)
    env = {key: value for key, value in env.items() if value is not None}
    return subprocess.run(
        [sys.executable, "-P", "-c", (guard if without_kha_hf else "") + script],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )


def side_environment(what: str, venv: str, module: str, python_var: str, require_var: str, install: str) -> Path:
    """The python of a side environment (vLLM's, llama.cpp's: they pin other packages than ours) at ROOT/VENV or
    $PYTHON_VAR, after checking that MODULE imports there. Without it the test skips naming the command that makes it
    (`bash scripts/install.sh INSTALL`); with $REQUIRE_VAR=1 (CI) it fails instead."""
    root = Path(__file__).resolve().parents[1]
    configured = os.environ.get(python_var)
    python = Path(configured) if configured else root / venv / "bin" / "python"
    problem = None
    if not python.is_file():
        problem = f"no {what} environment ({venv} or ${python_var})"
    else:
        check = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
        if check.returncode != 0:
            problem = f"{module} does not import in {python}: {check.stderr.strip().splitlines()[-1:]}"
    if problem:
        import pytest

        message = f"{problem}; create it with: bash scripts/install.sh {install}"
        if os.environ.get(require_var) == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


def _cache_key() -> str:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


# The KV cache's name in model outputs and forward arguments: `cache` from transformers 5.24 on, `past_key_values`
# before (5.16.1 to 5.23, the low end of kha-hf's range)
CACHE_KEY = _cache_key()


@contextlib.contextmanager
def run_at_work_in(folder):
    """A run at work in FOLDER, as kha's atomic output marks one: it holds the folder's lock (flock) meanwhile."""
    import fcntl

    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield folder
    finally:
        os.close(fd)


def module_folder(request, tmp_path_factory, name: str) -> Path:
    """A new folder under pytest's base folder, removed when the fixture asking (REQUEST) is torn down. pytest keeps
    what tmp_path_factory makes until the session ends, and the real checkpoints module fixtures write (0.5 to 1.1 GB
    each) added up to about 11 GB: a CI run ran out of disk. Fixtures that write real checkpoints use this."""
    folder = tmp_path_factory.mktemp(name)
    request.addfinalizer(lambda: shutil.rmtree(folder, ignore_errors=True))
    return folder


def made_once(tmp_path_factory, name: str, make) -> Path:
    """The folder NAME, made by MAKE(folder) once per test run and shared by pytest-xdist's workers, which would each
    make their own (a real checkpoint is 0.5 to 1.1 GB and a minute's work). The workers' base folders share a
    parent: a file lock there lets the first worker make it while the others wait. A folder a failed MAKE left is
    made anew by the next worker that asks."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    folder, made = root / name, root / f"{name}.made"
    with FileLock(str(root / f"{name}.lock")):
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            made.touch()
    return folder
