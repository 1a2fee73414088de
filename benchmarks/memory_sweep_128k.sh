# Compiled memory of the `k3_gpu` training step at T = 131,072 on one GPU, per variant (compile only; a 10-minute
# call holds ~3 variants on an H100, whose compile came within 2 GiB of the H200's in RESULTS.md 2026-12-05):
#   bash benchmarks/memory_sweep_128k.sh OUT base lhs_off flash ...
# Variants: base (the flags below); lhs_off (XLA's latency-hiding scheduler off); no_hfusion (XLA's horizontal
# fusion passes off: a horizontal fusion keeps every input of the kernels it merges live until it runs); flash (the
# blockwise MLA attention instead of cuDNN); chunked (the XLA chunked KDA core); no_mtp (without the MTP head);
# tie_off (layer gradients not tied to the layer's input gradient, k3jax/layers/grad_order.py); slots64 (64 cuDNN
# document slots, the former default: a 72 GiB attention workspace); moe_chunk (the
# routed experts in pieces of 32,768 tokens, moe_token_chunk); kernels (the fused
# KDA prologue and AttnRes read kernels). Each writes OUT/VARIANT.log (the per-device line: arguments +
# temporaries) and XLA's memory-usage report, buffer assignment and HLO of the step (gzipped) for
# `benchmarks/hlo_liveness.py`.
# Compiles run one after another: several at once on one GPU run out of memory while autotuning.
# Without a GPU: TOPOLOGY=h200 bash benchmarks/memory_sweep_128k.sh OUT ... compiles with `train.py --compile_only
# --topology=h200` instead (jax's CUDA plugin; ~2.5 min a variant on two CPU cores; cuDNN's attention workspace
# added from its formula, the Newton-Schulz operands in f32).
set -u
out=${1:?output directory}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
common=(--config=k3_gpu --seq_len=131072 --set remat_policy=layer --set loss_vocab_chunks=16 --compile_only)
if [ -n "${TOPOLOGY:-}" ]; then
  cmd=(python3 train.py "${common[@]}" --topology="$TOPOLOGY" --batch_size=1)
  no_mtp=--nomtp
else
  cmd=(python3 -m benchmarks.train_throughput "${common[@]}" --batch_per_device=1 --muon_ns_dtype=bfloat16
       --cache_dir=)
  no_mtp=--no_mtp
fi
for variant in "$@"; do
  extra=()
  xla=""
  case "$variant" in
    base) ;;
    lhs_off) xla="--xla_gpu_enable_latency_hiding_scheduler=false" ;;
    no_hfusion) xla="--xla_disable_hlo_passes=gpu_horizontal_loop_fusion,gpu_horizontal_input_fusion" ;;
    flash) extra=(--set mla_attention_impl=flash) ;;
    chunked) extra=(--set kda_impl=chunked) ;;
    no_mtp) extra=("$no_mtp") ;;
    slots64) extra=(--set mla_cudnn_max_segments=64) ;;
    tie_off) extra=(--set tie_layer_gradients=false) ;;
    moe_chunk) extra=(--set moe_token_chunk=32768) ;;
    kernels) extra=(--set kda_conv_impl=auto --set attn_res_impl=auto) ;;
    *) echo "memory_sweep_128k: unknown variant $variant" >&2; exit 2 ;;
  esac
  dump=/tmp/k3jax_dump_$variant
  rm -rf "$dump"
  XLA_FLAGS="--xla_dump_to=$dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*pure.* $xla" \
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 "${cmd[@]}" "${extra[@]}" 2>&1 | grep -v '^[WI][0-9]' \
    | tee "$out/$variant.log"
  for f in "$dump"/*pure*after_optimizations-memory-usage-report.txt \
           "$dump"/*pure*after_optimizations-buffer-assignment.txt "$dump"/*pure*after_optimizations.txt; do
    [ -f "$f" ] && gzip -c "$f" > "$out/${variant}_$(basename "$f" | sed 's/.*after_optimizations/hlo/').gz"
  done
done
grep -h "per device\|compiled step:" "$out"/*.log
