#!/usr/bin/env bash
# The GPU work that could not run in the 2026-11-30 session (device budget spent), in priority
# order, split into parts that each fit one 10-minute device call. Every step has its own time
# limit and appends to a few log files under $OUT (the device tool returns only a limited
# number of files: keep Hydra's run folders out of $OUT).
#
#   bash benchmarks/gpu_checklist.sh part1   # GPU tests: new kernels, graph path, tree kernels (~8 min)
#   bash benchmarks/gpu_checklist.sh part2   # rollback-kernel table + e2e on both bench shapes (~9 min)
#   bash benchmarks/gpu_checklist.sh part3   # zoo e2e, case checks, long runs, tree cost (~8 min)
#   bash benchmarks/gpu_checklist.sh part4   # the 2-GPU accelerate run (needs nvidia-h200-x2; ~3 min)
#
# On nvidia-h200-x2 the same work fits two calls: the correctness tests (compile-bound) share
# GPU 0 while the timed benchmarks have GPU 1 to themselves.
#   bash benchmarks/gpu_checklist.sh x2a     # part1's tests on GPU 0 || part2 on GPU 1 (~9 min)
#   bash benchmarks/gpu_checklist.sh x2b     # part4's 2-GPU run, then part3 split over both GPUs (~7 min)
#
# Left after the 2026-11-30 sessions (nothing of it has run on a GPU yet), one call each:
#   bash benchmarks/gpu_checklist.sh next    # n-gram drafter, zoo e2e, ncu of the fused replay (~7 min)
#   bash benchmarks/gpu_checklist.sh next2   # 64-node tree cost; kernel config sweep + tuned table (~10 min)
#
# On nvidia-h200-x4 (the 2026-11-30 afternoon session) the same work and the full kernel grid:
#   bash benchmarks/gpu_checklist.sh x4a     # 64-node tree | config sweep (2 GPUs) | ncu of every op's step,
#                                            # n-gram drafter, zoo e2e (~9 min)
#   bash benchmarks/gpu_checklist.sh x4b     # the full kernel grid (batch 1,8,64,256 x K 1,4,8; one K per
#                                            # GPU) | GPU kernel tests (~9 min)
#   (x4 was not lent for the second call) the same on nvidia-h200-x2, two calls back to back:
#   bash benchmarks/gpu_checklist.sh x2d     # GPU tests | K = 4 grid, then the tree cost (~9.5 min)
#   bash benchmarks/gpu_checklist.sh x2e     # K = 1 grid, then e2e qwen | K = 8 grid (~7 min)
#   bash benchmarks/gpu_checklist.sh x2g     # after the second config change: full grid, tree cost | tests, e2e
#
# Left after session 4 (its device budget was spent; nothing of it has run on a GPU), one call on
# nvidia-h200, the priority first:
#   bash benchmarks/gpu_checklist.sh next5   # GPU kernel tests of the Mamba-2 tree settings; the eager
#                                            # snapshot anomaly profiled alone on the host; the missing
#                                            # tree-kernel rows; zoo e2e divergence margins (~9.5 min)
#   bash benchmarks/gpu_checklist.sh next5b  # Medusa trees on the CUDA-graph path (session 5): the GPU
#                                            # static-path tests, the verify step of chain / tree-16 /
#                                            # tree-64 on the graph path, then their tokens/s on the zoo
#                                            # target against plain (~9 min)
#   bash benchmarks/gpu_checklist.sh next5c  # one-warp launch settings for the replay / plain update
#                                            # (sass_configs.py: 3-8x fewer barriers per token, no
#                                            # spills) timed against the defaults at batch 64 / 256 (~7 min)
#
# Wheels for hydra/omegaconf/fla travel in .whl (see the device README); install them first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PY=${PY:-python3}
step() {  # step <seconds> <log name> <command...>
    local t=$1 log=$2
    shift 2
    echo "== $(date +%T) $*" | tee -a "$OUT/$log.log"
    timeout "$t" "$@" >> "$OUT/$log.log" 2>&1
    echo "== rc=$? ($log)" | tee -a "$OUT/$log.log"
}

ACC_ARGS="experiment=acceptance device=cuda model=gdn-target drafter=ngram rollback=replay prompts.set=all
    prompts.limit=null max_new_tokens=64 progress=false"
