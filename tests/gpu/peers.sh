#!/usr/bin/env bash
# Run ON THE GPU MACHINE (a second device call after tests/gpu/run.sh, with
# the same carried files): loom against what an IHA user would otherwise run.
# Measures the ceilings, times PyTorch eager, FlexAttention and SDPA's flash
# and cuDNN backends on bench/peers.py's grid, forward and then a training
# step (forward + autograd backward), times loom's forward and backward
# kernels for the same problems, and writes both tables (and plots when
# matplotlib is there) to $OUT (or /tmp/loom-gpu), then decode and ragged steps against SDPA and
# FlexAttention over a materialised cache. About 11 minutes on one GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
export LD_LIBRARY_PATH="$PWD/build/gpu-libs:${LD_LIBRARY_PATH:-}"
out=${OUT:-/tmp/loom-gpu}
mkdir -p "$out"

timeout 45 python3 bench/ceilings.py "$out/ceilings.json" 2>&1 | tee "$out/ceilings.log"
timeout 240 python3 bench/peers.py --run "$out/peers.json" 2>&1 | tee "$out/peers.log"
peers=${PIPESTATUS[0]}
timeout 240 python3 bench/peers.py --run "$out/peers-backward.json" --backward 2>&1 | tee "$out/peers-backward.log"
((peers |= PIPESTATUS[0]))
timeout 150 build/bin/loom-gpu-bench build/gpu-bundles "$out/bench.json" 2>&1 | tee "$out/bench.log"
bench=${PIPESTATUS[0]}
# Decode: loom's raw-cache step against SDPA and FlexAttention over a materialised pseudo-head
# cache (peers-decode.json is rewritten after every problem, so a run cut short keeps its rows).
timeout 150 python3 bench/peers.py --run "$out/peers-decode.json" --decode --loom "$out/bench.json" 2>&1 |
  tee "$out/peers-decode.log"
((peers |= PIPESTATUS[0]))
# Ragged steps (prefill chunks beside decode tokens): loom's step against SDPA a sequence and
# FlexAttention over the packed sequences, with the bytes each step moves and loom's time over the floor.
timeout 150 python3 bench/peers.py --run "$out/peers-ragged.json" --ragged --loom "$out/bench.json" \
  --ceilings "$out/ceilings.json" 2>&1 | tee "$out/peers-ragged.log"
((peers |= PIPESTATUS[0]))
python3 bench/report.py --loom "$out/bench.json" --peers "$out/peers.json" --ceilings "$out/ceilings.json" \
  --plot "$out/tflops.png" | tee "$out/report.md"
python3 bench/report.py --loom "$out/bench.json" --peers "$out/peers-backward.json" --ceilings "$out/ceilings.json" \
  --plot "$out/tflops-training.png" | tee "$out/report-training.md"
echo "peers exit $peers, loom-gpu-bench exit $bench"
exit $((peers != 0 || bench != 0))
