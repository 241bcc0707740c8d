"""What vLLM's and SGLang's Transformers backends and tensor parallelism rely on.

- every attention call goes through `ALL_ATTENTION_FUNCTIONS` with the model's kwargs passed down, so an engine's own
  attention function (registered through `AttentionInterface`) runs KHA unchanged;
- `KHAConfig` carries the family's tensor-parallel plan, knocks replicated with their gradients all-reduced: run
  with transformers' `tp_plan="auto"` in two CPU processes (gloo), logits and knock gradients equal one process's.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kha_hf import KHAConfig, KHAForCausalLM
from tests.helpers import FAMILIES, randomize_knocks, tiny_base_model, tiny_config

CALLS: list[dict] = []


def probe_attention(module, query, key, value, attention_mask, **kwargs):
    """An engine's attention function: records what it is handed, then computes as SDPA does."""
    CALLS.append({"layer": module.layer_idx, "kwargs": sorted(kwargs)})
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("kha_probe", probe_attention)
AttentionMaskInterface.register("kha_probe", sdpa_mask)  # an engine brings its masks too (sliding windows)


@pytest.mark.parametrize("family", FAMILIES)
def test_custom_attention_function_reproduces_sdpa(family):
    model = KHAForCausalLM.from_base(tiny_base_model(family, "sdpa"), knock="mlp_v_linear_qk")
    randomize_knocks(model)
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        model.set_attn_implementation("kha_probe")
        CALLS.clear()
        got = model(ids, position_ids=torch.arange(9).expand(2, -1)).logits
    assert torch.equal(got, expected)
    assert [c["layer"] for c in CALLS] == list(range(model.config.num_hidden_layers))
    assert all("scaling" in c["kwargs"] and "position_ids" in c["kwargs"] for c in CALLS), CALLS[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_config_carries_the_family_parallel_plans_with_knocks_replicated(family):
    base = tiny_config(family)
    config = KHAConfig.from_base(base, knock="mlp_v_linear_qk")
    family_plan = type(base).base_model_tp_plan
    assert {k: v for k, v in config.base_model_tp_plan.items() if "knock" not in k} == family_plan
    knocks = {k: v for k, v in config.base_model_tp_plan.items() if "knock" in k}
    assert set(knocks) == {
        f"layers.*.self_attn.{t}" for t in ("q_knock", "k_knock", "v_knock.up", "v_knock.gate", "v_knock.down")
    }
    assert set(knocks.values()) == {"replicated_with_grad_allreduce"}
    assert config.base_model_pp_plan == type(base).base_model_pp_plan
    assert "base_model_tp_plan" not in config.to_dict()  # a class-level fact of the family, not saved


@pytest.mark.parametrize(
    ("family", "style"),
    [
        ("olmo2", "replicate"),
        ("olmo3", "replicate"),
        ("phi3", "replicate"),
        ("gemma3_text", "replicated_with_grad_allreduce"),
        ("deepseek_v3", None),
        ("gpt_oss", None),
    ],
)
def test_knock_tp_style_follows_the_projection_style(family, style):
    """colwise q/k/v (each rank holds whole heads): knock gradients are summed over ranks; colwise_gather_output
    (every rank sees every head): the knock already has the whole gradient, and summing would multiply it; a family
    without attention TP plan gets no knock entries."""
    config = KHAConfig.from_base(tiny_config(family), knock="linear_qkv")
    knocks = {k: v for k, v in config.base_model_tp_plan.items() if "knock" in k}
    family_plan = type(tiny_config(family)).base_model_tp_plan or {}
    if family == "deepseek_v3" and family_plan.get("layers.*.self_attn.q_b_proj") == "colwise":
        style = "replicated_with_grad_allreduce"  # transformers 5.25 added MLA's attention plan (colwise heads)
    if style is None:
        assert knocks == {}
    else:
        assert set(knocks) == {f"layers.*.self_attn.{t}_knock" for t in "qkv"} and set(knocks.values()) == {style}


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])  # colwise q/k/v; colwise_gather_output q/k/v
def test_tensor_parallel_two_processes_match_one(tmp_path, family):
    model = KHAForCausalLM.from_base(tiny_base_model(family, "sdpa"), knock="mlp_v_linear_qk")
    randomize_knocks(model)
    model.save_pretrained(tmp_path / "kha")
    ids = torch.tensor([[3, 9, 27, 81, 5, 15, 45, 7]])
    out = model(ids, labels=ids)
    out.loss.backward()
    attn = model.model.layers[0].self_attn
    expected = {
        "logits": out.logits.detach(),
        "q_knock": attn.q_knock.weight.grad.clone(),
        "v_up": attn.v_knock.up.weight.grad.clone(),
    }
    script = tmp_path / "tp.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, os, torch
            from transformers import DistributedConfig
            from kha_hf import KHAForCausalLM
            model = KHAForCausalLM.from_pretrained(
                {str(tmp_path / "kha")!r}, distributed_config=DistributedConfig(tp_plan="auto"),
                attn_implementation="sdpa",
            )
            ids = torch.tensor({ids.tolist()!r})
            out = model(ids, labels=ids)
            out.loss.backward()
            attn = model.model.layers[0].self_attn
            local = lambda t: t.to_local() if hasattr(t, "to_local") else t
            torch.save({{
                "rows": local(attn.q_proj.weight).shape[0],
                "logits": out.logits.detach(),
                "q_knock": local(attn.q_knock.weight.grad),
                "v_up": local(attn.v_knock.up.weight.grad),
            }}, {str(tmp_path)!r} + f"/rank{{os.environ['RANK']}}.pt")
            """
        )
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with socket.socket() as probe:  # a free port for the two processes to meet on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(port),
        str(script),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["rows"] == attn.q_proj.weight.shape[0] // 2, "q_proj was not split across the two ranks"
        assert torch.allclose(got["logits"], expected["logits"], atol=1e-5)
        # each rank holds half the heads: its knock gradient is partial until the all-reduce the plan asks for
        assert torch.allclose(got["q_knock"], expected["q_knock"], atol=1e-6), json.dumps(rank)
        assert torch.allclose(got["v_up"], expected["v_up"], atol=1e-6)
