"""kha-hf's vLLM plugin's MLP value-knock fold (kha_hf/vllm_plugin/value_fold.py), without vLLM: its algebra.

vLLM serves a KHA-MLP layer with the knock's down map folded into o_proj (attention is linear in V) and its up and
gate maps run as one matmul and `glu` (`GatedUpKnock`). Here, against an attention layer written out by hand with
`knocks.MLPKnock` (GQA, biases, random knocks, softmax over tokens): the folded layer gives the same output within
float32 rounding, whatever order the checkpoint's tensors stream in; a knock of the wrong shape, a knock stored
twice or a layer without its knocks is refused. The token-exact run in vLLM is tests/vllm/test_vllm_plugin.py.
"""

from __future__ import annotations

import pytest
import torch

from kha_hf.modeling.knocks import MLPKnock
from kha_hf.vllm_plugin.value_fold import GatedUpKnock, ValueKnockFolder

HIDDEN, HEADS, KV_HEADS, D, TOKENS = 48, 6, 2, 8, 5
SITE = "layers.0.self_attn"


def layer_tensors(seed: int = 0) -> tuple[dict[str, torch.Tensor], MLPKnock]:
    """A checkpoint's tensors of one attention layer (model.layers.0.self_attn.*) and its MLP value knock."""
    g = torch.Generator().manual_seed(seed)
    knock = MLPKnock(D)
    with torch.no_grad():
        for linear in (knock.up, knock.gate, knock.down):
            linear.weight.add_(0.3 * torch.randn(D, D, generator=g))
    prefix = f"model.{SITE}"
    tensors = {
        f"{prefix}.v_proj.weight": torch.randn(KV_HEADS * D, HIDDEN, generator=g),
        f"{prefix}.v_proj.bias": torch.randn(KV_HEADS * D, generator=g),
        f"{prefix}.o_proj.weight": torch.randn(HIDDEN, HEADS * D, generator=g),
        f"{prefix}.o_proj.bias": torch.randn(HIDDEN, generator=g),
        **{f"{prefix}.v_knock.{p}.weight": getattr(knock, p).weight.detach().clone() for p in ("up", "gate", "down")},
    }
    return tensors, knock


