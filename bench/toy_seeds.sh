#!/usr/bin/env bash
# The main command (configs/tiny.yaml, 2 CPU ranks) from scratch on several seeds, for the README's
# table of runs: each seed builds its own tiny model (its init depends on the seed) in
# runs/seed<S><TAG>/model and runs in runs/seed<S><TAG> (log: runs/seed<S><TAG>.log), GPUs hidden so
# every run is the CPU run a user gets. Then prints bench/toy_table.py's table: held-out EX, its
# gain, recovery and tool calls per seed, checked against the demo's goals, and the worst run.
#
#   bash bench/toy_seeds.sh [SEEDS...]          # default: 0 1 2 3 4 5
#   TAG=_mb2048 EXTRA="--optim.micro_batch_tokens=2048" bash bench/toy_seeds.sh 0 1 2
#                                               # another float path: micro-batches of 2048 tokens
#                                               # split the warm start's batches too (reduction order)
#   JOBS=1 bash bench/toy_seeds.sh 3            # runs at a time (default: one per 2 cores)
#   CONFIG=configs/tiny_actions.yaml TAG=_actions bash bench/toy_seeds.sh 0 1 2
#                                               # another recipe (the table then checks its goals)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
SEEDS=${*:-0 1 2 3 4 5}
TAG=${TAG:-}
EXTRA=${EXTRA:-}
CONFIG=${CONFIG:-configs/tiny.yaml}
JOBS=${JOBS:-$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))}
export CUDA_VISIBLE_DEVICES=""
# once, not per seed (concurrent seeds would race to build it); again when it is absent or from an
# older prepare_toy.py: the rule every run applies (tiny.prepare_toy_set)
$PY -c 'import config; from toy import tiny; tiny.prepare_toy_set(config.load_config(["'"$CONFIG"'"]).data)' >/dev/null
start=$SECONDS
runs=()
for S in $SEEDS; do
    R="runs/seed$S$TAG"
    runs+=("$R")
    # --standalone picks a free port; $EXTRA unquoted on purpose: several overrides
    # shellcheck disable=SC2086
    $PY -m torch.distributed.run --standalone --nproc_per_node=2 train.py "$CONFIG" \
        --train.seed="$S" --model.path="$R/model" --train.out_dir="$R" $EXTRA >"$R.log" 2>&1 &
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n; done
done
wait
echo "all seeds: $((SECONDS - start)) s"
$PY bench/toy_table.py "${runs[@]}"
