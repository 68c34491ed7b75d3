#!/usr/bin/env bash
# One GPU lease's checks in priority order, each under its own timeout: the gpu-marked tests, then
# bench/gpu_gpt2.py's modes (bf16 without a scaler too). At most 585 s in all (GPU_CHECK_SECONDS):
# a step that would outrun it is cut short. With inductor's caches empty the compiled modes spend
# most of theirs compiling. A lease is ~15 minutes of device time, its start included.
# Logs go to $OUT (the device tool's folder that comes back) or gpu-logs/.
# With arguments, only the parts they name run (bash bench/gpu_check.sh gpu_tests bf16), so a lease
# can be split into two shorter calls. compile runs the non-fused AdamW alone, compile_fused the fused one
# (a bare run runs both); eager_fused is the fused half of eager alone.
#
# The device's Python has torch, transformers and pandas but not sqlite-utils: download it and its
# two small dependencies here first (CONTRIBUTING.md, "On a GPU"), into .whl/, and carry .whl.
set -u
out=${OUT:-gpu-logs}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/env.log"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" | tee -a "$out/env.log"

start=$SECONDS
budget=${GPU_CHECK_SECONDS:-585}  # the whole script, so that a step that would outrun it is cut short
parts=" $* "
step() {  # step SECONDS NAME COMMAND...: one part, its output kept whether or not it finishes
    local seconds=$1 name=$2 left=$((budget - (SECONDS - start)))
    shift 2
    if [ "$parts" = "  " ]; then
        case $name in eager_fused) return ;; esac  # the half of eager, which runs both
    elif [[ "$parts" != *" $name "* ]]; then return; fi
    if [ "$seconds" -gt "$left" ]; then seconds=$left; fi
    if [ "$seconds" -lt 20 ]; then echo "== $name: skipped, ${left} s left"; return; fi
    echo "== $name (at most ${seconds} s, from $(date +%T))"
    timeout "$seconds" "$@" 2>&1 | grep -v -i "warn" | tee "$out/$name.log"
}
step 60 gpu_tests python3 -m pytest -q -m gpu tests/test_gpu.py -rfEs -s -p no:cacheprovider
# the open row first: inductor with the non-fused AdamW (1.040x at 6d8faf2, from ratios spread 0.95-1.10;
# 8 rounds did not tell it from 1.03x, so twice as many)
step 200 compile python3 bench/gpu_gpt2.py --modes compile --replay on --fused off --loss outside --rounds 16
step 150 compile_fused python3 bench/gpu_gpt2.py --modes compile --replay on --fused on --loss outside --rounds 6
# bf16 with the non-fused AdamW: its check is read before the update (one stream wait), not yet measured
step 90 bf16 python3 bench/gpu_gpt2.py --modes eager --bf16 --replay on --fused off,on --rounds 6
# bf16 with the non-fused AdamW under inductor: its weights kept, its check read a step late (keptweights.py)
step 180 bf16_compile python3 bench/gpu_gpt2.py --modes compile --bf16 --replay on --fused off --rounds 8
step 80 eager python3 bench/gpu_gpt2.py --modes eager --replay on --fused off,on --rounds 8
step 50 eager_fused python3 bench/gpu_gpt2.py --modes eager --replay on --fused on --rounds 8
# fused with the loss inside the model: its skip is read a step late. Outside, the logits' 823 MB
# gradient is more than deferred.HOLD_AT_MOST_BYTES: held only where the device has 4x that free.
step 45 eager_loss_inside python3 bench/gpu_gpt2.py --modes eager --replay on --fused on --loss inside --rounds 8
# perf_hints: why inductor kept a graph, or part of one, out of CUDA graphs
TORCH_LOGS=perf_hints step 120 cudagraphs python3 bench/gpu_gpt2.py --modes reduce-overhead --replay on --fused off --rounds 6
step 60 blocks python3 bench/gpu_gpt2.py --modes blocks --replay on --fused off --rounds 6
