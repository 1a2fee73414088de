# Source this on the GPU machine before a side-by-side benchmark:  source benchmarks/gpu_peers.sh
# Installs the peers' wheels (fla-core for `chunk_kda`, transformers for `KimiLinearForCausalLM`), copied from
# ../shared/wheels into the project's ignored .whl/ folder (pass carry=[".whl"] to the device run), into
# /tmp/peers without touching the machine's packages, and sets the environment the benchmarks expect.
set -e
if ! ls .whl/*.whl > /dev/null 2>&1; then
  echo "gpu_peers.sh: no wheels in .whl/ (copy ../shared/wheels/*.whl there and carry .whl)" >&2
  return 1 2> /dev/null || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peers .whl/*.whl
export PYTHONPATH=/tmp/peers:$PWD${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX and torch share the GPU in one process
python3 -c "import fla, transformers; print('peers: fla', getattr(fla, '__version__', '?'), '/ transformers', transformers.__version__)"
set +e
