"""Mixed adapter batches (#48 item 4): `model(..., adapter_names=[...])` and `generate(..., adapter_names=...)` run
row i with adapter `adapter_names[i]` ("__base__": none), as PEFT's LoRA does. PEFT's own mixed-batch tests skip
every config class but LoRA by name, so these make the same assertions for knocks: each row equals that row's
adapter run alone, for forward, greedy generate and beam search, with adapters of different presets side by side."""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model

from kha_hf import KnockConfig
from tests.helpers import assert_float_paths_agree, tiny_base_model
from tests.peft.test_knock_adapter import IDS

# Three adapters of three presets (linear on q/k/v; MLP on v and linear on q/k; linear on v only, so the k_proj of
# a layer has no knock of "v_only"), and the base
ADAPTERS = {"a": "linear_qkv", "b": "mlp_v_linear_qk", "v_only": "linear_v"}
BATCH = torch.cat([IDS, IDS.flip(1)])  # (4, 9): four distinct rows, no padding
ROW_ADAPTERS = ["a", "__base__", "b", "v_only"]


@pytest.fixture(scope="module")
def model():
    """A tiny Llama with adapters a, b, c (perturbed knocks, so each changes the output), "a" active."""
    peft_model = get_peft_model(tiny_base_model("llama"), KnockConfig(knock=ADAPTERS["a"], init_weights=False), "a")
    for name in ("b", "v_only"):
        peft_model.add_adapter(name, KnockConfig(knock=ADAPTERS[name], init_weights=False))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # MLP knocks start with a zero gate: move every knock well off its start
        for param_name, param in peft_model.named_parameters():
            if ".knock_sets." in param_name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
    peft_model.set_adapter("a")
    return peft_model.eval()


def alone(model, name: str, run):
    """RUN() with only adapter NAME active ("__base__": adapters disabled)."""
    if name == "__base__":
        with model.disable_adapter():
            return run()
    model.set_adapter(name)
    try:
        return run()
    finally:
        model.set_adapter("a")


@torch.no_grad()
def test_each_row_of_a_mixed_forward_equals_its_adapter_alone(model):
    mixed = model(BATCH, adapter_names=ROW_ADAPTERS).logits
    rows = {name: alone(model, name, lambda: model(BATCH).logits) for name in set(ROW_ADAPTERS)}
    for i, name in enumerate(ROW_ADAPTERS):
        torch.testing.assert_close(mixed[i], rows[name][i], rtol=0, atol=1e-6, msg=f"row {i} ({name})")
        for other in set(ROW_ADAPTERS) - {name}:  # the adapters really differ, so a mix-up would show
            assert (rows[other][i] - rows[name][i]).abs().max() > 1e-3, f"row {i}: {name} and {other} agree"
    # one row alone (batch of 1) agrees too: the other rows change nothing
    single = alone(model, "b", lambda: model(BATCH[2:3]).logits)
    torch.testing.assert_close(mixed[2:3], single, rtol=0, atol=1e-5)
    # the active adapter is untouched by the mixed call
    assert model.active_adapter == "a"


@torch.no_grad()
@pytest.mark.parametrize("num_beams", [1, 2])
def test_generate_with_mixed_adapter_batches_equals_each_adapter_alone(model, num_beams):
    """Greedy and beam search: beam search repeats each row num_beams times, and so must the adapter names."""
    kwargs = {"max_new_tokens": 5, "do_sample": False, "num_beams": num_beams, "pad_token_id": 0}
    mixed = model.generate(input_ids=BATCH, adapter_names=ROW_ADAPTERS, **kwargs)
    for i, name in enumerate(ROW_ADAPTERS):
        expected = alone(model, name, lambda: model.generate(input_ids=BATCH, **kwargs))
        assert torch.equal(mixed[i], expected[i]), f"row {i} ({name}): {mixed[i].tolist()} vs {expected[i].tolist()}"
    distinct = {tuple(alone(model, n, lambda: model.generate(input_ids=BATCH, **kwargs))[0].tolist()) for n in ADAPTERS}
    assert len(distinct) > 1, "every adapter generated the same tokens: the test could not see a mix-up"


@torch.no_grad()
def test_bad_adapter_names_get_peft_errors(model):
    with pytest.raises(ValueError, match="Trying to infer with non-existing adapter\\(s\\): nope"):
        model(BATCH, adapter_names=["a", "nope", "b", "v_only"])
    with pytest.raises(ValueError, match="Length of `adapter_names` should be the same as the number of inputs"):
        model(BATCH, adapter_names=["a", "b"])
    model.train()
    try:
        with pytest.raises(ValueError, match="Cannot pass `adapter_names` when the model is in training mode"):
            model(BATCH, adapter_names=ROW_ADAPTERS)
    finally:
        model.eval()


