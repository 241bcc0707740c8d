"""A small byte-level BPE tokenizer trained on the run's own text, for from-scratch A/B runs and tests."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast


def train_bpe_tokenizer(documents: list[str], vocab_size: int = 4096) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) with `<|endoftext|>` as BOS/EOS/PAD; deterministic for the same text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
