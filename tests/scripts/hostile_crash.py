"""A worker that fails with escape sequences in its message, written to the error file in the
format torch's ``@record`` uses (without importing torch: the format is the protocol)."""

import json
import os
import sys
import time

MESSAGE = "RuntimeError: boom \x1b]0;PWNED\x07 \x1b[2J\x1b[31mred"

if os.environ.get("RANK") == "0":
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump({"message": {"message": MESSAGE, "extraInfo": {
            "py_callstack": "Traceback (most recent call last):\n  line 1\n" + MESSAGE,
            "timestamp": str(int(time.time()))}}}, f)
    sys.exit(1)
