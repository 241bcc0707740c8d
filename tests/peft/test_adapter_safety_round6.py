"""Safety round 6 (#58 items 1 and 9, #61 item 1): a knock adapter file loads only the tensors that belong to it.

- `PeftModel.load_adapter` accepted any key whose parent module ends with a modules_to_save entry:
  `lm_head.original_module.weight` (the base model's own head), `mlp.original_module.down_proj.weight`, and
  `lm_head.modules_to_save.<another adapter>.weight` (a neighbour's head) all loaded, zeroing the base model, the
  `__base__` rows of a mixed batch and other tenants' adapters.
- transformers' own `model.load_adapter(DIR)` never ran the check: an extra `lm_head.weight` zeroed every logit.
- An adapter whose modules_to_save names a module with no tensor in the file gave peft's bare KeyError.

Each hostile file is refused in one line before any weight changes, and the base model's state dict stays bitwise
as it was.
"""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from tests.peft.test_knock_adapter import IDS, _adapter, _stock, llama_base  # noqa: F401 (a fixture)


def _states(model) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Every parameter and buffer object of MODEL with a copy of its values: peft wraps modules in place (a refused
    load may leave a wrapper behind), so names may change; the tensors themselves may not."""
    held = [*model.named_parameters(), *model.named_buffers()]
    return [(name, tensor, tensor.detach().clone()) for name, tensor in held]


def _assert_unchanged(model, before, what: str) -> None:
    changed = [name for name, tensor, saved in before if not torch.equal(tensor, saved)]
    assert not changed, f"{what}: {changed[:3]} changed"


def _hostile(base, folder, modules_to_save, extra: dict[str, str]):
    """A valid linear_v adapter saved in FOLDER, then EXTRA (file key -> the stock model's parameter it copies the
    shape of) added to its file as zeros."""
    _adapter(base, "linear_v", modules_to_save=modules_to_save).save_pretrained(folder)
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    stock = dict(_stock(base).named_parameters())
    for key, like in extra.items():
        tensors[key] = torch.zeros_like(stock[like])
    save_file(tensors, path, metadata={"format": "pt"})


HOSTILE_FILES = {
    "lm_head.original_module": (["lm_head"], {"base_model.model.lm_head.original_module.weight": "lm_head.weight"}),
    "mlp.original_module": (
        ["mlp"],
        {
            "base_model.model.model.layers.0.mlp.original_module.down_proj.weight": (
                "model.layers.0.mlp.down_proj.weight"
            )
        },
    ),
    "base_layer": (
        ["lm_head"],
        {
            "base_model.model.model.layers.0.self_attn.v_proj.base_layer.weight": (
                "model.layers.0.self_attn.v_proj.weight"
            )
        },
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_FILES))
def test_peft_load_adapter_refuses_keys_outside_the_adapters_own_copies(llama_base, tmp_path, case):  # noqa: F811
    modules_to_save, extra = HOSTILE_FILES[case]
    _hostile(llama_base, tmp_path / "evil", modules_to_save, extra)
    _adapter(llama_base, "linear_v", modules_to_save=modules_to_save).save_pretrained(tmp_path / "honest")
    model = PeftModel.from_pretrained(_stock(llama_base), tmp_path / "honest", adapter_name="honest").eval()
    before = _states(model)
    with model.disable_adapter(), torch.no_grad():
        base_logits = model(IDS).logits
    with pytest.raises(ValueError, match=r"neither knocks nor its own copies .*" + list(extra)[0].split(".")[-2]):
        model.load_adapter(tmp_path / "evil", adapter_name="evil")
    _assert_unchanged(model, before, case)
    with model.disable_adapter(), torch.no_grad():
        assert torch.equal(model(IDS).logits, base_logits)


def test_a_second_adapter_cannot_write_the_first_adapters_head(llama_base, tmp_path):  # noqa: F811
    _adapter(llama_base, "linear_v", modules_to_save=["lm_head"]).save_pretrained(tmp_path / "first")
    _hostile(
        llama_base,
        tmp_path / "second",
        ["lm_head"],
        {"base_model.model.lm_head.modules_to_save.first.weight": "lm_head.weight"},
    )
    model = PeftModel.from_pretrained(_stock(llama_base), tmp_path / "first", adapter_name="first").eval()
    before = _states(model)
    with torch.no_grad():
        first_logits = model(IDS).logits
    with pytest.raises(ValueError, match=r"modules_to_save\.first\.weight"):
        model.load_adapter(tmp_path / "second", adapter_name="second")
    _assert_unchanged(model, before, "the first adapter after the refused second")
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, first_logits)


def test_the_adapters_own_head_still_loads_beside_another(llama_base, tmp_path):  # noqa: F811
    """The rule is not 'refuse modules_to_save': each adapter's own head loads, and stays its own."""
    for name, scale in (("first", 1.5), ("second", 0.5)):
        model = _adapter(llama_base, "linear_v", modules_to_save=["lm_head"])
        with torch.no_grad():
            next(p for n, p in model.named_parameters() if "lm_head.modules_to_save" in n).mul_(scale)
        model.save_pretrained(tmp_path / name)
    model = PeftModel.from_pretrained(_stock(llama_base), tmp_path / "first", adapter_name="first").eval()
    with torch.no_grad():
        first = model(IDS).logits
    model.load_adapter(tmp_path / "second", adapter_name="second")
    model.set_adapter("second")
    with torch.no_grad():
        second = model(IDS).logits
    model.set_adapter("first")
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, first)
    assert not torch.equal(first, second)


