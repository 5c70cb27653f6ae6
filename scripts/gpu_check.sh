#!/usr/bin/env bash
# Everything a GPU run checks, in one call (the lent GPU machine's time is scarce):
#   the GPU tests (loop kernel vs references, fuzz, reproducibility, watchdog; the multi-GPU ones
#   when there are two GPUs), then the benchmarks (collectives and tp_mlp too with two GPUs).
# TESTS=... and BENCHES=... pick a subset; `gpu_check.sh profile` prints per-op windows and waits of the
# benchmark cases (scripts/profile_cases.py; PROFILE_CASES=... picks them) and writes their traces;
# `gpu_check.sh experiments` runs the open tuning comparisons (decode_variants, generate1b profiles).
# `gpu_check.sh runtime` runs the runtime's GPU tests alone: ranks sharing one GPU (every collective on
# 2-4 ranks, TP MLP, TP2 Llama, a silent peer named) and the fault tests (cache corruption, a second
# kernel, exit and collection, a killed compile, leaks over 100 kernels and 10,000 runs, memmap upload);
# `all` and `tests` run them too, as a selection of their own (RUNTIME_TIMEOUT bounds it, 540 s).
# `gpu_check.sh v2` runs loop kernel v2's open measurements: GPU generate/op/layer tests, decode_variants
# (DECODE_VARIANTS; empty: none), the generate1b profile when PROFILE_GENERATE=1, bench.generate for GENERATE_SHAPES ("1b 8b"; GENERATE_ARGS e.g. --skip-transformers).
# `gpu_check.sh probe` runs scripts/decode_stream_probe.cu's configurations (PROBE_CONFIGS="MODE_SLOTS_DELAYS ...",
# e.g. "ahead_8_fused": the probe's arguments joined by underscores).
# `gpu_check.sh loader` runs the weight ring's loader warp (KernelOptions.weight_ring_loader):
# bench.generate --shape 1b --compare-loader (the default, both orders and caps, one run), its GPU tests.
# `gpu_check.sh programs` runs kernels of several programs with the ring's loader warp (docs/serving.md, "Programs"):
# their GPU tests and the engine's, then bench.serve for one client (SERVE_ARGS more arguments): the batch-1 TPOT.
# `gpu_check.sh paged` runs the serving step's paged attention tile (docs/serving.md, "The paged attention tile"):
# the engine's and fused_elementwise's GPU tests, the decode_1 step's profile (serve_decode1; again with the fuse rule
# elementwise_chain; traces in $OUT/serve_decode1*), bench.serve --clients 1.
# `gpu_check.sh loopcost` measures the loop's own cost (docs/runtime.md, "The loop's own cost"): bench.loop_overhead's
# A/B of KernelOptions task_records / completion_word / doorbell_reads and its round trip split into parts
# (LOOPCOST_ARGS its arguments), then the options' GPU tests and the default path's runtime tests (~4 min).
# `gpu_check.sh lanes` runs the decode attention tile of lanes over keys (KernelOptions.decode_attention):
# bench.generate --shape 1b --compare-lanes (the default, the option, the default again), its GPU tests.
# `gpu_check.sh ab` runs BENCHES (AB_ARGS their arguments) from BASE_TREE and from this tree, twice, alternating.
# Results land in $OUT (or bench/results); logs in $OUT/gpu_check.log.
# The device copy of the tree has no .git: pass MEGALOOP_COMMIT=$(git rev-parse --short HEAD) in the run
# command so the JSON names its commit. The 200-graph fuzz test needs > 240 s (one NVRTC compile each).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MEGALOOP_CACHE="${MEGALOOP_CACHE:-/tmp/megaloop-cache}"
OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu_check.log"
what="${1:-all}"
gpu_count=$(nvidia-smi -L | wc -l)
default_benches="loop_overhead memory_bound gemm llama_layer generate"
[ "$gpu_count" -ge 2 ] && default_benches="$default_benches collectives tp_mlp"
benches="${BENCHES:-$default_benches}"
# a hung kernel must not eat the whole device call: bound every step
test_timeout="${TEST_TIMEOUT:-420}" bench_timeout="${BENCH_TIMEOUT:-420}"
status=0
if [ "$what" = all ] || [ "$what" = tests ]; then
  # TESTS, or the tests marked gpu (in the files that have them: collecting every file would need the CPU
  # test tools, e.g. hypothesis, on the GPU machine) and then the README's examples (on the GPU here)
  gpu_files=$(grep -l "mark.gpu" tests/test_*.py | grep -v -e test_gpu_shared.py -e test_gpu_faults.py | tr '\n' ' ')
  if [ -n "${TESTS:-}" ]; then selections=("$TESTS"); else selections=("-m gpu $gpu_files" "tests/test_readme.py"); fi
  for selection in "${selections[@]}"; do
    # eval: a selection may quote its arguments (TESTS="tests/test_gpu.py -m gpu -k 'not random_graphs'")
    eval "timeout \"\$test_timeout\" python3 -m pytest -q $selection -p no:cacheprovider -rA --durations=0" 2>&1 \
      | tee -a "$OUT/gpu_check.log" || status=1
  done
