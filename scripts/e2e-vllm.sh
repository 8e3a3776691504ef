#!/usr/bin/env bash
# End-to-end tier against real vLLM (CPU build) serving SmolLM2-135M (issue #6 point 10,
# issue #11 points 4-6).
#
#   scripts/e2e-vllm.sh                  # everything: install/reuse, serve, test, stop
#   scripts/e2e-vllm.sh -k anthropic     # extra arguments go to pytest
#
# Steps, each timed:
#   1. scripts/vllm-env.sh              cached vLLM venv      (~2-4 min cold, 0.1 s warm)
#   2. scripts/smollm2-model.py         cached SmolLM2 model  (~40 s cold, 0.1 s warm)
#   3. scripts/vllm-serve.sh            vLLM on 127.0.0.1:$E2E_VLLM_PORT, --enforce-eager by
#                                       default (~40 s instead of ~1.5-2 min with torch.compile)
#   4. scripts/vllm-smoke.py            the token-id fields the proxy relies on; also takes the
#                                       eager server's slow first request (~13 s)
#   5. pytest tests/e2e                 ROLLOUT_LEDGER_VLLM_URL set: the tests start
#                                       `rollout-ledger serve` (SQLite file in a temp dir, and
#                                       Postgres when configured) in front of a recording shim
#                                       in front of vLLM; the OpenAI and Anthropic SDKs and the
#                                       agent frameworks (the `e2e` extra) drive rollouts through
#                                       it; an oracle checks every capture against vLLM's own
#                                       answers (never model text) and collects them.
#   6. stop vLLM (only the server this script started, by its pid file), drop the Postgres
#      database it created, remove its temp dir.  A per-framework table of delivered fractions
#      is printed (docs/vllm-e2e.md).
#
# Idempotent: caches are reused; every run starts its own vLLM and ledgers and stops them.
# Exit status: pytest's when it ran (0 = all passed), else 1.  One run at a time (a lock).
#
# Environment:
#   E2E_VLLM_PORT               vLLM port                          (default 18010; the
#                               developer default 18000 is left alone)
#   E2E_VLLM_EXTRA_ARGS         extra vLLM arguments               (default --enforce-eager;
#                               set to "" for the torch.compile server)
#   E2E_VLLM_START_TIMEOUT      seconds to wait for vLLM /health   (default 600)
#   E2E_KEEP_VLLM=1             leave vLLM running afterwards (stop: VLLM_PORT=$E2E_VLLM_PORT
#                               VLLM_RUN_DIR=<cache>/e2e-run scripts/vllm-stop.sh)
#   E2E_MODEL                   smollm2 (default) or gemma3: the second model, Gemma 3 270M with
#                               a different chat template (scripts/gemma3-model.py); the SmolLM2
#                               smoke step is skipped for it
#   E2E_SUPPLY_PREFIX=1         serve with `supply_prefix_token_ids: true` (prefix supply)
#   E2E_ROLLOUTS_PER_FRAMEWORK  tool-using rollouts per framework and backend (default 2, max 8)
#   E2E_REPORT_OUT              also copy the per-rollout report (JSON lines) to this file
#   ROLLOUT_LEDGER_TEST_PG_URL  also run every test on this Postgres database
#   E2E_PG_ADMIN_URL            or: create a fresh database on this server for the run and
#                               drop it afterwards (e.g. postgresql://postgres@127.0.0.1:5432/postgres)
#   ROLLOUT_LEDGER_CACHE        cache root (default <repo>/.cache), as for the vllm-*.sh scripts
#   E2E_PYTHON                  the project's Python (default .venv/bin/python; created, and
#                               given the test + e2e extras when they are missing)
# See docs/vllm-e2e.md.
set -euo pipefail

say() { printf '[e2e-vllm] %s\n' "$*" >&2; }
die() { printf '[e2e-vllm] ERROR: %s\n' "$*" >&2; exit 1; }

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo_root"
cache="${ROLLOUT_LEDGER_CACHE:-$repo_root/.cache}"
export ROLLOUT_LEDGER_CACHE="$cache"
port="${E2E_VLLM_PORT:-18010}"
extra_args="${E2E_VLLM_EXTRA_ARGS---enforce-eager}"
run_dir="$cache/e2e-run"
py="${E2E_PYTHON:-$repo_root/.venv/bin/python}"
case "${E2E_MODEL:-smollm2}" in
  smollm2) model_script="smollm2-model.py"; served="smol" ;;
  gemma3) model_script="gemma3-model.py"; served="gemma3" ;;
  *) die "E2E_MODEL must be smollm2 or gemma3, got '${E2E_MODEL}'" ;;
