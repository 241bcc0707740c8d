"""Runs inside the vLLM environment (scripts/install.sh vllm): vLLM's Python API; kha_hf only through its plugin.

    python vllm_worker.py JOB.json RESULT.json

JOB: {"mode": "generate" | "multimodal" | "throughput" | "remote_code", ...}; the result is written as JSON. KHA
checkpoints load the way any vLLM user loads them: `LLM(model=DIR, model_impl="transformers",
trust_remote_code=True)` without kha-hf's plugin, or, with it, `LLM(model=DIR)` (a model entry with "impl": null,
"trust_remote_code": false). kha-hf is installed in that environment; unless VLLM_PLUGINS names its plugin (kha),
this process cannot import kha_hf at all, so the remote-code route runs as for a user without kha-hf.
Used by tests/vllm/ and benchmarks/vllm_throughput.py.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time


def _llm(
    path: str,
    impl: str | None,
    max_model_len: int,
    eager: bool = True,
    trust_remote_code: bool = True,
    tensor_parallel_size: int = 1,
    lora_rank: int | None = None,
    images: int | None = None,
):
    """vLLM's LLM on PATH, float32; IMPL None leaves `model_impl` at vLLM's default, as a user who passes nothing;
    LORA_RANK enables LoRA adapters up to that rank; IMAGES: at most that many images per prompt."""
    from vllm import LLM

    lora = {} if lora_rank is None else {"enable_lora": True, "max_lora_rank": lora_rank, "max_loras": 1}
    mm = {} if images is None else {"limit_mm_per_prompt": {"image": images}}
    return LLM(
        **lora,
        **mm,
        model=path,
        **({} if impl is None else {"model_impl": impl}),
        trust_remote_code=trust_remote_code,
        dtype="float32",
        max_model_len=max_model_len,
        enforce_eager=eager,
        seed=0,
        tensor_parallel_size=tensor_parallel_size,
    )


def _release(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(job: dict) -> dict:
    """Greedy token ids per model and prompt, with the log-probability of each (float32 log-softmax of the raw
    logits, vLLM's default logprobs mode): {"path": {"tokens": [[ids], ...], "logprobs": [[float, ...], ...]}}, or
    {"path": {"error": "..."}} for a model vLLM could not load."""
    from vllm import SamplingParams, TokensPrompt

    # logprobs=0: each step's dict holds only the chosen token
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True, logprobs=0)
    results = {}
    for model in job["models"]:
        try:
            llm = _llm(
                model["path"],
                model.get("impl", "transformers"),
                job["max_model_len"],
                trust_remote_code=model.get("trust_remote_code", True),
                tensor_parallel_size=model.get("tensor_parallel_size", 1),
                lora_rank=model.get("lora_rank"),
            )
        except Exception as err:  # reported to the test, which decides whether this model must load
            results[model["path"]] = {"error": f"{type(err).__name__}: {err}"}
            continue
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
        lora = None
        if model.get("lora"):  # a PEFT LoRA adapter folder, applied to every prompt
            from vllm.lora.request import LoRARequest

            lora = LoRARequest("kha-test-adapter", 1, model["lora"])
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        chosen = [
            [step[token].logprob for step, token in zip(o.outputs[0].logprobs, ids, strict=True)]
            for o, ids in zip(outputs, tokens, strict=True)
        ]
        results[model["path"]] = {"tokens": tokens, "logprobs": chosen}
        _release(llm)
    return results


def image(seed: int):
    """The fixed 28 x 28 RGB test image of SEED (tests/multimodal_helpers.py's `tiny_image` is seed 0)."""
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(28, 28, 3) * 255).astype("uint8"))


