"""`kha tokenize SRC... --tokenizer NAME --output DIR`: prepare a corpus once (kha_hf.data.prepare), or adopt token
files another tool wrote with `--from-tokens` (kha_hf.data.adopt)."""

from __future__ import annotations

import argparse

from ._common import bounded_int, call_with, positive_float, positive_int

FORMATS = ("nanogpt", "megatron", "numpy")  # kha_hf.data.adopt.FORMATS (not imported: `kha --help` stays fast)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "tokenize",
        help="tokenize text once into a prepared corpus that kha train / kha ab --data read with flat memory",
        description="Read SRC (.txt/.md/.jsonl/.parquet files or folders, or a Hub dataset streamed with "
        "streaming=True) as a stream, tokenize it on every core, and write DIR: tokens.bin (uint16 or uint32 ids, "
        "documents joined with EOS), manifest.json (the tokenizer's fingerprint, token count, dtype, splits, each "
        "source's size and sha256, skipped documents) and the tokenizer. The stream's tail is set aside as the "
        "held-out split and the part before it as the validation split: neither ever trains. Empty documents, lines "
        "that are not UTF-8 and JSON lines without a string 'text' are skipped, counted in the manifest and "
        "reported. DIR appears only when the corpus is complete. With --from-tokens FORMAT, SRC are token files "
        "another tool wrote (nanoGPT .bin, a Megatron-LM PREFIX or its .bin/.idx, dolma/OLMo-core .npy): their ids are "
        "checked against the tokenizer and adopted without tokenizing again; one file whose bytes already are a "
        "corpus's becomes DIR/tokens.bin as a hard link (no copy; the file itself is never changed), anything else "
        "needs --copy.",
        epilog="examples:\n"
        "  kha tokenize ./books/ ./web.jsonl --tokenizer Qwen/Qwen3-0.6B --output ./corpus\n"
        '  kha tokenize ./wiki.parquet --tokenizer "$(kha assets --gguf)" --output ./corpus-smollm2\n'
        "  kha tokenize HuggingFaceFW/fineweb-edu --tokenizer ./my-model --output ./fineweb   # streamed\n"
        "  kha tokenize ./train.bin --from-tokens nanogpt --tokenizer gpt2 --output ./owt   # hard-linked\n"
        "  kha tokenize ./data/c4_text_document --from-tokens megatron --tokenizer ./my-model --output ./c4 --copy\n"
        "  kha train ./my-model-kha --data ./corpus --output ./trained",
    )
    p.add_argument(
        "sources",
        nargs="+",
        metavar="SRC",
        help="files, folders or a Hub dataset (owner/name); with --from-tokens, "
        "token files (a Megatron dataset: its PREFIX)",
    )
    p.add_argument("--tokenizer", required=True, metavar="NAME_OR_PATH", help="a model folder, Hub id or .gguf file")
    p.add_argument("--output", required=True, metavar="DIR", help="new folder for the prepared corpus")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR that kha wrote")
    p.add_argument(
        "--workers",
        type=bounded_int(256),
        default=None,
        help="tokenizing processes (default: one a core; not with --from-tokens)",
    )
    p.add_argument(
        "--eval-fraction",
        type=positive_float,
        default=0.05,
        help="share of the stream held out, and the same share for validation (default: %(default)s)",
    )
    p.add_argument(
        "--max-eval-tokens",
        type=positive_int,
        default=1 << 24,
        help="at most this many tokens in each of the two evaluation splits (default: %(default)s)",
    )
    p.add_argument("--split", default=None, help="the split of a Hub dataset to stream (default: train)")
    p.add_argument(
        "--from-tokens",
        choices=FORMATS,
        default=None,
        help="SRC are token files of this format: check their ids against --tokenizer and adopt them as DIR "
        "without tokenizing (nanogpt: uint16 .bin; megatron: PREFIX.bin + PREFIX.idx; numpy: dolma/OLMo-core .npy)",
    )
    p.add_argument(
        "--copy",
        action="store_true",
        help="with --from-tokens: write a new DIR/tokens.bin instead of hard-linking the source (needed across file "
        "systems, for several files, a .npy header, uint8/int64 ids, or Megatron documents without a final EOS, "
        "which then get one)",
    )
    p.add_argument(
        "--dtype",
        choices=("uint16", "uint32"),
        default=None,
        help="with --from-tokens numpy: the ids' type in raw files without a .npy header (default: uint16 if the "
        "tokenizer's ids fit, else uint32)",
    )
    p.set_defaults(func=run)


def run(args) -> None:
    from ..common.errors import KHAError

    options = vars(args)
    if args.from_tokens is not None:
        given = [f"--{name}" for name in ("split", "workers") if options[name] is not None]
        if given:
            raise KHAError(f"{' and '.join(given)} do not apply to --from-tokens: the token files are not tokenized")
        from ..data.adopt import adopt_tokens

        kept = {k: v for k, v in options.items() if k not in ("split", "workers")}
        call_with(adopt_tokens, argparse.Namespace(**kept), "sources", "tokenizer", "output")
        return
    given = [f"--{name}" for name in ("copy", "dtype") if options[name]]
    if given:
        raise KHAError(f"{' and '.join(given)} apply only with --from-tokens (adopting token files)")
    from ..data.prepare import tokenize_corpus

    kept = {k: v for k, v in options.items() if k not in ("from_tokens", "copy", "dtype")}
    kept["split"] = args.split or "train"
    call_with(tokenize_corpus, argparse.Namespace(**kept), "sources", "tokenizer", "output", hub_split="split")