fi
if { [ "$what" = all ] || [ "$what" = tests ] || [ "$what" = runtime ]; } && [ -z "${TESTS:-}" ]; then
  # the runtime's GPU tests (one-GPU groups, faults); their numbers are printed (-rA) into the logs
  timeout "${RUNTIME_TIMEOUT:-540}" python3 -m pytest -q tests/test_gpu_shared.py tests/test_gpu_faults.py -m gpu \
    -p no:cacheprovider -rA --durations=0 2>&1 | tee "$OUT/gpu_runtime.log" | tee -a "$OUT/gpu_check.log" \
    || status=1
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  for b in $benches; do
    timeout "$bench_timeout" python3 -m bench.$b 2>&1 | tail -n 60 | tee -a "$OUT/gpu_check.log" || status=1
  done
fi
if [ "$what" = experiments ]; then  # the open tuning questions (docs/runtime.md), one call
  # decode matmul tiles alone: weight bytes a second, the loop kernel against cuBLAS (two rounds in flight?)
  timeout "$bench_timeout" python3 scripts/decode_matmuls.py 2>&1 | tee -a "$OUT/gpu_check.log" || status=1
  timeout "$bench_timeout" python3 scripts/decode_variants.py ${DECODE_VARIANTS:-default default_again} 2>&1 | tee -a "$OUT/gpu_check.log" || status=1
  n=0
  for options in ${PROFILE_OPTION_SETS:-""}; do
    n=$((n + 1))
    echo "== generate1b ${options:-default} (traces in $OUT/generate1b-$n)" | tee -a "$OUT/gpu_check.log"
    PROFILE_OPTIONS="$options" OUT="$OUT/generate1b-$n" timeout "$bench_timeout" \
      python3 scripts/profile_cases.py generate1b 2>&1 | grep -v 'layers\.[1-9]' | tee -a "$OUT/gpu_check.log" || status=1
  done
fi
if [ "$what" = v2 ]; then  # loop kernel v2's open measurements (docs/runtime.md), one call
  # correctness first: the generator against transformers, the op table and the layers against the reference
  timeout "$test_timeout" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_generate.py tests/test_gpu.py -m gpu \
    -k "generate or every_op or benchmark_layers" 2>&1 | tail -n 15 | tee -a "$OUT/gpu_check.log" || status=1
  if [ -n "${DECODE_VARIANTS-x}" ]; then  # DECODE_VARIANTS= (empty) skips them
    timeout "$bench_timeout" python3 scripts/decode_variants.py ${DECODE_VARIANTS:-default norms_inside default_again} 2>&1 \
      | tee -a "$OUT/gpu_check.log" || status=1
  fi
  if [ -n "${PROFILE_GENERATE:-}" ]; then  # the generation step's per-op windows (layer 3) and critical path
    OUT="$OUT/generate1b" timeout "$bench_timeout" python3 scripts/profile_cases.py generate1b 2>&1 \
      | grep -v -E 'layers\.([0-24-9]|1[0-5])\.' | tee -a "$OUT/gpu_check.log" || status=1
  fi
  for shape in ${GENERATE_SHAPES:-1b 8b}; do
    timeout "$bench_timeout" python3 -m bench.generate --shape "$shape" ${GENERATE_ARGS:-} 2>&1 | tail -n 12 \
      | tee -a "$OUT/gpu_check.log" || status=1
  done
fi
if [ "$what" = loader ]; then  # docs/runtime.md, "The loader warp": the numbers first, then the tests
  timeout "$bench_timeout" python3 -m bench.generate --shape 1b --skip-transformers --skip-torch-compile --compare-loader \
    ${GENERATE_ARGS:-} 2>&1 | tail -n 12 | tee -a "$OUT/gpu_check.log" || status=1
  timeout "$test_timeout" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_ring_loader.py -m gpu -rA \
    --durations=0 2>&1 | tail -n 30 | tee -a "$OUT/gpu_check.log" || status=1
