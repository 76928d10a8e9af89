"""A --preload module that appends this process's pid to $PRELOAD_COUNT_FILE when it is
imported: how many interpreters imported the preload (forked children share the import)."""
import os

with open(os.environ["PRELOAD_COUNT_FILE"], "a") as f:
    f.write(f"{os.getpid()}\n")
