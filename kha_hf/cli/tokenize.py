"""`kha tokenize SRC... --tokenizer NAME --output DIR`: prepare a corpus once (kha_hf.data.prepare)."""

from __future__ import annotations

from ._common import bounded_int, call_with, positive_float, positive_int


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
        "reported. DIR appears only when the corpus is complete.",
        epilog="examples:\n"
        "  kha tokenize ./books/ ./web.jsonl --tokenizer Qwen/Qwen3-0.6B --output ./corpus\n"
        '  kha tokenize ./wiki.parquet --tokenizer "$(kha assets --gguf)" --output ./corpus-smollm2\n'
        "  kha tokenize HuggingFaceFW/fineweb-edu --tokenizer ./my-model --output ./fineweb   # streamed\n"
        "  kha train ./my-model-kha --data ./corpus --output ./trained",
    )
    p.add_argument("sources", nargs="+", metavar="SRC", help="files, folders or a Hub dataset (owner/name)")
    p.add_argument("--tokenizer", required=True, metavar="NAME_OR_PATH", help="a model folder, Hub id or .gguf file")
    p.add_argument("--output", required=True, metavar="DIR", help="new folder for the prepared corpus")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DIR that kha wrote")
    p.add_argument("--workers", type=bounded_int(256), default=None, help="tokenizing processes (default: one a core)")
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
    p.add_argument("--split", default="train", help="the split of a Hub dataset to stream")
    p.set_defaults(func=run)


def run(args) -> None:
    from ..data.prepare import tokenize_corpus

    call_with(tokenize_corpus, args, "sources", "tokenizer", "output", hub_split="split")