acceptance() {  # acceptance 2gpu|1gpu: the acceptance experiment (Hydra run folder outside $OUT)
    if [ "$1" = 2gpu ]; then
        step 150 accelerate accelerate launch --multi_gpu --num_processes 2 -m specdec $ACC_ARGS hydra.run.dir=/tmp/acc/2gpu
    else
        step 150 accelerate $PY -m specdec $ACC_ARGS hydra.run.dir=/tmp/acc/1gpu
    fi
    cp /tmp/acc/$1/summary.md "$OUT/acceptance_$1_summary.md" 2>/dev/null
    cp /tmp/acc/$1/results.jsonl "$OUT/acceptance_$1_results.jsonl" 2>/dev/null
}
compare_acceptance() {  # the two runs' records must agree apart from timings and process ids
    $PY - /tmp/acc >> "$OUT/accelerate.log" 2>&1 <<'EOF2'
import json, sys
run = sys.argv[1]
def load(p):
    # timings, which process ran a record and on which GPU may differ; nothing else may
    drop = {"wall_s", "tokens_per_s", "plain_tokens_per_s", "speedup", "draft_s", "verify_s", "rollback_s",
            "prefill_s", "plain_wall_s", "process", "rank", "world_size", "device"}
    recs = [json.loads(x) for x in open(p)]
    return [{k: v for k, v in r.items() if k not in drop} for r in recs]
a, b = load(f"{run}/2gpu/results.jsonl"), load(f"{run}/1gpu/results.jsonl")
same = [x == y for x, y in zip(a, b)]
print(f"records: 2 processes {len(a)}, 1 process {len(b)}; identical apart from timings and GPU, "
      f"in the same order: {len(a) == len(b) and all(same)}")
for x, y in zip(a, b):
    if x != y:
        print("first difference:", {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)})
        break
EOF2
}

case "${1:-}" in
part1)
    export SPECDEC_TEST_CUDA=1
    step 200 tests $PY -u -m pytest -q -x -p no:cacheprovider tests/test_kernels_triton.py -m "gpu or not gpu" -k "not tree"
    step 150 tests $PY -u -m pytest -q -x -p no:cacheprovider tests/test_static_path.py -m gpu
    step 200 tests $PY -u -m pytest -q -x -p no:cacheprovider tests/test_kernels_triton.py -m "gpu or not gpu" -k tree
    # not tests/test_medusa_tree.py or the other CPU test files: with flash-linear-attention on the
    # path and a GPU present, transformers sends their CPU tensors to fla's Triton kernels, which
    # fail in the interpreter (seen 2026-11-30); their GPU parts are in test_kernels_triton.py
    ;;
part2)
    step 200 rollback $PY -u benchmarks/rollback_kernels.py --batches 1,64,256 --ks 4 --out "$OUT/rollback_kernels.md"
    step 330 e2e $PY -u benchmarks/e2e.py --models qwen35-4b-shape,nemotronh-4b-shape --hf-new 32 --out "$OUT/e2e.jsonl"
    ;;
part3)
    step 150 e2e $PY -u benchmarks/e2e.py --models zoo --out "$OUT/e2e.jsonl"
    step 150 cases $PY -u benchmarks/cases_gpu.py --out "$OUT/cases_gpu.md"
    step 90 long_run $PY -u benchmarks/long_run.py --out "$OUT/long_run.md"
    step 90 tree $PY -u benchmarks/tree_verify.py --out "$OUT/tree_verify.md"
    # optional: 64-node rows (first-use compile of the 64-node replay kernels takes minutes)
    # $PY -u benchmarks/tree_verify.py --variants chain tree-64 tree-64-torch --strategies snapshot --max-seconds 300
    ;;
part4)
    # issue 8: the acceptance experiment split over 2 GPUs vs 1 process; the records must agree
    acceptance 2gpu
    CUDA_VISIBLE_DEVICES=0 acceptance 1gpu
    compare_acceptance
    ;;