fi
if [ "$what" = programs ]; then  # docs/serving.md, "Measured": the prediction for the batch-1 step
  timeout "$test_timeout" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_programs.py tests/test_gpu_serve.py \
    -m gpu -rA --durations=0 2>&1 | tail -n 30 | tee -a "$OUT/gpu_check.log" || status=1
  timeout "$bench_timeout" python3 -m bench.serve --clients 1 ${SERVE_ARGS:-} 2>&1 | tail -n 20 \
    | tee -a "$OUT/gpu_check.log" || status=1
fi
if [ "$what" = paged ]; then  # docs/serving.md, "The paged attention tile": correctness, the step's windows, TPOT
  timeout "$test_timeout" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_serve.py tests/test_fuse_elementwise.py \
    -m gpu -rA --durations=0 2>&1 \
    | tail -n 30 | tee -a "$OUT/gpu_check.log" || status=1
  for fusion in all +elementwise_chain; do  # (the second: its small ops fused, off by default until measured)
    PROFILE_FUSION="$fusion" OUT="$OUT/serve_decode1${fusion//[^a-z]/_}" timeout "$bench_timeout" \
      python3 scripts/profile_cases.py serve_decode1 2>&1 | grep -v -E 'layers\.([0-24-9]|1[0-5])\.' \
      | tee -a "$OUT/gpu_check.log" || status=1
  done
  timeout "$bench_timeout" python3 -m bench.serve --clients 1 ${SERVE_ARGS:-} 2>&1 | tail -n 20 \
    | tee -a "$OUT/gpu_check.log" || status=1
fi
if [ "$what" = lanes ]; then  # docs/runtime.md, "Lanes over keys"
  timeout "$bench_timeout" python3 -m bench.generate --shape 1b --skip-transformers --skip-torch-compile --compare-lanes \
    ${GENERATE_ARGS:-} 2>&1 | tail -n 12 | tee -a "$OUT/gpu_check.log" || status=1
  timeout "$test_timeout" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_lanes.py -m gpu -rA \
    --durations=0 2>&1 | tail -n 30 | tee -a "$OUT/gpu_check.log" || status=1
fi
if [ "$what" = probe ]; then  # loop kernel v2's weight ring against today's design (docs/runtime.md)
  nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I megaloop/codegen/include -o /tmp/decode_stream_probe.bin scripts/decode_stream_probe.cu \
    || status=1
  for config in ${PROBE_CONFIGS:-direct_0_today gated_8_today ahead_8_today direct_0_fused ahead_8_fused stream_8_none}; do
    timeout 60 /tmp/decode_stream_probe.bin ${config//_/ } 2>&1 | tee -a "$OUT/decode_stream_probe.jsonl" || status=1
  done
fi
if [ "$what" = loopcost ]; then  # the numbers first (the tests compile more), then correctness
  timeout "$bench_timeout" python3 -m bench.loop_overhead ${LOOPCOST_ARGS:-} 2>&1 | grep -v '^ ' \
    | tee -a "$OUT/gpu_check.log" || status=1
  timeout "$test_timeout" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_loop_cost.py tests/test_gpu_programs.py \
    tests/test_gpu.py -m gpu -k "loop_cost or programs or hundred or watchdog or profiled or state_feedback" -rA \
    --durations=0 2>&1 | tail -n 40 | tee -a "$OUT/gpu_check.log" || status=1
fi
if [ "$what" = ab ]; then  # BENCHES from this tree and from BASE_TREE (an exported older tree), alternating
  for round in 1 2; do
    for tree in "$BASE_TREE" "$PWD"; do
      for b in $benches; do
        echo "== round $round, $b from $tree" | tee -a "$OUT/gpu_check.log"
        (cd "$tree" && PYTHONPATH="$tree" timeout "$bench_timeout" python3 -m bench.$b ${AB_ARGS:-}) 2>&1 | tail -n 30 \
          | tee -a "$OUT/gpu_check.log" || status=1
      done
    done
  done
fi
if [ "$what" = profile ]; then
  timeout "$bench_timeout" python3 scripts/profile_cases.py ${PROFILE_CASES:-decode2048 decode4096 prefill2048} 2>&1 | tee -a "$OUT/gpu_check.log" || status=1
fi
exit $status
