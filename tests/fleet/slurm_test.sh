#!/usr/bin/env bash
# Fleet pre-tuning under a real Slurm: a single-node cluster
# (examples/fleet/local-slurm), a running `loom serve`, and
# `sbatch --array=0-3 examples/fleet/pretune.sbatch` against it, workers
# ranking offline for sm_80 (no GPU here: results marked untimed). One task
# is cancelled with scancel while it tunes. Checks: every (spec, direction)
# on the device model was uploaded exactly once across the array (the
# service's own count of PutTuning), the cancelled task's pair was finished
# by another task once its lease lapsed, and the service then serves every
# decision. Exit 77 (ctest: skipped) with the reason where Slurm cannot
# start here (not root, slurm-wlm missing).
#
#   tests/fleet/slurm_test.sh LOOM_BINARY SOURCE_DIR
set -euo pipefail
loom="$1"
source_dir="$2"
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || skip "Slurm's slurmd must run as root and these tests do not"
for program in slurmctld slurmd munged sbatch scancel squeue; do
  command -v "$program" >/dev/null || skip "$program is missing (scripts/setup installs slurm-wlm and munge)"
done

work="$(mktemp -d /tmp/loom-slurm-XXXXXX)"
serve_pid=""
cleanup() {
  [ -n "${SLURM_CONF:-}" ] && scancel --quiet "${job:-0}" 2>/dev/null || true
  "$source_dir/examples/fleet/local-slurm" stop "$work/slurm" || true
  [ -n "$serve_pid" ] && kill "$serve_pid" 2>/dev/null && wait "$serve_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

status=0
"$source_dir/examples/fleet/local-slurm" start "$work/slurm" || status=$?
[ $status = 3 ] && skip "Slurm cannot start here (local-slurm said why, above)"
[ $status = 0 ] || fail "local-slurm start exited $status"
# shellcheck disable=SC1091
source "$work/slurm/env"

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port="$(free_port)"
metrics_port="$(free_port)"
echo "test-token-0123456789abcdef" >"$work/token"
"$loom" serve --listen "127.0.0.1:$port" --cache-dir "$work/service" --token-file "$work/token" \
  --metrics-port "$metrics_port" >"$work/serve.log" 2>&1 &
serve_pid=$!
for _ in $(seq 300); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
  sleep 0.1
done
metric() {  # the sum of a metrics line's values (lines starting with $1)
  python3 - "$metrics_port" "$1" <<'EOF'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics").read().decode()
print(int(sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(sys.argv[2]))))
EOF
}

# Two small specs: four (spec, direction) pairs on the device model.
cat >"$work/specs.json" <<'EOF'
[{"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 32, "mask": "flat_causal", "window": 0,
  "collapse": "per_head", "dtype": "bfloat16"},
 {"heads": 2, "kv_heads": 2, "pseudo_heads": 2, "head_dim": 32, "mask": "flat_causal", "window": 8,
  "collapse": "per_head", "dtype": "bfloat16"}]
EOF
pairs=("spec 0" "spec 0 (backward)" "spec 1" "spec 1 (backward)")

export LOOM_SERVER="127.0.0.1:$port" LOOM_TOKEN_FILE="$work/token" LOOM_TARGET=sm_80 LOOM_BIN="$loom" \
  LOOM_SPECS="$work/specs.json" LOOM_CACHE_DIR="$work/workers" \
  LOOM_PRETUNE_ARGS="--tokens 256 --compile-top 1 --lease-seconds 6"
job="$(sbatch --parsable --gres=none --chdir="$source_dir" --array=0-3 --output="$work/task-%a.out" \
  "$source_dir/examples/fleet/pretune.sbatch")"
echo "submitted array job $job"

# The first task seen tuning is cancelled mid-tune.
victim=""
for _ in $(seq 1200); do
  for out in "$work"/task-*.out; do
    [ -f "$out" ] || continue
    last="$(tail -n 1 "$out")"
    if [[ "$last" == *": tuning" ]]; then
      victim="${out##*task-}"
      victim="${victim%.out}"
      pair="${last%: tuning}"
      break 2
    fi
  done
  [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && break  # every task ended already
  sleep 0.1
done
if [ -z "$victim" ]; then
  for out in "$work"/task-*.out; do echo "--- ${out##*/}"; cat "$out"; done
  fail "no task started tuning"
fi
scancel "${job}_${victim}"
echo "cancelled task $victim while it tuned '$pair'"

for _ in $(seq 600); do  # the array finishes (10 minutes at most)
  [ -z "$(squeue -h -j "$job" 2>/dev/null)" ] && break
  sleep 1
done
[ -z "$(squeue -h -j "$job")" ] || fail "the array did not finish: $(squeue -j "$job")"
for out in "$work"/task-*.out; do echo "--- ${out##*/}"; cat "$out"; done

grep -q "^$pair: tuned" "$work/task-$victim.out" && fail "task $victim finished '$pair' although it was cancelled"
grep -q "CANCELLED" "$work/task-$victim.out" || fail "task $victim does not say it was cancelled"
for p in "${pairs[@]}"; do
  count="$(cat "$work"/task-*.out | grep -c "^$p: tuned (untimed) and uploaded" || true)"
  [ "$count" = 1 ] || fail "'$p' was tuned and uploaded $count times across the array, not once"
done
finisher="$(grep -l "^$pair: tuned (untimed) and uploaded" "$work"/task-*.out)"
[ "$finisher" != "$work/task-$victim.out" ] || fail "no other task took over '$pair'"
uploads="$(metric 'loom_requests_total{method="PutTuning",code="OK"}')"
[ "$uploads" = "${#pairs[@]}" ] || fail "the service took $uploads uploads, not ${#pairs[@]}"

# The service serves every decision: a worker now finds nothing to do.
again="$("$loom" pretune --server "$LOOM_SERVER" --token-file "$work/token" --specs "$work/specs.json" \
  --target sm_80 --tokens 256 --no-wait)"
echo "$again" | grep -q "pretune: 0 tuned, ${#pairs[@]} skipped, 0 failed" || fail "after the array: $again"
echo "PASS: ${#pairs[@]} pairs tuned once each across the array; '$pair' finished by ${finisher##*/} after task $victim was cancelled"
