"""The knock step matches a short plain-torch reference of one attention layer, for every preset."""

import copy

import pytest
import torch
from torch.nn import functional as F

from kha_hf import KNOCK_PRESETS, KHAForCausalLM
from tests.helpers import FAMILIES, KIND_PRESETS, assert_close, randomize_knocks, tiny_base_model


def _knock(module, x):
    """Reference knock on x (B, L, H, d): Linear `x @ T` (T = weight.T) or the MLP of the paper."""
    if module is None:
        return x
    if hasattr(module, "up"):
        up, gate, down = module.up.weight.T, module.gate.weight.T, module.down.weight.T
        return 2 * ((x @ up) * torch.sigmoid(x @ gate)) @ down
    if hasattr(module, "gate"):  # the paper's gate-only control
        return 2 * (x * torch.sigmoid(x @ module.gate.weight.T))
    return x @ module.weight.T


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rms_norm(norm, x):
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def reference_attention(attn, x, cos, sin):
    """Plain causal GQA attention with knocks after the projections and before q/k norm and RoPE."""
    b, length, _ = x.shape
    d = attn.head_dim
    q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(b, length, -1, d)
    k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(b, length, -1, d)
    v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(b, length, -1, d)
    q, k, v = _knock(attn.q_knock, q), _knock(attn.k_knock, k), _knock(attn.v_knock, v)
    if hasattr(attn, "q_norm"):
        q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, L, d)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * d**-0.5
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, length, -1)
    return F.linear(out, attn.o_proj.weight, attn.o_proj.bias)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", KIND_PRESETS)
def test_attention_matches_plain_reference_with_random_knocks(family, preset, attn):
    model = KHAForCausalLM.from_base(tiny_base_model(family, attn), knock=preset)
    randomize_knocks(model)
    layer = model.model.layers[1].self_attn
    assert layer.q_proj.bias is None or layer.q_proj.bias.abs().min() > 0, "test models need non-zero biases"
    length = 4  # shorter than the tiny configs' sliding windows, so the window does not cut
    x = torch.randn(2, length, model.config.hidden_size)
    position_ids = torch.arange(length).unsqueeze(0).expand(2, -1)
    cos, sin = model.model.rotary_emb(x, position_ids)
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None].expand(2, 1, -1, -1)
    with torch.no_grad():
        got, _ = layer(x, position_embeddings=(cos, sin), attention_mask=mask)
        expected = reference_attention(layer, x, cos, sin)
    assert_close(got, expected, atol=1e-5, what=f"{family}/{preset}/{attn}")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", KIND_PRESETS)
def test_non_identity_knocks_change_logits(family, preset):
    base = tiny_base_model(family)
    model = KHAForCausalLM.from_base(copy.deepcopy(base), knock=preset)
    randomize_knocks(model)
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        diff = (model(ids).logits - base(ids).logits).abs().max()
    assert diff > 1e-3, f"random {preset} knocks left the logits unchanged"


def test_knock_layers_limits_knocks_to_those_layers():
    model = KHAForCausalLM.from_base(tiny_base_model("qwen3"), knock="linear_qkv", knock_layers=[0, 2])
    present = [layer.self_attn.v_knock is not None for layer in model.model.layers]
    assert present == [True, False, True]


def test_the_kind_presets_cover_every_type_on_every_target():
    """Every preset's type on every target is some KIND_PRESETS preset's type there: the per-family tests, which run
    the kind presets only, cover every preset's knocks."""
    covered = {(target, KNOCK_PRESETS[p][i]) for p in KIND_PRESETS for i, target in enumerate("qkv")}
    for preset, types in KNOCK_PRESETS.items():
        missing = [(t, kind) for t, kind in zip("qkv", types, strict=True) if (t, kind) not in covered]
        assert missing == [], f"{preset}: {missing} is in no preset the per-family tests run"