def multimodal(job: dict) -> dict:
    """Greedy token ids per model and prompt for an image-text-to-text model: each prompt is {"text": str, "image":
    seed or null}, its image (if any) handed to vLLM's multimodal processor, as a user does with
    `llm.generate({"prompt": ..., "multi_modal_data": {"image": ...}})`. {"path": {"tokens": [[ids], ...]}} or
    {"path": {"error": "..."}}."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompts = [
        {"prompt": p["text"], **({} if p["image"] is None else {"multi_modal_data": {"image": image(p["image"])}})}
        for p in job["prompts"]
    ]
    results = {}
    for model in job["models"]:
        try:
            llm = _llm(
                model["path"],
                model.get("impl"),
                job["max_model_len"],
                trust_remote_code=model.get("trust_remote_code", False),
                images=1,
            )
        except Exception as err:  # reported to the test, which decides whether this model must load
            results[model["path"]] = {"error": f"{type(err).__name__}: {err}"}
            continue
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[model["path"]] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}
        _release(llm)
    return results


def throughput(job: dict) -> dict:
    """Output tokens/s at batch 1 (one request at a time) and with N requests submitted together, per model: the
    median over rounds and every round's value. With "interleave", all models are loaded at once and each round times
    every model in turn (a rotating order), so a slow spell of a shared machine hits all of them alike and the rounds
    pair up; otherwise each model is loaded, timed for all its rounds and released before the next."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=job["prompt"])
    kinds = (("batch1", 1), (f"concurrent{job['concurrent']}", job["concurrent"]))

    def load(model):
        llm = _llm(
            model["path"],
            model.get("impl", "transformers"),
            job["max_model_len"],
            eager=job.get("eager", True),
            trust_remote_code=model.get("trust_remote_code", True),
        )
        llm.generate([prompt], params, use_tqdm=False)  # warm-up
        return llm

    def cpu_seconds() -> float:
        """CPU time used so far by this process and its children (vLLM's engine cores and workers; idle ones add
        nothing): unlike wall time, it does not count the time a busy shared machine keeps the work waiting."""
        import psutil

        processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
        total = 0.0
        for process in processes:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def one_round(llm, rates):
        for name, count in kinds:
            time.sleep(job.get("pause", 0.0))  # let the previous engine's threads go idle
            cpu, start = cpu_seconds(), time.perf_counter()
            outputs = llm.generate([prompt] * count, params, use_tqdm=False)
            elapsed, cpu = time.perf_counter() - start, cpu_seconds() - cpu
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[name].append(tokens / elapsed)
            rates[f"{name} per cpu-second"].append(tokens / cpu)

    rates = {
        model["name"]: {key: [] for name, _ in kinds for key in (name, f"{name} per cpu-second")}
        for model in job["models"]
    }
    if job.get("interleave"):
        llms = [load(model) for model in job["models"]]
        for r in range(job["rounds"]):
            for i in range(len(llms)):
                k = (r + i) % len(llms)
                one_round(llms[k], rates[job["models"][k]["name"]])
        for llm in llms:
            _release(llm)
    else:
        for model in job["models"]:
            llm = load(model)
            for _ in range(job["rounds"]):
                one_round(llm, rates[model["name"]])
            _release(llm)
    results = {}
    for name, per_kind in rates.items():
        results[name] = {kind: statistics.median(values) for kind, values in per_kind.items()}
        results[name]["rounds"] = per_kind
    return results


def remote_code(job: dict) -> dict:
    """Max |logit difference| per folder, loaded by transformers' AutoModelForCausalLM with trust_remote_code."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    expected = torch.load(job["expected"])
    ids = torch.tensor(job["ids"])
    results = {"transformers": transformers.__version__}
    for name, logits in expected.items():
        model = AutoModelForCausalLM.from_pretrained(
            f"{job['root']}/{name}", trust_remote_code=True, attn_implementation="eager"
        )
        with torch.no_grad():
            results[name] = (model(ids).logits - logits).abs().max().item()
    return results


if __name__ == "__main__":
    if "kha" not in os.environ.get("VLLM_PLUGINS", "kha").split(","):  # vLLM's allow-list: unset runs every plugin
        sys.modules["kha_hf"] = None  # unimportable, even from the editable install
    job = json.loads(open(sys.argv[1]).read())
    modes = {"generate": generate, "multimodal": multimodal, "throughput": throughput, "remote_code": remote_code}
    result = modes[job["mode"]](job)
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
