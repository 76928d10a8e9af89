"""examples/crash_timing.py for workers that ``import torch`` (launch_bench.py's figure b2).

The import comes first, at the top level as in a training script, so each worker's
``start`` timestamp is taken once torch is imported: "running again" means ready to train.
"""

import runpy
import sys
from pathlib import Path

import torch  # noqa: F401 - the point of this worker

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "crash_timing.py"
sys.argv[0] = str(EXAMPLE)
runpy.run_path(str(EXAMPLE), run_name="__main__")
