"""Tiny random multimodal models (image-text-to-text wrappers around a text decoder) and image inputs for them,
built as transformers' own model testers build theirs: a few layers, small sizes, each family's image inputs.

Each builder returns the stock config; `multimodal_inputs(config)` gives a batch whose image tokens match what the
vision tower produces, so the images really flow into the text decoder.
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForImageTextToText
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

IMAGE, VIDEO, START, END = 290, 291, 292, 293  # special token ids inside the tiny vocabulary of 300
TEXT = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
)
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}  # sums to head_dim / 2
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=32, num_heads=2, patch_size=2, temporal_patch_size=2)

# model_type -> (wrapper fields, text_config, vision_config); the text decoder's model_type is in its text_config
MULTIMODAL: dict[str, tuple[dict, dict, dict]] = {
    "gemma3": (  # SigLIP tower, bidirectional attention over image tokens (token_type_ids), sliding window
        dict(mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END),
        dict(TEXT, model_type="gemma3_text", query_pre_attn_scalar=24, sliding_window=5, layer_types=SLIDING),
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            image_size=28,
            patch_size=7,
            vision_use_head=False,  # as in Gemma 3 checkpoints: no SigLIP pooling head
        ),
    ),
    "qwen2_5_vl": (  # multimodal RoPE (3-D positions), windowed vision attention with a fused qkv
        dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END),
        dict(TEXT, model_type="qwen2_5_vl_text", rope_parameters=MROPE),
        dict(QWEN_VISION, out_hidden_size=64, window_size=8, fullatt_block_indexes=[1]),
    ),
    "qwen3_vl": (  # q/k norms, interleaved multimodal RoPE, deepstack visual features added inside the decoder
        dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END),
        dict(TEXT, model_type="qwen3_vl_text", rope_parameters=MROPE),
        dict(QWEN_VISION, out_hidden_size=64, num_position_embeddings=16, deepstack_visual_indexes=[0]),
    ),
    "mistral3": (  # Pixtral tower (with its own q_proj/k_proj/v_proj), patch merger, Mistral decoder
        dict(image_token_index=IMAGE, spatial_merge_size=2, vision_feature_layer=-1),
        dict(TEXT, model_type="mistral", sliding_window=5),
        dict(
            model_type="pixtral",
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            head_dim=16,
            image_size=28,
            patch_size=7,
        ),
    ),
    "idefics3": (  # SmolVLM's architecture: SigLIP-like tower, pixel shuffle, Llama decoder
        dict(image_token_id=IMAGE, scale_factor=2),
        dict(TEXT, model_type="llama"),
        dict(
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=7,
        ),
    ),
    "llama4": (  # no wrapper body: the decoder is a Llama4ForCausalLM inside; MoE, chunked attention, NoPE layers
        dict(image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END),
        dict(
            TEXT,
            model_type="llama4_text",
            intermediate_size_mlp=64,
            num_local_experts=2,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=8,
            use_qk_norm=True,
        ),
        dict(
            hidden_size=32,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=28,
            patch_size=7,
            vision_output_dim=32,
            pixel_shuffle_ratio=0.5,
            projector_input_dim=32,
            projector_output_dim=32,
        ),
    ),
}
MULTIMODAL["smolvlm"] = copy.deepcopy(MULTIMODAL["idefics3"])  # SmolVLM2: Idefics3's layout, its own classes
MULTIMODAL["qwen3_vl_moe"] = copy.deepcopy(MULTIMODAL["qwen3_vl"])
MULTIMODAL["qwen3_vl_moe"][1].update(
    model_type="qwen3_vl_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
)
MULTIMODAL_FAMILIES = sorted(MULTIMODAL)


def multimodal_config(model_type: str, **text_overrides):
    """A fresh tiny stock config of the multimodal family MODEL_TYPE."""
    fields, text, vision = (copy.deepcopy(part) for part in MULTIMODAL[model_type])
    text.update(text_overrides)
    text_config = CONFIG_MAPPING[text.pop("model_type")](**text)
    # the vision tower as a dict: the wrapper's config builds it with the class it expects
    config = CONFIG_MAPPING[model_type](text_config=text_config, vision_config=vision, **fields)
    config.tie_word_embeddings = False
    return config


def tiny_multimodal_model(model_type: str, seed: int = 0, attn_implementation: str = "eager", **text_overrides):
    """A random stock image-text-to-text model of MODEL_TYPE in eval mode, biases and norm weights moved off their
    init so that a knock in the wrong place shows."""
    torch.manual_seed(seed)
    config = multimodal_config(model_type, **text_overrides)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation=attn_implementation).eval()
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.copy_(1 + 0.2 * torch.randn(param.shape, generator=gen))
            elif param.dim() > 1 and not param.any():  # Gemma 3's projector starts at zero: images would not count
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def multimodal_inputs(config, batch: int = 2, seq: int = 14, seed: int = 0) -> dict[str, torch.Tensor]:
    """input_ids with one image per row (its tokens after a few text tokens) and that image's pixel inputs, in the
    form the family's forward takes them."""
    gen = torch.Generator().manual_seed(seed)
    model_type = getattr(config, "base_model_type", config.model_type)  # a KHA config names its family there
    ids = torch.randint(3, 280, (batch, seq), generator=gen)
    inputs: dict[str, torch.Tensor] = {}
    if model_type == "gemma3":
        n = config.mm_tokens_per_image
        inputs["pixel_values"] = torch.randn(batch, 3, 28, 28, generator=gen)
    elif model_type in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        vision = config.vision_config
        grid = (1, 4, 4)  # t, h, w patches of one image
        n = grid[1] * grid[2] // vision.spatial_merge_size**2
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        inputs["pixel_values"] = torch.randn(batch * grid[1] * grid[2], width, generator=gen)
        inputs["image_grid_thw"] = torch.tensor([grid] * batch)
    elif model_type == "mistral3":
        vision = config.vision_config
        n = (vision.image_size // vision.patch_size // config.spatial_merge_size) ** 2
        inputs["pixel_values"] = torch.randn(batch, 3, vision.image_size, vision.image_size, generator=gen)
        inputs["image_sizes"] = torch.tensor([[vision.image_size, vision.image_size]] * batch)
    elif model_type in ("idefics3", "smolvlm"):
        vision = config.vision_config
        n = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
        inputs["pixel_values"] = torch.randn(batch, 1, 3, vision.image_size, vision.image_size, generator=gen)
    elif model_type == "llama4":
        vision = config.vision_config
        n = int((vision.image_size // vision.patch_size) ** 2 * vision.pixel_shuffle_ratio**2)
        inputs["pixel_values"] = torch.randn(batch, 3, vision.image_size, vision.image_size, generator=gen)
    else:
        raise ValueError(f"no tiny inputs for {model_type}")
    ids[:, 2] = START
    ids[:, 3 : 3 + n] = IMAGE
    ids[:, 3 + n] = END
    inputs["input_ids"] = ids
    inputs["attention_mask"] = torch.ones_like(ids)
    if model_type == "gemma3":
        inputs["token_type_ids"] = (ids == IMAGE).long()  # image tokens attend to each other both ways
    if model_type in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"):
        inputs["mm_token_type_ids"] = (ids == IMAGE).long()  # what the processor returns: 1 marks image tokens
    return inputs


def text_decoder(model) -> torch.nn.Module:
    """The text decoder's body inside a multimodal model (the module holding the decoder `layers`)."""
    text_type = model.config.text_config.model_type

    def family(config) -> str | None:  # a KHA text decoder's config is a KHAConfig naming the family
        return getattr(config, "base_model_type", None) if config.model_type == "kha" else config.model_type

    found = [m for m in model.modules() if hasattr(m, "layers") and family(m.config) == text_type]
    assert len(found) == 1, [type(m).__name__ for m in found]
    return found[0]


def multimodal_logits(model, inputs: dict) -> torch.Tensor:
    """The logits of a multimodal model (stock or KHA) for INPUTS.

    Llama 4: transformers 5.24's `Llama4ForConditionalGeneration.forward` reads `outputs.image_outputs` from its
    language model's output, which has no such field: AttributeError for every input, stock model included. Its own
    steps up to the language model are run instead (image features, projector, placeholder scatter)."""
    if getattr(model.config, "base_model_type", model.config.model_type) != "llama4":
        return model(**inputs).logits
    try:
        return model(**inputs).logits  # transformers 5.16.1 (kha-hf's floor) runs Llama 4's own forward
    except AttributeError as err:
        if "image_outputs" not in str(err):
            raise
    ids = inputs["input_ids"]
    embeds = model.get_input_embeddings()(ids)
    features = model.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True).last_hidden_state
    flat = model.multi_modal_projector(features.view(-1, features.size(-1)))
    mask = model.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=flat)
    embeds = embeds.masked_scatter(mask, flat.to(embeds.dtype))
    return model.language_model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"]).logits


GEMMA3_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}


