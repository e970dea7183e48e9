#!/usr/bin/env bash
# Run HERE (a machine with the build toolchain, no GPU needed): builds loom,
# then compiles the GPU test and benchmark kernels with NVRTC into
# build/gpu-bundles, and copies the one shared library the GPU binaries need
# beyond the base system into build/gpu-libs. tests/gpu/run.sh then runs on
# the GPU machine with those carried along (build/bin/gpu_test,
# build/bin/loom-gpu-bench, build/bin/loom-gpu-tune, build/gpu-bundles,
# build/gpu-libs).
#
#   tests/gpu/prepare.sh            # sm_90a (H100 / H200)
#   LOOM_GPU_ARCH=sm_80 tests/gpu/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
arch=${LOOM_GPU_ARCH:-sm_90a}
scripts/setup >/dev/null

out=build/gpu-bundles
rm -rf "$out" build/gpu-libs
mkdir -p "$out" build/gpu-libs
schedules=$(mktemp -d)
trap 'rm -rf "$schedules"' EXIT
echo '{}' >"$schedules/default.json"
echo '{"mix": "mix_materialized", "collapse": "collapse_separate", "stages": 3}' >"$schedules/materialized.json"
echo '{"block_n": 32, "stages": 1, "collapse": "collapse_fused"}' >"$schedules/single.json"

jobs=()
for case in tests/data/cases/*/; do
  name=$(basename "$case")
  for dtype in float16 bfloat16; do
    for schedule in default materialized single; do
      build/bin/loom compile --spec "$case/spec.json" --dtype "$dtype" --schedule "$schedules/$schedule.json" \
        --target "$arch" --out "$out/$name.$dtype.$schedule.pb" >/dev/null &
      jobs+=($!)
      if ((${#jobs[@]} >= $(nproc))); then wait "${jobs[0]}"; jobs=("${jobs[@]:1}"); fi
    done
  done
done
for job in "${jobs[@]}"; do wait "$job"; done

# Benchmarks: the paper's setting (H = P = 8, d = 64) at two lengths, and a
# grouped-query spec with a sliding window.
bench() {  # name tokens batch spec-json [schedule-json]
  echo "$4" >"$schedules/bench.json"
  echo "${5:-{\}}" >"$schedules/bench-schedule.json"
  build/bin/loom compile --spec "$schedules/bench.json" --schedule "$schedules/bench-schedule.json" --target "$arch" \
    --out "$out/bench.n$2b$3.$1.pb" >/dev/null
}
paper='{"heads": 8, "kv_heads": 8, "pseudo_heads": 8, "head_dim": 64, "mask": "flat_causal", "collapse": "per_head", "rope_theta": 10000, "dtype": "bfloat16"}'
bench h8p8d64-bf16-causal 1024 4 "$paper"
bench h8p8d64-bf16-causal 4096 1 "$paper"
bench h8p8d64-bf16-causal-materialized 4096 1 "$paper" '{"mix": "mix_materialized"}'
bench h8p8d64-bf16-causal-bn32 4096 1 "$paper" '{"block_n": 32}'
bench gqa-h16g4p4d128-fp16-w512 4096 2 \
  '{"heads": 16, "kv_heads": 4, "pseudo_heads": 4, "head_dim": 128, "mask": "flat_causal", "window": 512, "collapse": "per_head", "rope_theta": 500000, "dtype": "float16"}'

# A full tuning run on a realistic spec (the paper's setting at N = 4096):
# the 24 candidates the cost model ranks best, compiled here, measured there.
echo "$paper" >"$schedules/tune-spec.json"
build/bin/loom tune --spec "$schedules/tune-spec.json" --target "$arch" --tokens 4096 --compile-top 24 \
  --bundles "$out/tune" --out build/gpu-bundles/tune-offline.json >/dev/null

cp -L "$(ldd build/bin/gpu_test | awk '/libprotobuf/ {print $3}')" build/gpu-libs/
echo "prepared $(ls "$out" | wc -l) kernels for $arch in $out"
