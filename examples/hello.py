"""Hello-world worker: print one line and exit (no torch import). Used by bench/launch_bench.py."""

import os

print(f"hello from rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')}",
      flush=True)
