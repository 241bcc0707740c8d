"""`python -m kha_hf ...` is the `kha` command (also what `accelerate launch -m kha_hf` runs)."""

import sys

from .cli import main

sys.exit(main())
