"""`kha ab`, the one call of the CLI: the checks both modes share (the seed range, `--variants` with `--knock`, an
option of one mode given in the other), then the from-scratch A/B or, with --from, continued training."""

from __future__ import annotations

from ..common.errors import KHAError
from ..common.seeds import MAX_SEED
from ..modeling.configuration_kha import DEFAULT_KNOCK
from .options import check_mode

SCRATCH_ARGS = ("knock", "output", "max_steps", "seq_len", "batch_size", "lr", "data", "seed", "seeds", "bf16")
SCRATCH_ARGS += ("overwrite", "variants", "logit_every", "spike_margin", "save_models", "max_eval_blocks", "eval_steps")
SCRATCH_ARGS += ("lr_scheduler", "warmup_steps", "warmup_ratio", "min_lr_ratio", "decay_ratio", "peak_flops")
SIZES = ("max_steps", "seq_len", "batch_size")


def run(args) -> dict:
    """The A/B the parsed command line ARGS asks for; its summary."""
    if args.seed + args.seeds - 1 > MAX_SEED:
        raise KHAError(f"--seed {args.seed} with --seeds {args.seeds} runs past the largest seed, {MAX_SEED}")
    if args.variants is not None and args.knock != DEFAULT_KNOCK:
        raise KHAError("--variants names every twin: leave --knock out (or add its preset to --variants)")
    check_mode(args)
    if not args.from_model:
        from .scratch import ab

        return ab(args.base or "cpu-tiny", **{name: getattr(args, name) for name in SCRATCH_ARGS})
    from ..training.presets import PRESETS
    from .continued import ContinuedAB, continued_ab

    sizes = {}
    if args.base is not None:  # a preset sets the run's size (the model is MODEL's)
        if args.base not in PRESETS:
            raise KHAError(f"with --from, the positional argument is a preset ({', '.join(PRESETS)}), not a config")
        sizes = {name: getattr(PRESETS[args.base], name) for name in SIZES}
    sizes.update({name: getattr(args, name) for name in SIZES if getattr(args, name) is not None})
    settings = ContinuedAB(
        args.from_model, knock=args.knock, arms=tuple(args.arms), grid_extensions=args.grid_extensions,
        lr_grid_full=tuple(args.lr_grid_full), lr_grid_small=tuple(args.lr_grid), data=args.data, seed=args.seed,
        seeds=args.seeds, run_eval=args.eval, limit=args.limit, tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code, run_cache=args.run_cache, **sizes,
    )  # fmt: skip
    output = args.output if args.output != "kha-ab" else "kha-ab-continued"
    return continued_ab(settings, output=output, overwrite=args.overwrite)
