#!/usr/bin/env bash
# Every GPU figure of bench/RESULTS.md in one command: ~10 min on one H100, random weights in real
# shapes, nothing downloaded. Each part runs under its own time limit, a failing part does not stop
# the others, and the headline lines (`name: value`) of all parts are repeated at the end.
#
#   bash bench/gpu.sh [OUT_DIR]          # OUT_DIR (default runs/gpu) gets one log per part
#   PARTS="tests grpo_steps" bash bench/gpu.sh   # only the parts named (default: all)
#
# Parts: (1) the test suite with CUDA visible; (2) attention kernels at our shapes; (3) the sampler
# against transformers `generate`, Qwen2.5-0.5B shape, bf16, batch 64 and 256; (4) the rollout-scale
# benchmark at the SkyRL ratio; (5) the update step (packing, MFU, peak memory); (6) ten GRPO steps
# of a 0.5B-bodied model on the toy data, multi-turn, one process: time split, tokens/s, peak memory
# per phase against memory_estimate; (6b) the same with LoRA r=32 (lora_steps); (7) one 32k-token micro-batch of a Qwen2.5-7B-shaped model
# with activation checkpointing; (8) the real update at the 7B shape: 32k-token packed rows with
# shared prompts, FlexAttention block mask, FSDP2, loss_index, MFU per micro-batch and per step,
# against a dense causal kernel on the same tokens (update_mfu; the blocks that fit in memory);
# (9) decode attention over the paged KV cache, FlexAttention in place vs gather + SDPA, B=64/256,
# 0.5B shape, graphs replayed: us per layer and % of the HBM roofline (paged_attention).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

PARTS=${PARTS:-tests attention paged_attention sampler sampler_graphs rollout_scale train_step grpo_steps lora_steps long_microbatch update_mfu}

part() {  # part NAME SECONDS COMMAND...: run under a time limit, log to $OUT/NAME.txt, keep going
    local name=$1 limit=$2
    shift 2
    case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
    echo "=== $name (limit ${limit}s): $*" | tee -a "$SUMMARY"
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    tail -n 25 "$OUT/$name.txt"
    echo "--- $name: exit $rc after $((SECONDS - start)) s" | tee -a "$SUMMARY"
    grep -E '^[a-z0-9_]+: [-0-9.eE+na]+$' "$OUT/$name.txt" >>"$SUMMARY"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$SUMMARY"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$SUMMARY"

# (1) tests: with xdist when present; distributed tests that need one GPU per rank skip themselves
XDIST=$($PY -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
part tests 140 $PY -m pytest -q -p no:cacheprovider $XDIST tests

# (2) attention kernels
part attention 150 $PY bench/attention_probe.py

# (9) paged decode attention: flex (the sampler's default on CUDA) vs gather, before the sampler parts use it
part paged_attention 200 $PY bench/paged_attention.py --device cuda --batches 64,256 --context 1024

# (3) sampler vs transformers generate
part sampler 200 $PY bench/sampler.py --device cuda --shape qwen2.5-0.5b --batches 64,256 --pairs 2
part sampler_graphs 200 $PY bench/sampler.py --device cuda --shape qwen2.5-0.5b --batches 64,256 --pairs 2 --cuda-graphs

# (4) rollout scale (paged KV engine vs worst-case reservation)
if [ -f bench/rollout_scale.py ]; then
    part rollout_scale 170 $PY bench/rollout_scale.py --device cuda --shape qwen2.5-0.5b
fi

# (5) the update step
part train_step 150 $PY bench/train_step.py --device cuda --shape qwen2.5-0.5b

# (6) ten GRPO steps: configs/tiny.yaml's toy data and 1k-token BPE vocabulary with a Qwen2.5-0.5B
# body (24 layers, 896 wide, 14/2 heads): ~0.36B parameters, bf16 compute. The SFT warm start
# gives the policy the protocol; dynamic sampling is off so every step updates on all episodes.
part grpo_steps 250 $PY train.py configs/tiny.yaml --model.path=runs/gpu/model05b --model.dtype=bfloat16 \
    --model.tiny_hidden_size=896 --model.tiny_layers=24 --model.tiny_heads=14 --model.tiny_kv_heads=2 \
    --model.tiny_intermediate_size=4864 --model.activation_checkpointing=true \
    --sft.steps=60 --sft.lr=3e-4 --optim.lr=1e-5 --grpo.dynamic_sampling=false --grpo.prompts_per_step=64 \
    --sampling.max_context=2048 --sampling.cuda_graphs=true --env.max_turns=3 --data.max_eval_examples=64 --train.steps=10 --train.eval_every=0 \
    --train.sample_every=0 --train.threads=0 --train.resume=false --train.out_dir=runs/gpu_grpo_run
[ -f runs/gpu_grpo_run/metrics.jsonl ] && cp runs/gpu_grpo_run/metrics.jsonl "$OUT/grpo_metrics.jsonl"

# (6b) the same model with LoRA r=32 on all seven projections (the 7B LoRA recipe's adapter): the
# SFT warm start trains the full model into the run's base/, then 3 GRPO steps train only the
# adapters (frozen bf16 base, merged-weight rollouts); headlines: step time, peak GB per phase.
part lora_steps 300 $PY train.py configs/tiny.yaml --model.path=runs/gpu/model05b --model.dtype=bfloat16 \
    --model.tiny_hidden_size=896 --model.tiny_layers=24 --model.tiny_heads=14 --model.tiny_kv_heads=2 \
    --model.tiny_intermediate_size=4864 --model.activation_checkpointing=true \
    --model.lora_rank=32 --model.lora_alpha=64 --sft.steps=60 --sft.lr=3e-4 --optim.lr=1e-4 \
    --grpo.dynamic_sampling=false --grpo.prompts_per_step=64 --sampling.max_context=2048 --env.max_turns=3 \
    --data.max_eval_examples=64 --train.steps=3 --train.eval_every=0 --train.sample_every=0 --train.threads=0 \
    --train.resume=false --train.out_dir=runs/gpu_lora_run
[ -f runs/gpu_lora_run/metrics.jsonl ] && $PY -c '
import json, sys
m = [r for r in map(json.loads, open(sys.argv[1])) if "time/step" in r]
print("lora_step_s:", round(sum(r["time/step"] for r in m[1:]) / max(1, len(m) - 1), 2))  # after the first
for k in ("rollout", "update"):
    print(f"lora_{k}_peak_gb:", round(max(r.get(f"mem/{k}_peak_gb", 0) for r in m), 2))
' runs/gpu_lora_run/metrics.jsonl | tee -a "$SUMMARY"

# (7) one 32k-token micro-batch, 7B shape
part long_microbatch 150 $PY bench/long_microbatch.py --shape qwen2.5-7b --tokens 32768

# (8) the GRPO update at the 7B recipe's shape (FlexAttention compiles on the first micro-batch)
part update_mfu 420 $PY bench/update_mfu.py --device cuda --compare

echo "=== headline figures"
cat "$SUMMARY"
