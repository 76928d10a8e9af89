"""A module for --preload in the tests: its presence in sys.modules shows a forked worker.
Like some real modules it changes the environment at import; a forked worker must not see
that (its environment is the worker's, as after exec)."""
import os

os.environ["PRELOAD_MARKER_IMPORTED"] = "1"
