"""train.py with a crash on the first attempt: rank 1 raises at step 5 unless told otherwise.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/flaky.py --steps 20

The launcher restarts the workers once; they resume from the last checkpoint and finish.
Any train.py flag works here; a later ``--crash-rank``/``--crash-step`` overrides the defaults.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train import main

DEFAULTS = ["--crash-rank", "1", "--crash-step", "5"]

if __name__ == "__main__":
    main([*DEFAULTS, *sys.argv[1:]])
