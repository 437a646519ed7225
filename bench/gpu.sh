#!/usr/bin/env bash
# GPU figures in short calls. A loan of the GPU machine is 15 minutes in all (its start included),
# at most 10 per command, so the parts come in presets sized for one call each:
#
#   PARTS=engine bash bench/gpu.sh [OUT_DIR]   # 9 min of limits: the sampler at 0.5B and 7B, resume,
#                                              #   memory per phase, the suite with CUDA visible
#   PARTS=first bash bench/gpu.sh [OUT_DIR]    # ~8 min of limits: the run users will do
#   PARTS=second bash bench/gpu.sh [OUT_DIR]   # 3 min: the suite, rollout vs generate, a decode profile
#   PARTS=vs_trl bash bench/gpu.sh [OUT_DIR]   # 5 min: our GRPO step against TRL's GRPOTrainer (bf16)
#   PARTS=smollm2 bash bench/gpu.sh [OUT_DIR]  # 9 min: the real-model recipe at sql_env's scale (bf16)
#   PARTS="tests grpo_run" bash bench/gpu.sh   # any parts by name; PARTS=all: every part (~60 min)
#   SMOKE=1 PARTS=first bash bench/gpu.sh DIR  # CPU dry run, tiny shapes (tests/test_gpu_preset.py)
#
# Each part runs under its own time limit (they add up to the preset's), a failing part does not
# stop the others, its log is OUT_DIR/NAME.txt, and the headline lines (`name: value`) of every
# part are repeated at the end (OUT_DIR/summary.txt). Random weights in real shapes, nothing
# downloaded: the machine has no network.
#
# engine: (1) decode05, decode7b: PolicySampler decode at the Qwen2.5-0.5B and 7B shapes (random
#   weights, bf16, B=64/256 and B=256, ~1k tokens of context), the whole-step graphs (the default)
#   against the same step compiled first (sampling.compile_decode), with a profile of the largest
#   batch: % of the measured HBM roofline (bench/policy_decode.py); (2) grpo_run then grpo_resume: the resumed process's first
#   rollout against a steady one; (3) peaks per phase against memory_estimate, LoRA included
#   (lora_run); (4) tests: the suite with CUDA visible, verbose. grpo_run is the first preset's run.
# first: (a) grpo_run: train.py under torchrun, one GPU, configs/tiny.yaml's toy data with a
#   Qwen2.5-0.5B body (24 layers, 896 wide, 14/2 heads, the toy's 1k vocabulary: ~0.36B params),
#   bf16, CUDA graphs, FlexAttention paged decode, three turns: a short SFT warm start (the policy
#   learns the protocol), 3 GRPO steps; grpo_resume: the same command resumed for a 4th step;
#   rollout / reward / update seconds, tokens/s and peak GB per phase against memory_estimate
#   (bench/run_summary.py). (b) decode: PolicySampler (the path train.py samples on; graphs
#   captured before the timing) at B=64 and 256, real 0.5B shape and vocabulary, flex and gather:
#   tokens/s and % of the HBM roofline (bench/policy_decode.py). (c) lora_run: 2 GRPO steps of
#   LoRA r=32 on all projections, from the grpo run's checkpoint.
# second: tests (the suite with CUDA visible, verbose: a part cut by its limit still names its
#   failures), rollout_vs_generate (the grpo run's rollout phase against transformers generate on
#   the same turn shapes, bench/rollout_vs_generate.py), decode_profile (one B=256 rollout of the
#   decode benchmark under torch.profiler: device against host time, launches per step).
# vs_trl (a preset of one part): one GRPO step, ours against TRL's GRPOTrainer on the same work
#   (bench/vs_trl.py: 16 prompts x 4, 128 new tokens, one optimizer step, interleaved pairs, the
#   first a warm-up), bf16 on both sides (fp32 masters), TRL with transformers generate, and with
#   vLLM (colocate) only where vllm imports. With runs/smollm2 and $SPIDER_DIR on the machine it runs
#   on them; otherwise on the toy set ($RUNS/toy) with a random body in SmolLM2-135M's shape (the GPU
#   machine has neither: the checkpoint is 540 MB). trl is not installed there: carry its wheels as
#   wheels/trl (made on any machine with `pip download -d wheels/trl --no-deps --only-binary=:all:
#   --python-version 3.12 --platform manylinux2014_x86_64 trl==1.16.0 datasets==5.2.0 dill==0.4.1
#   multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 xxhash==4.1.0 fsspec==2026.9.0
#   accelerate==1.15.0`) and the part installs them.
# all (each as in bench/RESULTS.md): tests attention paged_attention sampler sampler_graphs
#   rollout_scale train_step long_microbatch update_mfu, and the presets.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
SMOKE=${SMOKE:-0}
RUNS=${RUNS:-runs}  # where the runs and the model go (the toy data: configs/tiny.yaml's runs/toy)