def save_gemma3_with_processor(folder, seed: int = 0, **text_overrides):
    """A tiny stock Gemma 3 checkpoint with a real `Gemma3Processor` (tiny BPE tokenizer with Gemma 3's image
    tokens, an image processor at 28 x 28) in FOLDER (TEXT_OVERRIDES: text_config fields); returns the model saved."""
    import json
    import tempfile

    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    from kha_hf.training.tokenizer import train_bpe_tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog " * 20], vocab_size=128).save_pretrained(
            scratch
        )
        path = f"{scratch}/tokenizer_config.json"
        config = json.loads(open(path).read())
        config["extra_special_tokens"] = GEMMA3_IMAGE_TOKENS  # what makes tokenizer.boi_token etc. exist
        with open(path, "w") as f:
            json.dump(config, f)
        tokenizer = AutoTokenizer.from_pretrained(scratch)
    image_processor = Gemma3ImageProcessorPil(size={"height": 28, "width": 28}, do_pan_and_scan=False)
    template = (
        "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>"
        "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}"
    )
    processor = Gemma3Processor(image_processor, tokenizer, chat_template=template, image_seq_length=4)
    model = tiny_multimodal_model("gemma3", seed=seed, **text_overrides)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA3_IMAGE_TOKENS.items()}
    model.config.boi_token_index, model.config.eoi_token_index = ids["boi_token"], ids["eoi_token"]
    model.config.image_token_index = ids["image_token"]
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model


def tiny_image():
    """A fixed 28 x 28 RGB image."""
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(0).rand(28, 28, 3) * 255).astype("uint8"))