x2a)
    export SPECDEC_TEST_CUDA=1
    t="-u -m pytest -q -p no:cacheprovider"
    CUDA_VISIBLE_DEVICES=0 step 330 tests_kernels $PY $t tests/test_kernels_triton.py -m "gpu or not gpu" -k "not tree" &
    CUDA_VISIBLE_DEVICES=0 step 330 tests_static $PY $t tests/test_static_path.py -m gpu &
    CUDA_VISIBLE_DEVICES=0 step 330 tests_tree $PY $t tests/test_kernels_triton.py -m "gpu or not gpu" -k tree &
    export CUDA_VISIBLE_DEVICES=1
    step 200 rollback $PY -u benchmarks/rollback_kernels.py --batches 1,64,256 --ks 4 --out "$OUT/rollback_kernels.md"
    step 320 e2e $PY -u benchmarks/e2e.py --models qwen35-4b-shape,nemotronh-4b-shape --hf-new 32 --out "$OUT/e2e.jsonl"
    wait
    ;;
x2b)
    export SPECDEC_TEST_CUDA=1
    t="-u -m pytest -q -p no:cacheprovider"
    # correctness tests (compile-bound) on GPU 0 while the 2-GPU run goes
    CUDA_VISIBLE_DEVICES=0 step 300 tests_static $PY $t tests/test_static_path.py -m gpu -k cuda_graph &
    CUDA_VISIBLE_DEVICES=0 step 400 tests_tree $PY $t -n 12 tests/test_kernels_triton.py -m "gpu or not gpu" -k tree &
    acceptance 2gpu
    (export CUDA_VISIBLE_DEVICES=0
     acceptance 1gpu
     compare_acceptance
     step 150 cases $PY -u benchmarks/cases_gpu.py --out "$OUT/cases_gpu.md"
     step 90 tree $PY -u benchmarks/tree_verify.py --out "$OUT/tree_verify.md") &
    (export CUDA_VISIBLE_DEVICES=1
     step 160 e2e $PY -u benchmarks/e2e.py --models zoo --out "$OUT/e2e.jsonl"
     step 100 e2e $PY -u benchmarks/e2e.py --models nemotronh-4b-shape --batches 64 --acceptance 0.6 --skip-hf --out "$OUT/e2e.jsonl"
     step 90 long_run $PY -u benchmarks/long_run.py --out "$OUT/long_run.md")
    wait
    ;;
x2c)
    # re-checks after the x2b findings: Kimi's draft model captured (MoE experts), 2-GPU records,
    # and the zoo draft-model rows in reverse strategy order (was the first row's drafting slow?)
    export SPECDEC_TEST_CUDA=1
    CUDA_VISIBLE_DEVICES=0 step 300 tests_static $PY -u -m pytest -q -p no:cacheprovider tests/test_static_path.py -m gpu -k "cuda_graph and kimi" &
    acceptance 2gpu
    (export CUDA_VISIBLE_DEVICES=0; acceptance 1gpu; compare_acceptance) &
    CUDA_VISIBLE_DEVICES=1 step 150 e2e $PY -u benchmarks/e2e.py --models zoo --zoo-batches 1,16 --strategies replay,ring,snapshot --skip-hf --out "$OUT/e2e.jsonl"
    wait
    ;;
next)
    step 60 ngram $PY -u benchmarks/ngram_drafter.py --out "$OUT/ngram_drafter.md"
    step 200 e2e $PY -u benchmarks/e2e.py --models zoo --out "$OUT/e2e.jsonl"
    step 150 ncu ncu --clock-control none -k regex:"delta_rule|replay_commit" --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy $PY benchmarks/profile_gdn_step.py --batch 64 --T 5
    ;;
next2)
    # the 64-node replay tree kernels unroll 64 nodes x depth: ~4 min of compile on first use
    step 330 tree $PY -u benchmarks/tree_verify.py --variants chain tree-64 tree-64-torch \
        --strategies snapshot replay --max-seconds 300 --out "$OUT/tree_verify_64.md"
    step 240 sweep $PY -u benchmarks/sweep_rollback_configs.py --batches 64,1 --out "$OUT/sweep.md"
    ;;
