#!/usr/bin/env bash
# Every GPU measurement of issue 18, in two parts that fit a lent GPU machine's calls (see README, "GPU").
#
#   scripts/gpu_check.sh step OUT            the CUDA tests, then ms per target step (eager and CUDA graphs) of the
#                                            Llama-7B and SmolLM2-135M shapes (random weights, bf16) vs the floor
#   scripts/gpu_check.sh bench OUT GGUF QUESTIONS [EXTRA BENCH ARGS]
#                                            casspec bench on the real model (bf16), one question per category
set -uo pipefail
part=${1:?step or bench}
out=${2:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [ "$part" = step ]; then
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -15
    python3 scripts/gpu_step.py --model random:llama-7b --dtype bfloat16 --context 512 --out "$out/step-llama-7b.json"
    python3 scripts/gpu_step.py --model random:smollm2-135m --dtype bfloat16 --context 512 \
        --out "$out/step-smollm2.json"
elif [ "$part" = bench ]; then
    gguf=${3:?GGUF file}
    questions=${4:?questions file}
    shift 4
    bench() {
        python3 -m casspec.cli bench --model "$gguf" --device cuda --dtype bfloat16 --max-context 2048 \
            --questions "$questions" --per-category 1 --max-new-tokens 128 --no-progress \
            --methods "$1" --out /tmp/casspec-bench "${@:2}" 2>&1
    }
    # without the compiled HF baseline if compiling fails on this machine (say so in the note)
    bench hf-ar,hf-ar-compiled,ar,sd:skip0.4,vc,hc,dytc,dytc~both "$@" || bench hf-ar,ar,sd:skip0.4,vc,hc,dytc,dytc~both "$@"
    cp /tmp/casspec-bench/summary.json "$out/"  # (the answers in one archive: few files come back)
    tar czf "$out/answers.tgz" -C /tmp casspec-bench
else
    echo "unknown part $part: use step or bench" >&2
    exit 2
fi
