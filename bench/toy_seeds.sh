#!/usr/bin/env bash
# The main command (configs/tiny.yaml, 2 CPU ranks) on several seeds at once, for the README's
# per-seed EX table: at once with 2 cores per seed (3 seeds on 6+ cores), else one after another; GPUs hidden so
# every run is the CPU run a user gets. Prints each seed's held-out EX sequence and tool calls last.
#
#   bash bench/toy_seeds.sh [SEEDS...]        # default: 1 2 3; runs in runs/seedS, logs runs/seedS.log
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SEEDS=${*:-1 2 3}
export CUDA_VISIBLE_DEVICES=""
# once, not per seed (concurrent seeds would race to build it); again when it is absent or from an
# older prepare_toy.py: the rule every run applies (tiny.prepare_toy_set)
$PY -c 'import config, tiny; tiny.prepare_toy_set(config.load_config(["configs/tiny.yaml"]).data)' >/dev/null
start=$SECONDS
n_seeds=$(echo $SEEDS | wc -w)
for S in $SEEDS; do
    # each seed builds its own tiny model (its init depends on the seed); --standalone picks a free port
    $PY -m torch.distributed.run --standalone --nproc_per_node=2 train.py configs/tiny.yaml \
        --train.seed="$S" --model.path="runs/seed$S/model" --train.out_dir="runs/seed$S" \
        >"runs/seed$S.log" 2>&1 &
    # fewer than 2 cores per seed: one seed at a time (each then takes the main command's time)
    [ "$(nproc)" -lt $((2 * n_seeds)) ] && wait
done
wait
echo "all seeds: $((SECONDS - start)) s"
for S in $SEEDS; do
    evals=$(grep -h "^\[eval @" "runs/seed$S.log" | sed -E 's/.*EX ([0-9.]+)%.*tool-calls ([0-9.]+).*/\1 (\2)/' | paste -sd' ')
    stop=$(grep -ho "sft: stopped at step [0-9]*" "runs/seed$S.log" | grep -o "[0-9]*$")
    echo "seed_$S: sft ${stop:-all} steps | held-out EX (tool calls): $evals"
done