ENGINE="decode05 decode7b grpo_run grpo_resume lora_run tests"
FIRST="grpo_run grpo_resume decode lora_run"
SECOND="tests rollout_vs_generate decode_profile"
ALL="attention paged_attention sampler sampler_graphs rollout_scale train_step long_microbatch update_mfu decode05 decode7b $FIRST $SECOND vs_trl smollm2"
PARTS=${PARTS:-first}
PARTS=${PARTS//engine/$ENGINE}
PARTS=${PARTS//first/$FIRST}
PARTS=${PARTS//second/$SECOND}
PARTS=${PARTS//all/$ALL}

ran() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }  # ran NAME: NAME is in PARTS

part() {  # part NAME SECONDS COMMAND...: run under a time limit, log to $OUT/NAME.txt, keep going
    local name=$1 limit=$2
    shift 2
    ran "$name" || return 0
    echo "=== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.txt"
    echo "--- $name: exit $rc after $((SECONDS - start)) s" | tee -a "$SUMMARY"
    grep -E '^[a-z0-9_]+: [-0-9.eE+na]+$' "$OUT/$name.txt" >>"$SUMMARY"
}

if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$SUMMARY"
fi
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$SUMMARY"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$SUMMARY"

# -----------------------------------------------------------------------------
# the first preset: the run users will do

# the 0.5B body on the toy set; SMOKE: a tiny body on the CPU, the same flags otherwise
if [ "$SMOKE" = 1 ]; then
    BODY="--model.tiny_hidden_size=64 --model.tiny_layers=2 --model.tiny_heads=4 --model.tiny_kv_heads=2 --model.tiny_intermediate_size=128"
    SIZES="--sft.steps=2 --sft.batch_size=4 --grpo.prompts_per_step=2 --grpo.group_size=2 --data.max_eval_examples=2 \
        --sampling.max_new_tokens=8 --sampling.kv_budget_tokens=20000"
    DECODE="--smoke"
    DECODE05="--smoke --profile"
    DECODE7B="--smoke"
    STEPS=(1 2 1)
    LIMITS=(120 60 60 60)
    DLIMITS=(60 60)
else
    BODY="--model.tiny_hidden_size=896 --model.tiny_layers=24 --model.tiny_heads=14 --model.tiny_kv_heads=2 --model.tiny_intermediate_size=4864"
    SIZES="--sft.steps=40 --grpo.prompts_per_step=64 --data.max_eval_examples=64"
    DECODE="--device cuda --shape qwen2.5-0.5b --batches 64,256 --arms graphs,compiled"
    DECODE05="--device cuda --shapes qwen2.5-0.5b --batches 64,256 --arms graphs,compiled --repeats 1 --profile"
    DECODE7B="--device cuda --shapes qwen2.5-7b --batches 256 --arms graphs,compiled --repeats 1"
    STEPS=(3 4 2)
    if ran decode05; then  # the engine preset: 540 s of limits in all (80 + 110 + 170 + 50 + 60 + 70)
        LIMITS=(170 50 0 60); DLIMITS=(80 110); TESTS_LIMIT=70
    else
        LIMITS=(200 70 100 80); DLIMITS=(90 120)
    fi
fi
# shellcheck disable=SC2086
part decode05 "${DLIMITS[0]}" $PY bench/policy_decode.py $DECODE05
# shellcheck disable=SC2086
part decode7b "${DLIMITS[1]}" $PY bench/policy_decode.py $DECODE7B
RUN_ARGS="configs/tiny.yaml --model.path=$RUNS/gpu/model05b $BODY --model.dtype=bfloat16 \
    --model.activation_checkpointing=true $SIZES --sft.lr=3e-4 --sft.stop_at_train_ex=0 --optim.lr=1e-5 \
    --grpo.dynamic_sampling=false --sampling.max_context=2048 --sampling.cuda_graphs=true \
    --sampling.paged_attention=auto --env.max_turns=3 --train.eval_every=0 --train.sample_every=0 \
    --train.threads=0 --train.out_dir=$RUNS/gpu_grpo"
GPU_RUN="train.py $RUN_ARGS"
TORCHRUN="$PY -m torch.distributed.run --standalone --nproc_per_node=1"
# shellcheck disable=SC2086
part grpo_run "${LIMITS[0]}" $TORCHRUN $GPU_RUN --train.steps="${STEPS[0]}" --train.resume=false
if ran grpo_run && [ -f $RUNS/gpu_grpo/metrics.jsonl ]; then
    $PY bench/run_summary.py $RUNS/gpu_grpo "$OUT/grpo_run.txt" --prefix grpo | tee -a "$SUMMARY"
fi
# shellcheck disable=SC2086
part grpo_resume "${LIMITS[1]}" $TORCHRUN $GPU_RUN --train.steps="${STEPS[1]}" --train.resume=true
if ran grpo_resume && [ -f $RUNS/gpu_grpo/metrics.jsonl ]; then
    $PY bench/run_summary.py $RUNS/gpu_grpo "$OUT/grpo_resume.txt" --prefix resumed --from-step "${STEPS[0]}" \
        | tee -a "$SUMMARY"
    cp $RUNS/gpu_grpo/metrics.jsonl "$OUT/grpo_metrics.jsonl"
fi
# shellcheck disable=SC2086
part decode "${LIMITS[2]}" $PY bench/policy_decode.py $DECODE
# LoRA r=32 on the seven projections from the grpo run's last whole checkpoint (the warm model)
LORA_BASE=$(ls -d $RUNS/gpu_grpo/ckpt_*/hf 2>/dev/null | tail -n 1)
# shellcheck disable=SC2086
part lora_run "${LIMITS[3]}" $TORCHRUN $GPU_RUN --model.path="${LORA_BASE:-$RUNS/gpu/model05b}" \
    --model.build_tiny=false --sft.steps=0 --model.lora_rank=32 --model.lora_alpha=64 --optim.lr=1e-4 \
    --train.steps="${STEPS[2]}" --train.resume=false --train.out_dir=$RUNS/gpu_lora
if ran lora_run && [ -f $RUNS/gpu_lora/metrics.jsonl ]; then
    $PY bench/run_summary.py $RUNS/gpu_lora "$OUT/lora_run.txt" --prefix lora | tee -a "$SUMMARY"
fi

# the grpo run's rollout phase against transformers generate on the same turn shapes
RVG_MODEL=$(ls -d $RUNS/gpu_grpo/ckpt_*/hf 2>/dev/null | tail -n 1)
RVG="--model.path=${RVG_MODEL:-$RUNS/gpu/model05b}"
[ "$SMOKE" = 1 ] && RVG="$RVG --smoke"
# shellcheck disable=SC2086
part rollout_vs_generate 60 $PY bench/rollout_vs_generate.py $RUN_ARGS $RVG
# where a B=256 decode step's time goes
if [ "$SMOKE" = 1 ]; then PROFILE="--smoke"; else PROFILE="--device cuda --shape qwen2.5-0.5b --batches 256 --arms graphs --repeats 1"; fi
# shellcheck disable=SC2086
part decode_profile 45 $PY bench/policy_decode.py $PROFILE --profile

# -----------------------------------------------------------------------------
# the second preset and the rest (bench/RESULTS.md has each part's figures)

# (1) tests: with xdist when present; distributed tests that need one GPU per rank skip themselves
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 12" || echo "")
if [ "$SMOKE" = 1 ]; then  # the dry run only collects: it runs inside the suite itself
    part tests 100 $PY -m pytest --collect-only -q -p no:cacheprovider tests
else
    # the files that use the GPU first: a part cut by its limit has named their results
    part tests "${TESTS_LIMIT:-100}" $PY -m pytest -v --tb=line -rfE -p no:cacheprovider $XDIST tests/test_cuda.py \
        tests/test_decode_step.py tests/test_engine.py tests/test_paged_attention.py tests/test_policy_sampler.py tests
fi

# (2) attention kernels
part attention 150 $PY bench/attention_probe.py

# (9) paged decode attention: flex (the sampler's default on CUDA) vs gather, before the sampler parts use it
part paged_attention 200 $PY bench/paged_attention.py --device cuda --batches 64,256 --context 1024

# (3) sampler vs transformers generate
part sampler 200 $PY bench/sampler.py --device cuda --shape qwen2.5-0.5b --batches 64,256 --pairs 2
part sampler_graphs 120 $PY bench/sampler.py --device cuda --shape qwen2.5-0.5b --batches 64,256 --pairs 1 --cuda-graphs

# (4) rollout scale (paged KV engine vs worst-case reservation)
if [ -f bench/rollout_scale.py ]; then
    part rollout_scale 170 $PY bench/rollout_scale.py --device cuda --shape qwen2.5-0.5b
fi

# (5) the update step
part train_step 150 $PY bench/train_step.py --device cuda --shape qwen2.5-0.5b

# (7) one 32k-token micro-batch, 7B shape
part long_microbatch 150 $PY bench/long_microbatch.py --shape qwen2.5-7b --tokens 32768

# (8) the GRPO update at the 7B recipe's shape (FlexAttention compiles on the first micro-batch)
part update_mfu 420 $PY bench/update_mfu.py --device cuda --compare

# (10) one GRPO step, ours against TRL's GRPOTrainer
if ran vs_trl && ! $PY -c "import trl" 2>/dev/null && [ -d wheels/trl ]; then
    $PY -m pip install -q --no-index --find-links wheels/trl trl datasets 2>&1 | tail -n 3
fi
if [ "$SMOKE" = 1 ]; then
    VS_TRL="--toy $RUNS --smoke"
elif [ -f runs/smollm2/config.json ] && [ -n "${SPIDER_DIR:-}" ]; then
    VS_TRL="--device cuda --dtype bfloat16 --vllm --pairs 4 --warmup"
else
    VS_TRL="--toy $RUNS --device cuda --dtype bfloat16 --vllm --pairs 4 --warmup"
fi
# shellcheck disable=SC2086
part vs_trl 300 $PY bench/vs_trl.py $VS_TRL

# (11) the real-model recipe (configs/smollm2_sql_env.yaml) at sql_env's own scale: 2 samples a
# prompt, 32 prompts a step, 200 steps after a warm start of 100 steps of 16 gold episodes, bf16,
# every held-out question. Dynamic sampling stays on execution match, as in the config: trained on
# every group, pairs of wrong answers learn sql_env's dense shaping alone (on 2 CPU cores 6 such
# steps lowered held-out EX 17% -> 9%, while 30 steps on EX raised it 17% -> 26%). On runs/smollm2
# and $SPIDER_DIR when the machine has them (the folder is 540 MB and the wheel 93 MB: neither
# travels with a loan's working tree), else on the toy set with a random body in SmolLM2-135M's
# shape (its 1k vocabulary, not 49k): then only the timings mean anything. Cut at its limit, it has logged every step it finished (metrics.jsonl).
SQL_ENV_SCALE="--model.dtype=bfloat16 --grpo.group_size=2 --grpo.prompts_per_step=32 \
    --sft.steps=100 --sft.batch_size=16 --train.steps=200 --train.eval_every=50 --train.sample_every=0 \
    --train.threads=0 --train.resume=false --train.out_dir=$RUNS/gpu_smollm2"
SMOL_BODY="--model.tiny_hidden_size=576 --model.tiny_layers=30 --model.tiny_heads=9 --model.tiny_kv_heads=3 \
    --model.tiny_intermediate_size=1536 --model.path=$RUNS/gpu/smollm2_shape"
if [ "$SMOKE" = 1 ]; then
    SMOL="configs/tiny_actions.yaml $SQL_ENV_SCALE --model.path=$RUNS/gpu/smollm2_smoke --sft.steps=2 \
        --sft.batch_size=4 --sft.stop_at_train_ex=0 --grpo.prompts_per_step=2 --train.steps=1 --data.max_eval_examples=2 \
        --sampling.max_new_tokens=8 --sampling.kv_budget_tokens=20000"
    SMOL_LIMIT=120
elif [ -f runs/smollm2/config.json ] && [ -n "${SPIDER_DIR:-}" ] && [ -f runs/sql_env/train.jsonl ]; then
    SMOL="configs/smollm2_sql_env.yaml --data.db_root=$SPIDER_DIR $SQL_ENV_SCALE --data.max_eval_examples=0 \
        --data.max_unseen_examples=0"
    SMOL_LIMIT=520
else
    SMOL="configs/tiny_actions.yaml $SMOL_BODY $SQL_ENV_SCALE --sft.stop_at_train_ex=0 --sampling.max_new_tokens=96 \
        --sampling.max_context=1024 --env.step_budget=5"
    SMOL_LIMIT=520
fi
# shellcheck disable=SC2086
part smollm2 "$SMOL_LIMIT" $TORCHRUN train.py $SMOL
if ran smollm2 && [ -f $RUNS/gpu_smollm2/metrics.jsonl ]; then
    $PY bench/run_summary.py $RUNS/gpu_smollm2 "$OUT/smollm2.txt" --prefix smollm2 | tee -a "$SUMMARY"
fi

echo "=== headline figures"
cat "$SUMMARY"
