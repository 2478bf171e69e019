#!/usr/bin/env bash
# Every GPU measurement of issue 18, in parts that fit a lent GPU machine's calls (see README, "On a GPU").
#
#   scripts/gpu_check.sh step OUT            ms per target step (CUDA graphs + compiled steps, q|k|v and gate|up
#                                            separate, then fused) of the Llama-7B and SmolLM2-135M shapes (random
#                                            weights, bf16) vs the floor; then the CUDA tests
#   scripts/gpu_check.sh bench OUT GGUF QUESTIONS [EXTRA BENCH ARGS]
#                                            casspec bench on the real model (bf16), one question per category; the
#                                            latency profile the engine made on first use comes back beside it
#   scripts/gpu_check.sh profile OUT         a quick latency profile of the Llama-7B shape (random weights, bf16)
#   scripts/gpu_check.sh levels OUT GGUF QUESTIONS
#                                            the CUDA tests of the quantized levels (bitsandbytes' nf4 needs
#                                            bitsandbytes on PYTHONPATH), then every level's cost / agreement on the
#                                            real model (casspec levels, bf16, one question per category)
set -uo pipefail
part=${1:?step, bench, levels or profile}
out=${2:?output folder}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false CASSPEC_CACHE=${CASSPEC_CACHE:-/tmp/casspec-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
if [ "$part" = step ]; then
    configs=graphs+compiled-separate,graphs+compiled
    python3 scripts/gpu_step.py --model random:llama-7b --dtype bfloat16 --context 512 --configs $configs \
        --out "$out/step-llama-7b.json"
    python3 scripts/gpu_step.py --model random:smollm2-135m --dtype bfloat16 --context 512 --configs $configs \
        --out "$out/step-smollm2.json"
    timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py 2>&1 | tail -15
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
    bench hf-ar,hf-ar-compiled,ar,dytc "$@" || bench hf-ar,ar,dytc "$@"
    cp /tmp/casspec-bench/summary.json "$out/"  # (the answers in one archive: few files come back)
    tar czf "$out/answers.tgz" -C /tmp casspec-bench
    cp "$CASSPEC_CACHE"/profiles/*.json "$out/" 2>/dev/null
elif [ "$part" = levels ]; then
    gguf=${3:?GGUF file}
    questions=${4:?questions file}
    timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "nf4 or int8" 2>&1 | tail -4
    timeout 200 python3 -m casspec.cli levels --model "$gguf" --device cuda --dtype bfloat16 --questions "$questions" \
        --per-category 1 --max-new-tokens 48 --no-progress --levels int8,nf4,skip0.4,exit24,int8+skip0.4 --json \
        > "$out/levels-cuda.json"
elif [ "$part" = profile ]; then
    python3 scripts/profile_latency.py --model random:llama-7b --device cuda --dtype bfloat16 --quick \
        --no-progress --out "$out/profile-llama-7b.json"
else
    echo "unknown part $part: use step, bench, levels or profile" >&2
    exit 2
fi
