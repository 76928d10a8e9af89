"""Prints the worker's collector state: how many objects it inherited frozen, and whether it
collects at all (for tests/test_preload.py)."""
import gc

print(gc.get_freeze_count() > 0, gc.isenabled())
