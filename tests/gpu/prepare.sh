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
# The portable path (mma.sync) under three schedules, and on sm_90a the
# wgmma path (TMA + warp specialisation) under three more where head_dim
# allows it (a multiple of 64).
echo '{"engine": "engine_mma"}' >"$schedules/default.json"
echo '{"engine": "engine_mma", "mix": "mix_materialized", "collapse": "collapse_separate", "stages": 3}' \
  >"$schedules/materialized.json"
echo '{"engine": "engine_mma", "block_n": 32, "stages": 1, "collapse": "collapse_fused"}' >"$schedules/single.json"
echo '{"engine": "engine_wgmma"}' >"$schedules/hopper.json"
echo '{"engine": "engine_wgmma", "mix": "mix_fused", "warps": 4, "block_m": 64, "block_n": 64, "stages": 3}' \
  >"$schedules/hopper-fused.json"
echo '{"engine": "engine_wgmma", "warps": 12, "block_m": 192, "block_n": 64, "stages": 2, "collapse": "collapse_fused"}' \
  >"$schedules/hopper-wide.json"

jobs=()
for case in tests/data/cases/*/; do
  name=$(basename "$case")
  head_dim=$(grep -o '"head_dim": *[0-9]*' "$case/spec.json" | grep -o '[0-9]*$')
  pseudo=$(grep -o '"pseudo_heads": *[0-9]*' "$case/spec.json" | grep -o '[0-9]*$')
  labels="default materialized single"
  if [[ $arch == sm_90a && $((head_dim % 64)) == 0 ]]; then
    labels+=" hopper"
    ((64 % pseudo == 0)) && labels+=" hopper-fused"
    ((192 % pseudo == 0)) && labels+=" hopper-wide"
  fi
  for dtype in float16 bfloat16; do
    for schedule in $labels; do
      build/bin/loom compile --spec "$case/spec.json" --dtype "$dtype" --schedule "$schedules/$schedule.json" \
        --target "$arch" --out "$out/$name.$dtype.$schedule.pb" >/dev/null &
      jobs+=($!)
      if ((${#jobs[@]} >= $(nproc))); then wait "${jobs[0]}"; jobs=("${jobs[@]:1}"); fi
    done
  done
done
# The backward of each shared backward case, dq in its own launch (the
# default: on sm_90a the wgmma backward where head_dim is 64 to 128 in 16s,
# 192 or 256, as bwd-gqa-d64-window's; mma.sync elsewhere) and by atomic
# adds (mma.sync).
echo '{}' >"$schedules/backward.json"
echo '{"dq": "dq_atomic"}' >"$schedules/backward-atomic.json"
for case in tests/data/cases/bwd-*/; do
  name=$(basename "$case")
  for dtype in float16 bfloat16; do
    for label in backward backward-atomic; do
      build/bin/loom compile --spec "$case/spec.json" --dtype "$dtype" --backward --target "$arch" \
        --schedule "$schedules/$label.json" --out "$out/$name.$dtype.$label.pb" >/dev/null &
      jobs+=($!)
      if ((${#jobs[@]} >= $(nproc))); then wait "${jobs[0]}"; jobs=("${jobs[@]:1}"); fi
    done
  done
done
# A wide head's backward (head_dim 256 and 192: the gradient columns in
# parts, a CTA each; on sm_90a the wgmma backward, dq whole) and one between
# swizzle atoms (96: on sm_90a tiles of two atoms, zeros past head_dim),
# both dq strategies, checked on drawn cases alone (drawn-*: no shared case
# has such a head).
for d in 256 192 96; do
  echo '{"heads": 4, "kv_heads": 2, "pseudo_heads": 2, "head_dim": '$d', "mask": "flat_causal", "collapse": "per_head", "rope_theta": 10000, "dtype": "bfloat16"}' \
    >"$schedules/drawn-d$d.json"
  for label in backward backward-atomic; do
    build/bin/loom compile --spec "$schedules/drawn-d$d.json" --backward --target "$arch" \
      --schedule "$schedules/$label.json" --out "$out/drawn-d$d.bfloat16.$label.pb" >/dev/null
  done
done
# The decode step over a paged raw cache (mma.sync on every arch) of each
# shared case; on sm_90a also the wgmma step, whole and split four ways,
# where head_dim allows it (a multiple of 64).
echo '{"engine": "engine_wgmma"}' >"$schedules/decode-wgmma.json"
echo '{"engine": "engine_wgmma", "kv_splits": 4}' >"$schedules/decode-wgmma-split.json"
for case in tests/data/cases/*/; do
  name=$(basename "$case")
  grep -Eq '"varlen": *true' "$case/spec.json" && continue  # packed documents: no decode step
  labels=(decode)
  if [[ $arch == sm_90a ]] && grep -Eq '"head_dim": *(64|128|192|256)[,} ]' "$case/spec.json"; then
    labels+=(decode-wgmma decode-wgmma-split)
  fi
  for dtype in float16 bfloat16; do
    for label in "${labels[@]}"; do
      schedule=()
      [[ $label != decode ]] && schedule=(--schedule "$schedules/$label.json")
      build/bin/loom compile --spec "$case/spec.json" --dtype "$dtype" --decode --target "$arch" "${schedule[@]}" \
        --out "$out/$name.$dtype.$label.pb" >/dev/null &
      jobs+=($!)
      if ((${#jobs[@]} >= $(nproc))); then wait "${jobs[0]}"; jobs=("${jobs[@]:1}"); fi
    done
  done
done
for job in "${jobs[@]}"; do wait "$job"; done

# Benchmarks: the paper's setting (H = P = 8, d = 64) at two lengths, and a
# grouped-query spec with a sliding window; on sm_90a each beside its
# portable-path twin, and the long, windowless d = 128 setting (N * P =
# 16384) the Hopper path is judged on.
bench() {  # name tokens batch spec-json [schedule-json [extra flags]]
  echo "$4" >"$schedules/bench-$1.json"
  echo "${5:-{\}}" >"$schedules/bench-schedule-$1.json"
  build/bin/loom compile --spec "$schedules/bench-$1.json" --schedule "$schedules/bench-schedule-$1.json" \
    --target "$arch" ${6:-} --out "$out/bench.n$2b$3.$1.pb" >/dev/null
}
paper='{"heads": 8, "kv_heads": 8, "pseudo_heads": 8, "head_dim": 64, "mask": "flat_causal", "collapse": "per_head", "rope_theta": 10000, "dtype": "bfloat16"}'
d128='{"heads": 8, "kv_heads": 8, "pseudo_heads": 4, "head_dim": 128, "mask": "flat_causal", "collapse": "per_head", "rope_theta": 10000, "dtype": "bfloat16"}'
gqa='{"heads": 16, "kv_heads": 4, "pseudo_heads": 4, "head_dim": 128, "mask": "flat_causal", "window": 512, "collapse": "per_head", "rope_theta": 500000, "dtype": "float16"}'
mma='{"engine": "engine_mma"}'
bench h8p8d64-bf16-causal-mma 1024 4 "$paper" "$mma"
bench h8p8d64-bf16-causal-mma 4096 1 "$paper" "$mma"
bench h8p8d64-bf16-causal-mma-materialized 4096 1 "$paper" '{"engine": "engine_mma", "mix": "mix_materialized"}'
bench gqa-h16g4p4d128-fp16-w512-mma 4096 2 "$gqa" "$mma"
bench h8p4d128-bf16-causal-mma 4096 1 "$d128" "$mma"
# The backward (timed whole, recomputation included), and beside each the
# forward that keeps what it reads (NAME-keep: loom.torch's default training
# step; loom-gpu-bench times the backward again from what that forward kept).
keep='{"mix": "mix_materialized", "collapse": "collapse_separate"}'
backward_bench() {  # name tokens batch spec-json schedule-json
  bench "$1" "$2" "$3" "$4" "$5" --backward
  bench "$1-keep" "$2" "$3" "$4" "$keep"
}
backward_bench h8p8d64-bf16-causal-backward 4096 1 "$paper" '{}'
backward_bench h8p8d64-bf16-causal-backward-atomic 4096 1 "$paper" '{"dq": "dq_atomic"}'
backward_bench h8p4d128-bf16-causal-backward 4096 1 "$d128" '{}'
backward_bench gqa-h16g4p4d128-fp16-w512-backward 4096 2 "$gqa" '{}'
backward_bench h8p4d256-bf16-causal-backward 4096 1 "${d128/\"head_dim\": 128/\"head_dim\": 256}" '{}'
backward_bench h8p4d192-bf16-causal-backward 4096 1 "${d128/\"head_dim\": 128/\"head_dim\": 192}" '{}'
if [[ $arch == sm_90a ]]; then
  bench h8p8d64-bf16-causal-wgmma 1024 4 "$paper"
  bench h8p8d64-bf16-causal-wgmma 4096 1 "$paper"
  bench h8p8d64-bf16-causal-wgmma-fused 4096 1 "$paper" '{"mix": "mix_fused"}'
  bench gqa-h16g4p4d128-fp16-w512-wgmma 4096 2 "$gqa"
  bench h8p4d128-bf16-causal-wgmma 4096 1 "$d128"
  bench h8p4d128-bf16-causal-wgmma-s3 4096 1 "$d128" '{"stages": 3}'
  bench h8p4d128-fp16-causal-wgmma 4096 1 "${d128/bfloat16/float16}"
fi

# The peer comparison's grid (bench/peers.py): loom's forward and backward
# kernels for each problem, with the schedules the compiler picks for the
# arch (bench/report.py adds the two for a training step).
python3 bench/peers.py --emit "$schedules/peers" >/dev/null
jobs=()
while read -r name tokens batch; do
  for direction in forward backward; do
    if [[ $direction == forward ]]; then
      bench "$name" "$tokens" "$batch" "$(cat "$schedules/peers/$name.json")" &
    else
      backward_bench "$name-backward" "$tokens" "$batch" "$(cat "$schedules/peers/$name.json")" '{}' &
    fi
    jobs+=($!)
    if ((${#jobs[@]} >= $(nproc))); then wait "${jobs[0]}"; jobs=("${jobs[@]:1}"); fi
  done
done <"$schedules/peers/problems.txt"
for job in "${jobs[@]}"; do wait "$job"; done
# The decode grid (bench/peers.py --decode): loom's step over a raw paged
# cache (the default, mma.sync), and on sm_90a the wgmma step beside it.
while read -r name cached batch; do
  build/bin/loom compile --spec "$schedules/peers/$name.json" --decode --target "$arch" \
    --out "$out/bench-decode.c${cached}b${batch}.$name.pb" >/dev/null &
  jobs+=($!)
  if [[ $arch == sm_90a ]]; then
    build/bin/loom compile --spec "$schedules/peers/$name.json" --decode --target "$arch" \
      --schedule "$schedules/decode-wgmma.json" --out "$out/bench-decode.c${cached}b${batch}.$name-wgmma.pb" \
      >/dev/null 2>&1 || true &  # head dims wgmma cannot take have no wgmma row
    jobs+=($!)
  fi
  if ((${#jobs[@]} >= $(nproc))); then wait "${jobs[0]}"; jobs=("${jobs[@]:1}"); fi
done <"$schedules/peers/decode-problems.txt"
for job in "${jobs[@]}"; do wait "$job"; done
# The ragged grid (bench/peers.py --ragged): loom's default step over a raw
# paged cache, the sequences' counts beside each bundle for loom-gpu-bench.
while read -r name cached fresh; do
  printf '%s\n%s\n' "$cached" "$fresh" >"$out/bench-ragged.$name.txt"
  build/bin/loom compile --spec "$schedules/peers/$name.json" --decode --target "$arch" \
    --out "$out/bench-ragged.$name.pb" >/dev/null &
  jobs+=($!)
  if ((${#jobs[@]} >= $(nproc))); then wait "${jobs[0]}"; jobs=("${jobs[@]:1}"); fi
done <"$schedules/peers/ragged-problems.txt"
for job in "${jobs[@]}"; do wait "$job"; done

# A full tuning run on a realistic spec (the paper's setting at N = 4096):
# the 24 candidates the cost model ranks best, compiled here, measured there.
echo "$paper" >"$schedules/tune-spec.json"
# The backward's tuning on the same spec: its 8 best candidates (dq separate
# and atomic among them).
build/bin/loom tune --spec "$schedules/tune-spec.json" --backward --target "$arch" --tokens 4096 --compile-top 8 \
  --bundles "$out/tune-backward" --out build/gpu-bundles/tune-backward-offline.json >/dev/null
build/bin/loom tune --spec "$schedules/tune-spec.json" --target "$arch" --tokens 4096 --compile-top 24 \
  --bundles "$out/tune" --out build/gpu-bundles/tune-offline.json >/dev/null
# The decode step's tuning on the same spec: 8 sequences over caches of 16k
# tokens, its 8 best-ranked candidates (splits among them).
build/bin/loom tune --spec "$schedules/tune-spec.json" --decode raw --target "$arch" --tokens 16384 --batch 8 \
  --compile-top 8 --bundles "$out/tune-decode" --out build/gpu-bundles/tune-decode-offline.json >/dev/null

cp -L "$(ldd build/bin/gpu_test | awk '/libprotobuf/ {print $3}')" build/gpu-libs/
echo "prepared $(ls "$out" | wc -l) kernels for $arch in $out"