esac

t_all=$SECONDS
timings=()
phase_start=0
begin() { phase_start=$SECONDS; say "== $1"; }
record() { timings+=("$(printf '%-34s %5d s' "$1" $((SECONDS - phase_start)))"); }

mkdir -p "$run_dir"
exec 9>"$run_dir/e2e.lock"
flock -n 9 || die "another scripts/e2e-vllm.sh holds $run_dir/e2e.lock"

work="$(mktemp -d "${TMPDIR:-/tmp}/rollout-ledger-e2e.XXXXXX")"
started_vllm=0
created_db=""
status=0

vllm_env() { env VLLM_PORT="$port" VLLM_RUN_DIR="$run_dir" "$@"; }

cleanup() {
  status=$?
  if ((started_vllm)) && [[ "${E2E_KEEP_VLLM:-0}" != "1" ]]; then
    phase_start=$SECONDS
    vllm_env "$repo_root/scripts/vllm-stop.sh" || say "could not stop vLLM (see $run_dir)"
    record "stop vLLM"
  elif ((started_vllm)); then
    say "E2E_KEEP_VLLM=1: vLLM stays up at http://127.0.0.1:$port; stop it with:"
    say "  VLLM_PORT=$port VLLM_RUN_DIR=$run_dir scripts/vllm-stop.sh"
  fi
  if [[ -n "$created_db" ]]; then
    "$py" - "$E2E_PG_ADMIN_URL" "$created_db" <<'PY' || say "could not drop database $created_db"
import asyncio, sys, asyncpg
async def main(url, db):
    c = await asyncpg.connect(url)
    await c.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    await c.close()
asyncio.run(main(*sys.argv[1:]))
PY
  fi
  if ((status == 0)); then
    rm -rf -- "$work"
  else
    say "kept $work for diagnosis (serve logs, collect input/output, report)"
    say "vLLM log: $run_dir/vllm-$port.log"
  fi
  say "timings:"
  for line in "${timings[@]}"; do say "  $line"; done
  say "  $(printf '%-34s %5d s' total $((SECONDS - t_all)))"
  if ((status == 0)); then say "PASSED"; else say "FAILED (exit $status)"; fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# 0. the project's own environment (pytest, the openai and anthropic SDKs, the frameworks)
if [[ ! -x "$py" ]]; then
  begin "creating .venv"
  "${PYTHON:-python3}" -m venv "$repo_root/.venv"
  py="$repo_root/.venv/bin/python"
  record "project venv"
fi
if ! "$py" -c 'import pytest, openai, anthropic, agents, langgraph.prebuilt, langchain_openai' \
  2>/dev/null; then
  begin "installing rollout-ledger[test,e2e] into $("$py" -c 'import sys; print(sys.prefix)')"
  "$py" -m pip install -q --disable-pip-version-check -e '.[test,e2e]' 2>&1 \
    | grep -v '^WARNING: Location' || true
  record "pip install .[test,e2e]"
fi

# 1-2. vLLM venv and model (cached)
begin "vLLM venv (scripts/vllm-env.sh)"
venv="$("$repo_root/scripts/vllm-env.sh")"
record "vllm-env.sh"
begin "model (scripts/$model_script)"
model_dir="$("$venv/bin/python" "$repo_root/scripts/$model_script")"
record "$model_script"

# 3. vLLM.  A server left in this run dir by an interrupted earlier run is reused (and then
# stopped like one started now): this dir and port belong to this script only.
begin "vLLM server on port $port (${extra_args:-torch.compile})"
if [[ -f "$run_dir/vllm-$port.pid" ]]; then
  say "a server from an earlier run is recorded in $run_dir; reusing it if healthy"
fi
started_vllm=1
url="$(vllm_env SMOLLM2_HF_DIR="$model_dir" VLLM_VENV="$venv" VLLM_EXTRA_ARGS="$extra_args" \
  VLLM_SERVED_NAME="$served" VLLM_START_TIMEOUT="${E2E_VLLM_START_TIMEOUT:-600}" \
  "$repo_root/scripts/vllm-serve.sh")"
record "vllm-serve.sh (until /health)"
# A server reused from an interrupted run may serve another model.
"$py" - "$url" "$served" <<'PY' || die "the vLLM at $url does not serve '$served' (stop it first)"
import sys, httpx
names = [m["id"] for m in httpx.get(sys.argv[1] + "/v1/models", timeout=30).json()["data"]]
sys.exit(0 if sys.argv[2] in names else 1)
PY

# 4. smoke: the fields capture relies on, and the eager server's slow first request
if [[ "$served" == "smol" ]]; then
  begin "vLLM smoke (scripts/vllm-smoke.py)"
  "$py" "$repo_root/scripts/vllm-smoke.py" --base-url "$url" >&2
  record "vllm-smoke.py"
fi

# Postgres (optional)
if [[ -z "${ROLLOUT_LEDGER_TEST_PG_URL:-}" && -n "${E2E_PG_ADMIN_URL:-}" ]]; then
  created_db="rl_e2e_$(date +%s)_$$"
  "$py" - "$E2E_PG_ADMIN_URL" "$created_db" <<'PY' || die "cannot create a database on E2E_PG_ADMIN_URL"
import asyncio, sys, asyncpg
async def main(url, db):
    c = await asyncpg.connect(url, timeout=10)
    await c.execute(f'CREATE DATABASE "{db}"')
    await c.close()
asyncio.run(main(*sys.argv[1:]))
PY
  export ROLLOUT_LEDGER_TEST_PG_URL="${E2E_PG_ADMIN_URL%/*}/$created_db"
fi
if [[ -n "${ROLLOUT_LEDGER_TEST_PG_URL:-}" ]]; then
  say "ledgers: SQLite and Postgres (${ROLLOUT_LEDGER_TEST_PG_URL%%@*}@...)"
else
  say "ledgers: SQLite only (set ROLLOUT_LEDGER_TEST_PG_URL or E2E_PG_ADMIN_URL for Postgres)"
fi

# 5. the end-to-end tests
begin "pytest tests/e2e (supply_prefix_token_ids: ${E2E_SUPPLY_PREFIX:-0})"
report="$work/report.jsonl"
set +e
ROLLOUT_LEDGER_VLLM_URL="$url" ROLLOUT_LEDGER_E2E_REPORT="$report" TMPDIR="$work" \
  ROLLOUT_LEDGER_VLLM_MODEL="$served" E2E_REQUIRE_FRAMEWORKS=1 \
  "$py" -m pytest -q -s -p no:cacheprovider -m vllm --basetemp="$work/pytest" \
  "$repo_root/tests/e2e" "$@"
status=$?
set -e
record "pytest (e2e rollouts)"

if [[ -s "$report" ]]; then
  "$py" - "$report" >&2 <<'PY'
import json, sys
from collections import defaultdict
rows = [json.loads(line) for line in open(sys.argv[1], encoding="utf-8")]
print("[e2e-vllm] rollouts:")
for r in rows:
    calls = r["calls"]
    reasons = ",".join(r["mask_reasons"]) or "-"
    finish = "/".join(c["finish"] for c in calls)
    print(f"[e2e-vllm]   {r['backend']:8} {r['name']:24} {r['outcome']:9} mask={reasons:16} "
          f"calls={len(calls)} tools={r['tool_calls']} drift@{[d['pos'] for d in r['drifts']]} "
          f"fraction={r['delivered_fraction']} finish={finish} {r['seconds']:5.1f} s "
          f"{r['stopped_by']}")
groups = defaultdict(list)
for r in rows:
    groups[(r["framework"], r["supply_prefix"])].append(r)
print("[e2e-vllm] per framework (tool-using = a tool call before the last call; 0 false "
      "deliveries is asserted by the oracle for every rollout):")
print(f"[e2e-vllm]   {'framework':22} {'prefix':6} {'rollouts':>8} {'tool-using':>10} "
      f"{'delivered':>9} {'tool-using delivered':>20} {'mean delivered_fraction':>23}")
for (fw, prefix), rs in sorted(groups.items()):
    tool = [r for r in rs if r["tool_using"]]
    dl = sum(r["outcome"] == "delivered" for r in rs)
    tdl = sum(r["outcome"] == "delivered" for r in tool)
    mean = sum(r["delivered_fraction"] or 0 for r in rs) / len(rs)
    print(f"[e2e-vllm]   {fw:22} {'on' if prefix else 'off':6} {len(rs):8} {len(tool):10} "
          f"{dl:9} {f'{tdl}/{len(tool)}':>20} {mean:23.2f}")
PY
  if [[ -n "${E2E_REPORT_OUT:-}" ]]; then cp -- "$report" "$E2E_REPORT_OUT"; fi
fi
exit "$status"
