#!/usr/bin/env bash
# `make demo`: the example training job on an embedded Redis (--standalone), 4 workers, one
# injected crash on the first attempt, the restart, and the run to success. In a terminal the
# console attaches to the job; without one the agent's own output and summary are shown.
set -euo pipefail
cd "$(dirname "$0")/.."
job="demo-$(date +%H%M%S)"
mkdir -p .demo
args=(--standalone --job-id "$job" --nproc-per-node 4 --max-restarts 3 --log-dir .demo/logs
      examples/train.py --steps 40 --crash-rank 2 --crash-step 12 --sleep 0.25
      --checkpoint-dir ".demo/ckpt-$job")

if [ -t 0 ] && [ -t 1 ] && python -c "import elastic_console.tui.app" 2>/dev/null; then
  log=".demo/$job.agent.log"
  elastic-agent "${args[@]}" >"$log" 2>&1 &
  agent=$!
  trap 'kill -TERM $agent 2>/dev/null || true; wait $agent 2>/dev/null || true' INT TERM
  url=""
  for _ in $(seq 1 200); do  # the agent prints its Redis URL once the server answers
    url=$(sed -n 's/.*standalone Redis on \(redis:[^;]*\);.*/\1/p' "$log" | head -n 1)
    [ -n "$url" ] && break
    sleep 0.05
  done
  if [ -z "$url" ]; then
    cat "$log"; echo "demo: the agent did not start its Redis" >&2; exit 1
  fi
  # After the job ends the agent keeps its Redis up while the console stays attached (up to
  # ELASTIC_STANDALONE_LINGER seconds): the console shows the end, then that Redis stopped.
  elastic-console attach "$job" --redis "$url" || true
  echo "detached (agent output in $log); waiting for the agent to exit"
  code=0
  wait "$agent" || code=$?
  tail -n 25 "$log"
  exit $code
else
  exec elastic-agent "${args[@]}"
fi
