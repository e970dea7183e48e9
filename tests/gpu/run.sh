#!/usr/bin/env bash
# Run ON THE GPU MACHINE, after tests/gpu/prepare.sh here: checks every
# prepared kernel against the float64 reference (shared and freshly drawn
# cases, outputs poisoned), prints a short timing table, then measures the
# tuning candidates of a realistic spec and ranks them; the portable
# (mma.sync) and sm_90a (wgmma) paths side by side. Well under 9 minutes on
# one GPU. Logs go to $OUT (or /tmp/loom-gpu).
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH="$PWD/build/gpu-libs:${LD_LIBRARY_PATH:-}"
# The binaries were built elsewhere: point them at this checkout's data.
export LOOM_GPU_CASES="$PWD/tests/data/cases" LOOM_GPU_BUNDLES="$PWD/build/gpu-bundles"
export LOOM_CACHE_DIR="${TMPDIR:-/tmp}/loom-gpu-cache"
out=${OUT:-/tmp/loom-gpu}
mkdir -p "$out"

{
  date -u +"%Y-%m-%d %H:%M UTC"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true
} | tee "$out/device.txt"

# The ceilings first (PyTorch's bf16 matrix product and a device copy), so
# the tables below can be read against them.
timeout 45 python3 bench/ceilings.py "$out/ceilings.json" 2>&1 | tee "$out/ceilings.log"

# The portable kernels first, then the sm_90a (wgmma) ones apart: a kernel
# that hangs is killed by its own timeout and the other results survive.
LOOM_GPU_LABELS='default|materialized|single' timeout 130 build/bin/gpu_test --gtest_color=no 2>&1 |
  tee "$out/gpu_test.log"
portable=${PIPESTATUS[0]}
LOOM_GPU_LABELS='hopper.*' timeout 90 build/bin/gpu_test --gtest_color=no 2>&1 | tee "$out/gpu_test_hopper.log"
hopper=${PIPESTATUS[0]}
LOOM_GPU_LABELS='backward.*|materialized' timeout 60 build/bin/gpu_test --gtest_color=no \
  --gtest_filter='Gpu.EveryBackward*:Gpu.KeptForward*:Gpu.BackwardGraph*:Gpu.CallerWorkspaces*' 2>&1 |
  tee "$out/gpu_test_backward.log"
backward=${PIPESTATUS[0]}
# The decode step over a paged raw cache (mma.sync; on sm_90a wgmma too).
LOOM_GPU_LABELS='decode.*' timeout 60 build/bin/gpu_test --gtest_color=no --gtest_filter='Gpu.EveryDecode*:Gpu.DecodeGraph*:Gpu.DevicePageCheck*' 2>&1 |
  tee "$out/gpu_test_decode.log"
decode=${PIPESTATUS[0]}
tests=$((portable != 0 || hopper != 0 || backward != 0 || decode != 0))
timeout 130 build/bin/loom-gpu-bench build/gpu-bundles "$out/bench.json" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
timeout 110 build/bin/loom-gpu-tune build/gpu-bundles/tune 4096 1 2>&1 | tee "$out/tune.log"
tune=${PIPESTATUS[0]}
timeout 50 build/bin/loom-gpu-tune build/gpu-bundles/tune-backward 4096 1 35 2>&1 | tee "$out/tune-backward.log"
((tune |= PIPESTATUS[0]))
timeout 40 build/bin/loom-gpu-tune build/gpu-bundles/tune-decode 16384 8 25 2>&1 | tee "$out/tune-decode.log"
((tune |= PIPESTATUS[0]))
# Out-of-bounds and misaligned accesses of the sm_90a kernels, on one case.
memcheck=0
if command -v compute-sanitizer >/dev/null; then
  LOOM_GPU_LABELS='hopper.*' LOOM_GPU_CASES_MATCH='gqa-rope' timeout 75 compute-sanitizer --tool memcheck \
    --error-exitcode 3 build/bin/gpu_test --gtest_color=no --gtest_filter='Gpu.EveryBundle*' 2>&1 |
    tail -40 | tee "$out/memcheck.log"
  memcheck=${PIPESTATUS[0]}
fi

echo "gpu_test exit $portable (portable) $hopper (sm_90a) $backward (backward) $decode (decode), loom-gpu-bench exit $bench, loom-gpu-tune exit $tune, memcheck exit $memcheck"
exit $((tests != 0 || bench != 0 || tune != 0 || memcheck != 0))
