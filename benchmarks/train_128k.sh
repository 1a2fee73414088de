# `k3_gpu` training at T = 131,072 beside T = 4,096 on one H200, within one 10-minute call (logs under OUT):
#   bash benchmarks/train_128k.sh OUT
# Both steps are compiled at once in two processes into one persistent compilation cache (~200 s each), then
# timed one after the other reading it. Same flags at both lengths: B = 1, layer remat, the chunked loss head; each
# timed run also prints its step breakdown (--profile: kernel time by part, source line and kernel).
set -u
out=${1:?output directory}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
flags=(--config=k3_gpu --batch_per_device=1 --set remat_policy=layer --set loss_vocab_chunks=16
       --muon_ns_dtype=bfloat16 --cache_dir=/tmp/k3jax_jit_cache)
for t in 4096 131072; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m benchmarks.train_throughput "${flags[@]}" --seq_len=$t \
    --compile_only > "$out/compile_$t.log" 2>&1 &
done
wait
for t in 4096 131072; do
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python3 -m benchmarks.train_throughput "${flags[@]}" --seq_len=$t --iters=2 \
    --warmup=1 --profile --profile_steps=1 --out_dir="$out/t$t" 2>&1 | grep -v '^[WI]0' | tee "$out/train_$t.log"
done
