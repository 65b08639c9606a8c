#!/usr/bin/env bash
# The checks that need a GPU, as one command for a lent GPU machine (python3 there holds torch, lightning, pytest):
# the CUDA tests (CUDA graphs, a model moved to the GPU, the docs' CUDA snippets), BNP under
# torch.compile(mode="reduce-overhead"), and the cost table eager and graphed. Everything goes to $OUT (or benchmarks/out).
# Run: [PY=.venv/bin/python] bash benchmarks/gpu_checks.sh [tests|compile|table|compiled-table|trainer|all]
set -u
PY=${PY:-python3}  # the Python that holds torch (PY=.venv/bin/python in a clone of this repository)
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
what=${1:-all}
nvidia-smi -L; $PY -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name())"
if [[ $what == tests || $what == all ]]; then
  timeout 240 $PY -m pytest -p no:cacheprovider -q -rs -s tests/core/test_cuda_graph.py tests/callbacks/test_cuda_graph_fit.py \
    tests/core/test_cuda.py tests/core/test_cuda_syncs.py "tests/test_docs.py::test_python_snippet_runs_as_written" -k "cuda or graph or syncs or docs/cuda_graphs" \
    2>&1 | tee "$OUT/tests.log" | grep -v "^USDT\|^ERROR:20" | tail -60
fi
if [[ $what == compile || $what == all ]]; then
  timeout 200 $PY -m benchmarks.reduce_overhead --batch 60 2>&1 | tee "$OUT/reduce_overhead.log" | grep -v "^USDT" | tail -30
fi
if [[ $what == table || $what == all ]]; then
  timeout 230 $PY -m benchmarks.overhead --device cuda --rows fc,cnn,resnet20,resnet110,resnet50,vit,charlm \
    --batches 2,16,32,60,64,128,256,512 --modes eager,graphed --repeats 7 2>&1 | tee "$OUT/overhead.log" | grep -v "^USDT" | tail -45
  cp benchmarks/out/overhead_cuda.md benchmarks/out/overhead_cuda.png "$OUT/" 2>/dev/null
fi
if [[ $what == compiled-table || $what == all ]]; then
  timeout 170 $PY -m benchmarks.overhead --device cuda --rows fc,resnet20 --batches 60,128 --modes compiled+graphed \
    --repeats 7 --tag _compiled_graphed 2>&1 | tee "$OUT/overhead_compiled.log" | grep -v "^USDT\|perf_hints" | tail -25
  cp benchmarks/out/overhead_cuda_compiled_graphed.md "$OUT/" 2>/dev/null
fi
if [[ $what == trainer || $what == all ]]; then  # a plain Trainer.fit, eager and with the GraphedSteps callback
  timeout 200 $PY -m benchmarks.overhead --device cuda --rows fc,resnet20 --batches 60,128 --modes eager,graphed \
    --loops lightning --repeats 5 --tag _trainer 2>&1 | tee "$OUT/overhead_trainer.log" | grep -v "^USDT" | tail -25
  cp benchmarks/out/overhead_cuda_trainer.md "$OUT/" 2>/dev/null
fi