@torch.no_grad()
def test_a_merged_adapter_refuses_mixed_batches():
    model = get_peft_model(tiny_base_model("llama"), KnockConfig(knock="linear_v", init_weights=False), "a").eval()
    model.add_adapter("b", KnockConfig(knock="linear_v", init_weights=False))
    model.merge_adapter(["a"])
    with pytest.raises(ValueError, match="Cannot pass `adapter_names` when there are merged adapters"):
        model(BATCH, adapter_names=["a", "b", "a", "b"])


@torch.no_grad()
def test_modules_to_save_follow_the_row_adapter_too():
    """PEFT's modules_to_save wrapper mixes batches itself: it must get the names as the knock layers do."""
    config = dict(knock="linear_v", init_weights=False, modules_to_save=["lm_head"])
    model = get_peft_model(tiny_base_model("llama"), KnockConfig(**config), "a")
    model.add_adapter("b", KnockConfig(**config))
    gen = torch.Generator().manual_seed(3)
    for name in ("a", "b"):
        head = model.base_model.model.lm_head.modules_to_save[name]
        head.weight.add_(0.5 * torch.randn(head.weight.shape, generator=gen))
    model.eval()
    mixed = model(BATCH, adapter_names=["b", "a", "__base__", "b"]).logits
    for i, name in enumerate(["b", "a", "__base__", "b"]):
        expected = alone(model, name, lambda: model(BATCH).logits)
        assert_float_paths_agree(mixed[i], expected[i], what=f"row {i} ({name})")


@torch.no_grad()
def test_generate_repeats_the_names_however_the_rows_are_repeated(model):
    """Beam search set in a GenerationConfig (not as a keyword), and sampling with num_return_sequences: generate
    repeats each row, and each row's names must follow (the hook sees generate's repetition, not only num_beams=)."""
    from transformers import GenerationConfig

    config = GenerationConfig(num_beams=2, max_new_tokens=4, do_sample=False, pad_token_id=0)
    mixed = model.generate(input_ids=BATCH, adapter_names=ROW_ADAPTERS, generation_config=config)
    for i, name in enumerate(ROW_ADAPTERS):
        expected = alone(model, name, lambda: model.generate(input_ids=BATCH, generation_config=config))
        assert torch.equal(mixed[i], expected[i]), f"row {i} ({name})"
    sampling = dict(do_sample=True, num_return_sequences=2, max_new_tokens=4, pad_token_id=0)
    torch.manual_seed(0)
    mixed = model.generate(input_ids=BATCH, adapter_names=ROW_ADAPTERS, **sampling)
    assert mixed.shape[0] == 2 * len(ROW_ADAPTERS)
    for i, name in enumerate(ROW_ADAPTERS):
        torch.manual_seed(0)
        expected = alone(model, name, lambda: model.generate(input_ids=BATCH, **sampling))
        assert torch.equal(mixed[2 * i : 2 * i + 2], expected[2 * i : 2 * i + 2]), f"rows of {i} ({name})"


@torch.no_grad()
def test_the_tuner_itself_honours_adapter_names(model):
    """`peft_model.base_model(ids, adapter_names=...)`: PEFT's BaseTuner.forward would drop the argument and run the
    active adapter on every row."""
    mixed = model.base_model(BATCH, adapter_names=ROW_ADAPTERS).logits
    expected = model(BATCH, adapter_names=ROW_ADAPTERS).logits
    torch.testing.assert_close(mixed, expected, rtol=0, atol=0)


@torch.no_grad()
def test_adapter_names_must_be_a_list_of_names(model):
    for names in ("ab", ["a", None, "b", "a"], "__base__"):
        with pytest.raises(TypeError, match="expected a list of str"):
            model(BATCH, adapter_names=names)


@torch.no_grad()
def test_modules_to_save_of_some_adapters_only():
    """Adapter "b" trains its own lm_head, "a" does not: a's rows use the base lm_head, as "a" alone does (PEFT's
    wrapper would raise KeyError: 'a')."""
    model = get_peft_model(tiny_base_model("llama"), KnockConfig(knock="linear_v", init_weights=False), "a")
    model.add_adapter("b", KnockConfig(knock="linear_v", init_weights=False, modules_to_save=["lm_head"]))
    head = model.base_model.model.lm_head.modules_to_save["b"]
    head.weight.add_(0.5 * torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(5)))
    model.eval()
    names = ["b", "a", "__base__", "a"]
    mixed = model(BATCH, adapter_names=names).logits
    for i, name in enumerate(names):
        expected = alone(model, name, lambda: model(BATCH).logits)
        assert_float_paths_agree(mixed[i], expected[i], what=f"row {i} ({name})")
