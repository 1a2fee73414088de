# The two-GPU runs, one part per call (each within 10 minutes on a 2x H200 host, logs under OUT):
#   bash benchmarks/multi_gpu.sh ep     OUT   # expert-parallel layer vs one device, native ragged all-to-all
#   bash benchmarks/multi_gpu.sh losses OUT   # first 20 losses: data (2,1,1,1) and expert (1,2,1,1) vs one device
#   bash benchmarks/multi_gpu.sh train  OUT   # tokens/s, MFU, scaling efficiency: 1,1,1,1 / 2,1,1,1 / 1,2,1,1
#   bash benchmarks/multi_gpu.sh serve  OUT   # sharded greedy decode at batch 16 and 64 vs one device
# `train` compiles the three meshes' steps in parallel processes into one persistent compilation cache first (the
# host has 32 cores; ~200 s each for k3_gpu), then times them in one process that reads the cache.
set -u
part=${1:?part: ep, losses, train or serve}
out=${2:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
cache=/tmp/k3jax_jit_cache
common=(--config=k3_gpu --seq_len=4096 --muon_ns_dtype=bfloat16 --cache_dir=$cache)
case "$part" in
  ep)
    python3 -m benchmarks.ep_check --config=k3_gpu --tokens=8192 --mesh=1,2,1,1 2>&1 | tee "$out/ep_check.log" ;;
  losses)
    for mesh in 1,1,1,1 2,1,1,1 1,2,1,1; do
      XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m benchmarks.train_throughput "${common[@]}" --meshes $mesh \
        --global_batch=2 --compile_only > "$out/compile_losses_$mesh.log" 2>&1 &
    done
    wait
    python3 -m benchmarks.train_throughput "${common[@]}" --meshes 1,1,1,1 2,1,1,1 1,2,1,1 --global_batch=2 \
      --losses=20 --iters=1 --warmup=0 --out_dir="$out/losses" 2>&1 | grep -v '^[WI]0' | tee "$out/losses.log" ;;
  train)
    for mesh in 1,1,1,1 2,1,1,1 1,2,1,1; do
      XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m benchmarks.train_throughput "${common[@]}" --meshes $mesh \
        --batch_per_device=4 --grad_accum=16 --compile_only > "$out/compile_$mesh.log" 2>&1 &
    done
    wait
    python3 -m benchmarks.train_throughput "${common[@]}" --meshes 1,1,1,1 2,1,1,1 1,2,1,1 --batch_per_device=4 \
      --grad_accum=16 --iters=2 --warmup=1 --out_dir="$out/train" 2>&1 | grep -v '^[WI]0' | tee "$out/train.log" ;;
  serve)
    python3 -m benchmarks.sharded_decode --config=k3_gpu --meshes 1,2,1,1 2,1,1,1 --batches 16,64 \
      2>&1 | grep -v '^[WI]0' | tee "$out/serve.log" ;;
  *)
    echo "multi_gpu.sh: unknown part $part (ep, losses, train or serve)" >&2; exit 2 ;;
esac