def test_transformers_load_adapter_is_refused_with_the_base_untouched(llama_base, tmp_path):  # noqa: F811
    """#61 item 1: transformers' `model.load_adapter(DIR)` loads the file with its own loader, which no peft hook
    sees; knock adapters are refused on that path, in one line naming PeftModel.from_pretrained."""
    _hostile(llama_base, tmp_path / "evil", None, {"base_model.model.lm_head.weight": "lm_head.weight"})
    stock = _stock(llama_base)
    before = _states(stock)
    with pytest.raises(ValueError, match=r"PeftModel\.from_pretrained\(model, DIR\)") as refused:
        stock.load_adapter(str(tmp_path / "evil"))
    assert "\n" not in str(refused.value)
    _assert_unchanged(stock, before, "the stock model after transformers' load_adapter")
    assert not any("knock" in name for name, _ in stock.named_modules())  # nothing was injected either


def test_transformers_from_pretrained_of_an_adapter_folder_is_refused(llama_base, tmp_path):  # noqa: F811
    """`AutoModelForCausalLM.from_pretrained(ADAPTER_DIR)` finds the base and calls load_adapter: refused alike."""
    from transformers import AutoModelForCausalLM

    _adapter(llama_base, "linear_v").save_pretrained(tmp_path / "adapter")
    with pytest.raises(ValueError, match=r"knock adapters load through PEFT only"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")


def test_a_saved_module_without_its_tensor_is_one_line(llama_base, tmp_path):  # noqa: F811
    """#58 item 9: peft's bare `KeyError: 'base_model.model.lm_head.weight'` before."""
    folder = tmp_path / "adapter"
    _adapter(llama_base, "linear_v", modules_to_save=["lm_head"]).save_pretrained(folder)
    path = folder / "adapter_model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if "lm_head" not in k}
    save_file(tensors, path, metadata={"format": "pt"})
    stock = _stock(llama_base)
    before = _states(stock)
    with pytest.raises(ValueError, match=r"has no tensor base_model\.model\.lm_head\.weight of lm_head"):
        PeftModel.from_pretrained(stock, folder)
    _assert_unchanged(stock, before, "the stock model")


def test_kha_commands_refuse_the_same_hostile_file(llama_base, tmp_path, capsys):  # noqa: F811
    """`kha convert --adapter` and `kha eval --adapter` (`check_adapter_fits`, before any model runs) read the file
    themselves and accept knock tensors only."""
    from kha_hf.common.errors import KHAError
    from kha_hf.peft.adapter_files import check_adapter_fits
    from tests.cli.test_bad_input import one_line_error

    modules_to_save, extra = HOSTILE_FILES["lm_head.original_module"]
    _hostile(llama_base, tmp_path / "evil", modules_to_save, extra)
    err = one_line_error(
        capsys, ["convert", str(llama_base), str(tmp_path / "out"), "--adapter", str(tmp_path / "evil")], "convert"
    )
    assert "lm_head.original_module.weight is not a knock tensor" in err, err
    assert not (tmp_path / "out").exists()
    with pytest.raises(KHAError, match="is not a knock tensor"):
        check_adapter_fits(llama_base, tmp_path / "evil")
