"""The largest random seed the tools take (light: the CLI checks seeds with it)."""

MAX_SEED = 2**32 - 1  # numpy's seeds (which Trainer and lm-eval set) must lie in 0 .. 2**32 - 1
