#!/usr/bin/env bash
# Stop the vLLM server that scripts/vllm-serve.sh started (by its pid file only).
#
#   scripts/vllm-stop.sh          # same environment as vllm-serve.sh (VLLM_PORT, VLLM_RUN_DIR, ...)
#
# vllm-serve.sh starts the server with setsid, so its pid is also its process-group id; the
# group (the API server and its engine-core child) gets SIGTERM, then SIGKILL after
# VLLM_STOP_TIMEOUT seconds (default 30). Nothing else is touched.
set -euo pipefail

say() { printf '[vllm-stop] %s\n' "$*" >&2; }
die() { printf '[vllm-stop] ERROR: %s\n' "$*" >&2; exit 1; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${ROLLOUT_LEDGER_CACHE:-$repo_root/.cache}"
port="${VLLM_PORT:-18000}"
run_dir="${VLLM_RUN_DIR:-$cache/vllm-run}"
timeout_s="${VLLM_STOP_TIMEOUT:-30}"
pid_file="$run_dir/vllm-$port.pid"

if [[ ! -f "$pid_file" ]]; then
  say "nothing to stop: no pid file at $pid_file"
  exit 0
fi
pid="$(cat "$pid_file")"
[[ "$pid" =~ ^[0-9]+$ ]] || die "pid file $pid_file holds '$pid', not a pid"

if ! kill -0 "$pid" 2>/dev/null; then
  say "pid $pid is not running; removing $pid_file"
  rm -f -- "$pid_file"
  exit 0
fi

# Only signal the group if the pid really leads its own group (setsid in vllm-serve.sh).
target="$pid"
what="pid $pid"
if [[ "$(ps -o pgid= -p "$pid" 2>/dev/null | tr -d ' ')" == "$pid" ]]; then
  target="-$pid"
  what="process group $pid"
fi

group_alive() { kill -0 -- "$target" 2>/dev/null; }

say "stopping vLLM ($what) ..."
kill -TERM -- "$target" 2>/dev/null || true
deadline=$((SECONDS + timeout_s))
while group_alive && ((SECONDS < deadline)); do
  sleep 0.5
done
if group_alive; then
  say "still alive after ${timeout_s}s; sending SIGKILL"
  kill -KILL -- "$target" 2>/dev/null || true
  sleep 0.5
fi
group_alive && die "could not stop pid $pid"
rm -f -- "$pid_file"
say "stopped"
