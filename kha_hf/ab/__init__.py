"""`kha ab`: a baseline against its KHA twin, trained the same way, compared over seeds.

Two modes, apart: from scratch (`scratch.py`: `kha ab [PRESET] [--variants ...]`, one baseline and its twins on the
same initial weights) and continued training from a real checkpoint (`continued.py`: `kha ab --from MODEL`, arms
each at its tuned learning rate). `command.py` is the CLI's one call: the checks both share, then one mode.
`options.py` (what the command takes, light for `--help`), `variants.py` (the paper's ablation rows), `arm.py` (one
arm trained: `ArmRun`, `train_arm`), `cache.py` (finished runs kept and read back), `report.py` (what both modes
report), `stability.py`, `scratch_report.py` and `continued_report.py` (what each reports of its own).
"""
