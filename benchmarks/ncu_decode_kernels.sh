#!/usr/bin/env bash
# Nsight Compute counters for the decode step's heaviest Pallas kernels, on the GPU machine:
#     bash benchmarks/ncu_decode_kernels.sh [OUT_DIR] [KERNEL_REGEX] [-- decode_kernels_bench args...]
# Runs `benchmarks/decode_kernels_bench.py` (default: the fused KDA decode kernel and the plan-free expert kernels
# at k3_gpu B = 64, one variant each) under `ncu` and writes the per-kernel report (speed of light, memory workload,
# occupancy, launch statistics, warp stall reasons) to OUT_DIR/ncu_<regex-safe>.txt. Clocks are left as found
# (--clock-control none). Kernel times under ncu are replayed one kernel at a time: use them for the counters
# (achieved bandwidth, occupancy, stalls), not as step timings. NCU_LAUNCHES (default 24) caps the kernels profiled.
# JAX's up-front allocation of 75% of the GPU is turned off: ncu saves and restores the device memory in use around
# every replay (a 2026-12-02 run with it on crawled, was cut by its time limit, and the next process of that device
# command found no CUDA device). Run it last in a device command, with time to finish.
set -uo pipefail
out_dir=${1:-${OUT:-/tmp}}
regex=${2:-"kda_decode_fused|k3_assigned_glu|k3_assigned_down"}
shift $(( $# >= 2 ? 2 : $# ))
[[ ${1:-} == "--" ]] && shift
bench_args=("$@")
if (( ${#bench_args[@]} == 0 )); then
  bench_args=(--ops=kda,experts --rows=64 --chain=1 --iters=1 --rotate=2 --kda_variants=32-4
              --experts_tilings=16-64-128-4-4-4)
fi
ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [[ -z $ncu_bin ]]; then
  echo "ncu_decode_kernels.sh: ncu not found" >&2
  exit 1
fi
safe=$(echo "$regex" | tr -c 'A-Za-z0-9_\n' '_' | cut -c1-40)
K3_BENCH_NO_TRACE=1 XLA_PYTHON_CLIENT_PREALLOCATE=false "$ncu_bin" --clock-control none --target-processes all -k "regex:${regex}" --launch-count ${NCU_LAUNCHES:-24} \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  python3 benchmarks/decode_kernels_bench.py "${bench_args[@]}" > "${out_dir}/ncu_${safe}.txt" 2>&1
rc=$?
grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Waves Per SM|Grid Size|Shared Memory Configuration Size|Dynamic Shared" \
  "${out_dir}/ncu_${safe}.txt" | head -150
exit $rc
