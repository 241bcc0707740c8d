"""Identity knocks change nothing: KHA vs the unmodified transformers model of each base family."""

import copy

import pytest
import torch
import transformers
from transformers.modeling_outputs import CausalLMOutputWithPast

from kha_hf import KHAForCausalLM
from kha_hf.modeling.knocks import KnockLinear
from tests.helpers import FAMILIES, KIND_PRESETS, assert_close, randomize_knocks, tiny_base_model

ATTN = ["eager", "sdpa"]


def _inputs(batch: int = 2, length: int = 11, vocab: int = 128):
    ids = torch.randint(3, vocab, (batch, length))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row exercises the attention mask path
    return ids, mask


def _assert_knocks_at_init(model) -> None:
    knocks = [m for m in model.modules() if isinstance(m, KnockLinear)]
    assert knocks, "model has no knocks"
    for knock in knocks:
        expected = torch.eye(knock.in_features) if knock.start == "identity" else torch.zeros_like(knock.weight)
        assert torch.equal(knock.weight.detach().float(), expected.float()), "knock is not at its identity init"


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("preset", KIND_PRESETS)
def test_from_base_logits_equal(family, attn, preset):
    base = tiny_base_model(family, attn)
    reference = copy.deepcopy(base)
    kha = KHAForCausalLM.from_base(base, knock=preset)
    assert isinstance(kha, KHAForCausalLM) and kha.config.base_model_type == reference.config.model_type
    ids, mask = _inputs()
    with torch.no_grad():
        assert_close(kha(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits, what=preset)


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("family", FAMILIES)
def test_from_base_checkpoint_logits_equal_and_knocks_identity(family, attn, tmp_path):
    base = tiny_base_model(family, attn)
    base.save_pretrained(tmp_path)
    kha = KHAForCausalLM.from_pretrained(tmp_path, knock="mlp_v_linear_qk", attn_implementation=attn).eval()
    _assert_knocks_at_init(kha)
    ids, mask = _inputs()
    with torch.no_grad():
        assert_close(kha(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generate_identical_with_and_without_cache(family):
    base = tiny_base_model(family, "sdpa")
    kha = KHAForCausalLM.from_base(copy.deepcopy(base), knock="mlp_v_linear_qk")
    prompt = torch.randint(3, 128, (1, 6))
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    for use_cache in (True, False):
        expected = base.generate(prompt, use_cache=use_cache, **kwargs)
        got = kha.generate(prompt, use_cache=use_cache, **kwargs)
        assert got.shape[1] == prompt.shape[1] + 12
        assert torch.equal(got, expected), f"use_cache={use_cache}"


# The KV cache's name in model outputs and forward arguments: `cache` from transformers 5.24 on, `past_key_values`
# before (5.16.1 to 5.23, the low end of kha-hf's range)
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_matches_full_forward_with_trained_knocks(family):
    # Non-identity knocks: a forward override that dropped or misused the KV cache would diverge here.
    kha = KHAForCausalLM.from_base(tiny_base_model(family, "sdpa"), knock="mlp_v_linear_qk")
    randomize_knocks(kha)
    ids = torch.randint(3, 128, (2, 12))
    with torch.no_grad():
        full = kha(ids).logits
        out = kha(ids[:, :5], use_cache=True)
        steps = [out.logits]
        for t in range(5, ids.shape[1]):
            out = kha(ids[:, t : t + 1], **{CACHE: getattr(out, CACHE)}, use_cache=True)
            steps.append(out.logits)
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, what="cached vs full")
    prompt = ids[:1, :6]
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(kha.generate(prompt, use_cache=True, **kwargs), kha.generate(prompt, use_cache=False, **kwargs))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_router_aux_loss_equal(family):
    base = tiny_base_model(family)
    kha = KHAForCausalLM.from_base(copy.deepcopy(base), knock="mlp_v")
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        try:
            expected = base(ids, labels=ids, output_router_logits=True)
        except AttributeError as err:  # transformers 5.17's Mixtral/Qwen3-MoE: aux_loss is the int 0 here
            pytest.skip(f"the stock {family} model fails on transformers {transformers.__version__}: {err}")
        got = kha(ids, labels=ids, output_router_logits=True)
    assert expected.aux_loss is not None
    assert_close(got.aux_loss, expected.aux_loss)
    assert_close(got.loss, expected.loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_causal_lm_has_the_base_family_attributes(family):
    # KHAForCausalLM.__init__ mirrors the family's __init__ (whose body class is hard-coded): catch drift when a
    # transformers release adds an attribute there.
    base = tiny_base_model(family)
    kha = KHAForCausalLM.from_base(copy.deepcopy(base))
    plain = {k for k, v in vars(base).items() if not k.startswith("_") and not isinstance(v, torch.nn.Module)}
    assert plain <= set(vars(kha)), sorted(plain - set(vars(kha)))
    assert set(base.state_dict()) <= set(kha.state_dict())