def attention(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(tokens, kv_heads, d) values mixed by (heads, tokens, tokens) softmax weights (GQA) -> (tokens, heads * d)."""
    per_query_head = values.repeat_interleave(HEADS // KV_HEADS, dim=1)  # (tokens, heads, d)
    return torch.einsum("hts,shd->thd", weights, per_query_head).flatten(1)


def reference(tensors: dict, knock: MLPKnock, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    p = f"model.{SITE}"
    v = (x @ tensors[f"{p}.v_proj.weight"].T + tensors[f"{p}.v_proj.bias"]).unflatten(-1, (KV_HEADS, D))
    with torch.no_grad():
        out = attention(knock(v), weights)
    return out @ tensors[f"{p}.o_proj.weight"].T + tensors[f"{p}.o_proj.bias"]


def folded(loaded: dict, knock: GatedUpKnock, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    p = f"model.{SITE}"
    v = (x @ loaded[f"{p}.v_proj.weight"].T + loaded[f"{p}.v_proj.bias"]).unflatten(-1, (KV_HEADS, D))
    out = attention(knock(v), weights)
    return out @ loaded[f"{p}.o_proj.weight"].T + loaded[f"{p}.o_proj.bias"]


class Body(torch.nn.Module):
    """Stands in for vLLM's HF body: layers.0.self_attn.v_knock is an MLPKnock until `install` swaps it."""

    def __init__(self) -> None:
        super().__init__()
        attention = torch.nn.Module()
        attention.v_knock = MLPKnock(D)
        layer = torch.nn.Module()
        layer.self_attn = attention
        self.layers = torch.nn.ModuleList([layer])


@pytest.mark.parametrize("order", ["knocks last", "knocks first", "sorted"])
def test_folded_layer_equals_the_knocked_layer(order):
    tensors, knock = layer_tensors()
    names = sorted(tensors)
    if order == "knocks last":  # the projections wait for the knocks (converted checkpoints: knocks in their own file)
        names = [n for n in names if "_knock" not in n] + [n for n in names if "_knock" in n]
    elif order == "knocks first":
        names = [n for n in names if "_knock" in n] + [n for n in names if "_knock" not in n]
    folder = ValueKnockFolder({SITE: 0}, D)
    loaded = dict(folder((n, tensors[n]) for n in names))
    assert set(loaded) == set(tensors), "every tensor reaches vLLM's loader once (the knocks too)"
    for untouched in ("v_proj.weight", "v_proj.bias", "o_proj.bias"):
        assert torch.equal(loaded[f"model.{SITE}.{untouched}"], tensors[f"model.{SITE}.{untouched}"])
    body = Body()
    assert folder.install(body) == 1
    gated = body.layers[0].self_attn.v_knock
    assert isinstance(gated, GatedUpKnock) and not list(gated.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(TOKENS, HIDDEN, generator=g)
    weights = torch.softmax(torch.randn(HEADS, TOKENS, TOKENS, generator=g), dim=-1)
    expected = reference(tensors, knock, x, weights)
    got = folded(loaded, gated, x, weights)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    # and the knock matters here: without it the layer gives something else
    plain = attention((x @ tensors[f"model.{SITE}.v_proj.weight"].T).unflatten(-1, (KV_HEADS, D)), weights)
    assert (plain @ tensors[f"model.{SITE}.o_proj.weight"].T - expected).abs().max() > 0.1


def test_layers_outside_the_sites_pass_untouched():
    tensors, _ = layer_tensors()
    other = {name.replace("layers.0.", "layers.1."): t for name, t in tensors.items()}  # a layer without knocks
    loaded = dict(ValueKnockFolder({SITE: 0}, D)([*tensors.items(), *other.items()]))
    assert all(torch.equal(loaded[n], other[n]) for n in other)
    assert not torch.equal(loaded[f"model.{SITE}.o_proj.weight"], tensors[f"model.{SITE}.o_proj.weight"])


def _wrong_shape(tensors):  # einsum would broadcast a (d, 1) knock without a word
    tensors[f"model.{SITE}.v_knock.gate.weight"] = torch.zeros(D, 1)
    return list(tensors.items())


def _without(key):
    def remove(tensors):
        del tensors[f"model.{SITE}.{key}"]
        return list(tensors.items())

    return remove


def _stored_twice(tensors):  # a second copy later in the stream (another shard)
    return [*tensors.items(), (f"model.{SITE}.v_knock.up.weight", torch.eye(D))]


@pytest.mark.parametrize(
    "broken, message",
    [
        (_wrong_shape, r"v_knock\.gate\.weight .* is not an MLP knock's weight"),
        (_without("v_knock.down.weight"), r"layers\.0\.self_attn\.v_knock has no down weight .* layer 0"),
        (_stored_twice, r"v_knock\.up\.weight is stored twice"),
        # vLLM does not check that an unquantized linear layer was loaded: it would serve an uninitialised o_proj
        (_without("o_proj.weight"), r"layers\.0\.self_attn\.o_proj\.weight is missing"),
    ],
    ids=["knock of the wrong shape", "layer without its down knock", "knock stored twice", "layer without o_proj"],
)
def test_a_broken_checkpoint_is_refused_in_one_line(broken, message):
    tensors, _ = layer_tensors()
    with pytest.raises(ValueError, match=message):
        dict(ValueKnockFolder({SITE: 0}, D)(broken(tensors)))


@pytest.mark.parametrize(
    "family, knock, quantized, expected",
    [
        ("qwen3", "mlp_v", False, True),  # separate v_proj, o_proj right after the kernel
        ("llama_bias", "mlp_v_linear_qk", False, True),  # o_proj with a bias (added after the heads mix)
        ("gemma3_text", "mlp_v", False, True),
        ("phi3", "mlp_v", False, False),  # fused qkv_proj on disk: the value rows are a block of it (GLUKnock then)
        ("qwen3_next", "mlp_v", False, False),  # an output gate between the kernel and o_proj
        ("qwen3", "linear_v", False, False),  # no MLP knock (linear knocks fold into the projections instead)
        ("qwen3", "mlp_v", True, False),  # quantized weights cannot take a fold
    ],
)
def test_foldable_only_where_the_algebra_holds(family, knock, quantized, expected):
    """`foldable` on the attention modules transformers builds for a KHA model of FAMILY (vLLM builds the same HF
    modules, with its own linear layers): True only where o_proj directly follows the kernel and v_proj holds the
    value heads alone."""
    from kha_hf import KHAConfig, KHAForCausalLM
    from kha_hf.vllm_plugin.value_fold import foldable
    from tests.helpers import tiny_config

    config = KHAConfig.from_base(tiny_config(family), knock=knock)
    model = KHAForCausalLM(config)
    attentions = [m for m in model.modules() if hasattr(m, "_kha_plans")]  # every knocked layer's attention
    assert attentions
    assert {foldable(config, a, quantized) for a in attentions} == {expected}


def test_a_later_load_passes_other_tensors_and_refuses_the_folded_layers():
    """vLLM's reload_weights or a weight update after the first load: a folded layer cannot take new weights (its
    knocks are gone into o_proj); every other tensor goes through."""
    tensors, _ = layer_tensors()
    folder = ValueKnockFolder({SITE: 0}, D)
    dict(folder(tensors.items()))
    folder.install(Body())
    embedding = torch.zeros(3, HIDDEN)
    assert list(folder([("model.embed_tokens.weight", embedding)])) == [("model.embed_tokens.weight", embedding)]
    with pytest.raises(ValueError, match=r"o_proj\.weight cannot be reloaded"):
        list(folder([(f"model.{SITE}.o_proj.weight", tensors[f"model.{SITE}.o_proj.weight"])]))


def test_olmo_with_clip_qkv_is_not_folded():
    """OLMo clamps the values after the knock (clip_qkv): moving the down map past the clamp changes the result. A
    family outside kha-hf's table (tried with the standard layout) never gets the fold (found by an attack)."""
    from transformers import OlmoConfig

    from kha_hf import KHAConfig, KHAForCausalLM
    from kha_hf.vllm_plugin.value_fold import foldable
    from tests.helpers import COMMON

    config = KHAConfig.from_base(OlmoConfig(**COMMON, clip_qkv=0.05), knock="mlp_v")
    attentions = [m for m in KHAForCausalLM(config).modules() if hasattr(m, "_kha_plans")]
    assert attentions and not any(foldable(config, a, False) for a in attentions)
