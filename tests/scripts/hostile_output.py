"""A worker whose output tries to hijack a terminal, plus a 1 MB line."""

import sys

print("\x1b]0;pwned\x07title")
print("\x1b[2Jclear \x1b[31mred\x1b[0m [bold]markup[/bold]")
sys.stdout.write("x" * 1_000_000 + "\n")
print("after the big line")
sys.stdout.buffer.write(b"bad utf8 \xff\xfe end\n")