x4a)
    CUDA_VISIBLE_DEVICES=0 step 420 tree $PY -u benchmarks/tree_verify.py --variants chain tree-64 tree-64-torch \
        --strategies snapshot replay --max-seconds 340 --out "$OUT/tree_verify_64.md" &
    (export CUDA_VISIBLE_DEVICES=1
     step 200 sweep $PY -u benchmarks/sweep_rollback_configs.py --precompile-only --workers 24
     step 360 sweep $PY -u benchmarks/sweep_rollback_configs.py --batches 64,256 --no-precompile \
         --out "$OUT/sweep_b64_b256.md") &
    (export CUDA_VISIBLE_DEVICES=2
     step 60 ngram $PY -u benchmarks/ngram_drafter.py --out "$OUT/ngram_drafter.md"
     step 200 e2e $PY -u benchmarks/e2e.py --models zoo --out "$OUT/e2e.jsonl"
     step 300 sweep_small $PY -u benchmarks/sweep_rollback_configs.py --batches 1,8 --no-precompile \
         --out "$OUT/sweep_b1_b8.md") &
    (export CUDA_VISIBLE_DEVICES=3
     for op in mamba2 gdn kda; do
         step 170 ncu_$op ncu --clock-control none --profile-from-start off --nvtx --section SpeedOfLight \
             --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
             $PY -u benchmarks/profile_step.py --op $op --batch 64 --K 4
     done) &
    wait
    ;;
x4b)
    # one lane per GPU: the kernel grid for one K, then the tree cost (runtime node loop) or e2e
    (export CUDA_VISIBLE_DEVICES=0
     step 200 rollback_k1 $PY -u benchmarks/rollback_kernels.py --batches 1,8,64,256 --ks 1 \
         --out "$OUT/rollback_kernels_k1.md"
     step 300 tree $PY -u benchmarks/tree_verify.py --variants chain tree-16 tree-16-loop tree-64 tree-64-torch \
         --strategies snapshot replay --max-seconds 270 --out "$OUT/tree_verify_64.md") &
    (export CUDA_VISIBLE_DEVICES=1
     step 300 rollback_k4 $PY -u benchmarks/rollback_kernels.py --batches 1,8,64,256 --ks 4 \
         --out "$OUT/rollback_kernels_k4.md"
     step 240 e2e $PY -u benchmarks/e2e.py --models qwen35-4b-shape --skip-hf --out "$OUT/e2e_qwen.jsonl") &
    (export CUDA_VISIBLE_DEVICES=2
     step 340 rollback_k8 $PY -u benchmarks/rollback_kernels.py --batches 1,8,64,256 --ks 8 \
         --out "$OUT/rollback_kernels_k8.md"
     step 220 e2e $PY -u benchmarks/e2e.py --models nemotronh-4b-shape --skip-hf --out "$OUT/e2e_nemotron.jsonl") &
    (export CUDA_VISIBLE_DEVICES=3 SPECDEC_TEST_CUDA=1
     step 330 tests_kernels $PY -u -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels_triton.py \
         -m "gpu or not gpu"
     step 230 tests_static $PY -u -m pytest -q -p no:cacheprovider -n 4 tests/test_static_path.py -m gpu) &
    wait
    ;;
x2d)
    # x4b's work on nvidia-h200-x2, first call: GPU tests || the K = 4 grid, then the tree cost
    (export CUDA_VISIBLE_DEVICES=0 SPECDEC_TEST_CUDA=1
     step 330 tests_kernels $PY -u -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels_triton.py \
         -m "gpu or not gpu"
     step 230 tests_static $PY -u -m pytest -q -p no:cacheprovider -n 4 tests/test_static_path.py -m gpu) &
    (export CUDA_VISIBLE_DEVICES=1
     step 300 rollback_k4 $PY -u benchmarks/rollback_kernels.py --batches 1,8,64,256 --ks 4 \
         --out "$OUT/rollback_kernels_k4.md"
     step 270 tree $PY -u benchmarks/tree_verify.py --variants chain tree-16 tree-16-loop tree-64 tree-64-torch \
         --strategies snapshot replay --max-seconds 240 --out "$OUT/tree_verify_64.md") &
    wait
    ;;
x2e)
    # second call (warm, right after x2d): the K = 1 and K = 8 grids, then e2e (qwen) on GPU 0
    (export CUDA_VISIBLE_DEVICES=0
     step 200 rollback_k1 $PY -u benchmarks/rollback_kernels.py --batches 1,8,64,256 --ks 1 \
         --out "$OUT/rollback_kernels_k1.md"
     step 220 e2e $PY -u benchmarks/e2e.py --models qwen35-4b-shape --skip-hf --out "$OUT/e2e_qwen.jsonl") &
    CUDA_VISIBLE_DEVICES=1 step 400 rollback_k8 $PY -u benchmarks/rollback_kernels.py --batches 1,8,64,256 --ks 8 \
        --out "$OUT/rollback_kernels_k8.md" &
    wait
    ;;
x2g)
    # after the second config change: the whole kernel grid, GPU tests, tree cost (kernel level and
    # whole model, each after the tests so the eager timings do not share the host with compiles)
    (export CUDA_VISIBLE_DEVICES=0
     step 240 rollback $PY -u benchmarks/rollback_kernels.py --out "$OUT/rollback_kernels.md"
     step 90 tree_kernels $PY -u benchmarks/tree_kernels.py --out "$OUT/tree_kernels.md"
     step 150 tree $PY -u benchmarks/tree_verify.py --variants chain tree-16 tree-16-loop tree-64 tree-64-torch \
         --strategies snapshot replay --max-seconds 140 --out "$OUT/tree_verify_64.md") &
    (export CUDA_VISIBLE_DEVICES=1 SPECDEC_TEST_CUDA=1
     step 150 tests_kernels $PY -u -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels_triton.py \
         -m "gpu or not gpu"
     step 150 tests_static $PY -u -m pytest -q -p no:cacheprovider -n 4 tests/test_static_path.py -m gpu
     step 190 e2e $PY -u benchmarks/e2e.py --models nemotronh-4b-shape --skip-hf --out "$OUT/e2e_nemotron.jsonl") &
    wait
    ;;
next5)
    # sequential on purpose: the eager step is host-bound, so nothing may share the host with it
    SPECDEC_TEST_CUDA=1 step 170 tests_kernels $PY -u -m pytest -q -p no:cacheprovider -n 8 \
        tests/test_kernels_triton.py -m "gpu or not gpu" -k "mamba2 or tree"
    step 120 tree_profile $PY -u benchmarks/tree_verify.py --variants chain tree-16 tree-16-loop \
        --strategies snapshot replay --max-seconds 110 --out "$OUT/tree_verify.md" --profile "$OUT/tree_profile.md"
    step 100 tree_kernels $PY -u benchmarks/tree_kernels.py --ops kda,mamba2 --out "$OUT/tree_kernels.md"
    step 160 e2e $PY -u benchmarks/e2e.py --models zoo --out "$OUT/e2e_zoo.jsonl"
    ;;
next5b)
    SPECDEC_TEST_CUDA=1 step 200 tests_static $PY -u -m pytest -q -p no:cacheprovider -n 4 tests/test_static_path.py \
        -m gpu
    step 150 tree_graph $PY -u benchmarks/tree_verify.py --path cuda_graph --variants chain tree-16 tree-64 \
        --strategies snapshot replay --batch 1 16 64 --max-seconds 140 --out "$OUT/tree_verify_graph.md"
    for tree in null default medusa-63; do
        step 100 medusa $PY -m specdec experiment=acceptance device=cuda model=gdn-target drafter=medusa \
            drafter.tree=$tree rollback=replay prompts.limit=8 max_new_tokens=128 progress=false \
            hydra.run.dir=/tmp/acc/medusa_$tree
        cp /tmp/acc/medusa_$tree/results.jsonl "$OUT/medusa_${tree}_results.jsonl" 2>/dev/null
    done
    ;;
next5c)
    step 420 sweep_warps $PY -u benchmarks/sweep_rollback_configs.py --batches 64,256 \
        --strategies baseline,replay,replay_deferred --configs "def;16,2,5;8,1,5;16,1,5;8,2,5" \
        --out "$OUT/sweep_one_warp.md"
    ;;
*)
    echo "usage: $0 part1|part2|part3|part4|x2a|x2b|x2c|next|next2|x4a|x4b|x2d|x2e|x2g|next5|next5b|next5c" >&2
    exit 2
    ;;
esac
