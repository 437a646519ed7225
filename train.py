"""GRPO for multi-turn text-to-SQL under FSDP2. One file, top to bottom: config → process group →
model and its sampler → (SFT warm start) → loop of grpo_step (sample and reward → keep mask →
credit → update → weight sync) → log / eval / checkpoint.

    torchrun --standalone --nproc_per_node=2 train.py configs/tiny.yaml     # CPU (gloo)
    torchrun --standalone --nproc_per_node=8 train.py configs/skyrl_sql_7b.yaml --train.out_dir=runs/x
    python train.py configs/tiny.yaml --grpo.clip_high=0.28                  # one process
Multi-node: torchrun --nnodes=2 --node_rank=R --nproc_per_node=8 --rdzv_backend=c10d
    --rdzv_endpoint=HOST:29500 --rdzv_id=RUN train.py configs/skyrl_sql_7b_2node.yaml
Process group, FSDP2 sharding and the collectives live in trainer/distributed.py.
"""
from __future__ import annotations

import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import config as C
import grpo
import plot
import sft
from eval import evaluate, reduce_summary, report_random_floor, summarise
from model import Transformer
from rollout import Episode
from sqltask import chat, dataset
from stream import RolloutStream
from toy import tiny
from trainer import checkpoint, config_checks, lora, malloc_tuning, optim, packing, policy_update, runguard
from trainer.memory import size_kv_pool
from trainer.distributed import (PeakMemory, all_gather_list, all_sum, close, compute_dtype, map_shared,
                                 param_count, setup_dist, shard)
from trainer.loss_scale import LossScaler
from trainer.policy_sampler import PolicySampler
from trainer.run_log import Log, Phases

# -----------------------------------------------------------------------------
# data and prompts


def load_splits(tok, cfg: C.Config, log: Log, rank: int, world: int) -> tuple[list[dict], dict[str, list[dict]]]:
    """(train records, held-out records by log prefix: "eval", and "unseen" when
    data.unseen_eval_path is set). Every problem of the files and their databases is reported at
    once (DatasetError); records whose gold query fails on its database are dropped and counted
    (each rank runs a share of the golds; all ranks drop the same ones), as are those whose prompt
    exceeds data.max_prompt_tokens (or cannot fit sampling.max_context with one generated token)."""
    d = cfg.data
    files = [("train", d.train_path, d.max_train_examples), ("eval", d.eval_path, d.max_eval_examples)]
    if d.unseen_eval_path:
        files.append(("unseen", d.unseen_eval_path, d.max_unseen_examples))
    splits, problems = {}, []
    for name, path, limit in files:
        try:
            splits[name] = dataset.load_examples(path, d.db_root, limit)
        except dataset.DatasetError as e:
            problems.append(str(e))
    if problems:
        raise dataset.DatasetError("\n".join(problems))
    every = [ex for name, _, _ in files for ex in splits[name]]
    errors = map_shared(lambda exs: dataset.gold_failures(exs, cfg.reward), every, rank, world)  # a share per rank
    out, start = {}, 0
    for name, path, _ in files:
        exs, errs = splits[name], errors[start:start + len(splits[name])]
        start += len(exs)
        exs, note = dataset.drop_failing_golds(exs, errs, name)
        if note:
            log.print(f"WARNING: {note}")
        lengths = [len(chat.render_prompt(tok, ex, d, cfg.env.protocol, d.db_root)) for ex in exs]
        kept, dropped = dataset.fit_prompts(exs, lengths, d.max_prompt_tokens, cfg.sampling.max_context)
        if dropped:
            log.print(f"{name}: dropped {dropped} of {len(exs)} examples whose prompt is longer than "
                      f"{min(d.max_prompt_tokens, cfg.sampling.max_context - 1)} tokens "
                      f"(data.max_prompt_tokens {d.max_prompt_tokens}, sampling.max_context "
                      f"{cfg.sampling.max_context})")
        if not kept:
            raise C.ConfigError(f"{name}: every prompt of {path} is too long (data.max_prompt_tokens)")
        out[name] = kept
    train_ex = out.pop("train")
    return train_ex, out


def evaluate_held_out(sampler, tok, held_out: dict[str, list[dict]], cfg: C.Config, rank: int, world: int,
                      device, log: Log, step: int) -> dict:
    """Every held-out set at this step (eval/*, unseen/*); returns their metrics."""
    metrics = {}
    for prefix, exs in held_out.items():
        metrics.update(evaluate(sampler, tok, exs, cfg, rank, world, device, log, step, prefix=prefix))
    return metrics


# -----------------------------------------------------------------------------
# one GRPO step: sample, reward, keep mask, credit, update, sync


@dataclass
class Run:
    """What a GRPO step reads and moves: the policy (FSDP2-sharded, fp32 masters), its frozen KL
    reference (None without a KL term), its sampler (the inference copy the rollouts decode on),
    the optimizer and its schedule, float16's loss scaler (a no-op in other dtypes), and where this rank runs."""
    model: object
    ref_model: object | None
    sampler: PolicySampler
    optimizer: object
    scheduler: object
    scaler: LossScaler
    tokenizer: object
    cfg: C.Config
    log: Log
    rank: int
    world: int
    device: torch.device


def collect(run: Run, stream: RolloutStream, step: int, phase) -> tuple[list[Episode], list[Episode]]:
    """A step's episodes: (kept, seen), this rank's. A round (stream.next_round) gives this rank's
    share of the next chunk (grpo.prompts_per_step prompts over all ranks), a group of episodes for
    each prompt, every one ended and rewarded (with stream.sampling_steps_ahead >= 1 most of it was
    decoded during the steps before). Then the keep mask (dynamic sampling: groups whose rewards,
    or verdicts, are all equal carry no signal). Refill rounds follow, at most
    grpo.max_resample_rounds, until prompts_per_step groups are kept over all ranks; kept is cut to
    a rank share's episodes, seen holds every sampled episode (the step's metrics are over them)."""
    grpo_cfg = run.cfg.grpo
    G, P = grpo_cfg.group_size, grpo_cfg.prompts_per_step
    share_episodes = P // run.world * G  # episodes of a rank share: what this rank trains a step
    kept, seen = [], []
    for _ in range(1 + (grpo_cfg.max_resample_rounds if grpo_cfg.dynamic_sampling else 0)):
        episodes = stream.next_round(step, phase, first_group=len(seen) // G)
        seen += episodes
        keep = grpo.keep_mask(episodes, G, grpo_cfg.dynamic_sampling_metric) if grpo_cfg.dynamic_sampling \
            else [True] * len(episodes)
        kept += [e for e, keep_it in zip(episodes, keep) if keep_it]
        if not grpo_cfg.dynamic_sampling or all_sum([min(len(kept), share_episodes)], run.device)[0] >= P * G:
            break
    return kept[:share_episodes], seen


def grpo_step(run: Run, stream: RolloutStream, step: int, phase) -> tuple[list, list, dict]:
    """One GRPO step, every move in order. A step (the word alone always means this one) trains one
    batch of groups with one update, and the trainer at step s holds the weights of version s (each
    sampled token records its version: Trajectory.versions). Its moves: sample and reward (collect, with the keep mask), the
    credit (grpo.token_advantages: each loss token's advantage; grpo.loss_episodes: which episodes
    enter the loss, all but the truncated ones with grpo.mask_truncated), the update (update, below: old /
    reference logprobs once, then per mini-batch each micro-batch's packed forward, grpo.policy_loss
    on its LossInputs, backward, and the optimizer step) and the weight sync (the sampler's copy
    refreshed when a step moved the weights; with stream.sampling_steps_ahead >= 1 the episodes in
    flight continue on the new weights). Returns (kept, seen, metrics): the episodes trained on and
    sampled (this rank's), and the update's metrics (token-weighted loss metrics, grad norms,
    kept_frac) with the stream's (stream.step_metrics: the tail, the staleness of the trained tokens)."""
    grpo_cfg = run.cfg.grpo
    kept, seen = collect(run, stream, step, phase)  # sample, reward, keep mask
    n_kept, n_seen = all_sum([len(kept), len(seen)], run.device)
    metrics, n_trained, trajs = {}, 0, []
    if n_kept > 0:
        with phase("credit"):
            advantages = grpo.token_advantages(kept, grpo_cfg)  # the credit: (n_loss_tokens,) per episode
            trajs, advantages = grpo.loss_episodes(kept, advantages, grpo_cfg)  # mask_truncated drops truncated ones
        n_trained = all_sum([len(trajs)], run.device)[0]
    if n_trained > 0:  # every rank joins the update (FSDP collectives), even one with no episode to train
        with phase("update"):
            metrics = update(run, trajs, advantages, step)
    else:  # all groups had equal rewards (or every kept episode was masked): nothing to learn from, not an error
        why = "every kept episode was truncated (grpo.mask_truncated)" if n_kept else "every group had equal rewards"
        run.log.print(f"step {step + 1}: {why}: no update")
    if any(math.isfinite(x) for x in metrics.pop("grad_norms", [])):  # the weights changed
        with phase("sync"):
            run.sampler.refresh(run.model)  # weight sync: the next rollout and eval sample the new policy
    metrics["kept_frac"] = n_kept / max(n_seen, 1)
    metrics["masked_frac"] = (n_kept - n_trained) / max(n_kept, 1)  # kept, left out of the loss (mask_truncated)
    metrics.update(stream.step_metrics(trajs, step, run.device))  # the tail, the trained tokens' staleness
    return kept, seen, metrics


def update(run: Run, trajs: list, advantages: list[torch.Tensor], step: int = 0) -> dict:
    """The update of one batch: old / reference logprobs once, then per mini-batch (grpo.ppo_epochs x
    grpo.mini_batches slices) each micro-batch's packed forward, its LossInputs, grpo.policy_loss,
    backward (float16: of the loss times run.scaler's scale), and one optimizer step. advantages[i]:
    trajectory i's, one per loss token; step: the trainer's step (each token's age is step minus the
    version that sampled it). Returns the update's metrics (policy_update.UpdateMetrics.summary)."""
    cfg, grpo_cfg, model = run.cfg, run.cfg.grpo, run.model
    tokens = policy_update.batch_tokens(model, run.ref_model, trajs, advantages, cfg, run.device, step)  # per seq.
    metrics = policy_update.UpdateMetrics()
    for idx in policy_update.mini_batches(len(trajs), grpo_cfg):
        norm = grpo.global_norm(policy_update.loss_masks(trajs, idx), grpo_cfg.loss_agg)  # every rank: a collective
        for mb in policy_update.micro_batches(model, trajs, idx, cfg, run.device):  # packed, dropout on
            logprobs, entropy = packing.forward(model, mb, run.device, cfg.sampling.temperature)  # (N,) loss tokens
            inputs = grpo.loss_inputs(logprobs, entropy, mb, idx, tokens)  # (B, T) each
            loss, loss_metrics = grpo.policy_loss(inputs, norm, grpo_cfg, cfg.sampling.max_context)
            # FSDP2 averages gradients over ranks: x world makes it the sum; float16: x the loss scale too
            run.scaler.scale(loss * run.world).backward()
            metrics.add(loss_metrics, inputs.mask)
        grad_norm = optim.step_optimizer(model, run.optimizer, run.scheduler, cfg.optim, run.scaler)  # unscale, clip,
        metrics.step(grad_norm, run.scaler.overflowed)  # step; a non-finite norm skips it (float16: an overflow too)
    return metrics.summary()


def save(run: Run, stream: RolloutStream, step: int) -> str | None:
    """The checkpoint of step `step` (a collective; the path on rank 0): weights, optimizer, schedule
    and RNG (trainer/checkpoint.py) and the run's own state, written here and only here: the prompt
    order's cursor, the log's sizes, float16's loss scale and every rank's stream (its chunks not yet
    trained, with the episodes in flight: none between synchronous steps)."""
    cfg = run.cfg
    extra = {"cursor": stream.cursor, "log_sizes": run.log.sizes(), "loss_scale": run.scaler.state_dict(),
             "stream": all_gather_list([stream.state_dict()])}  # one per rank, in rank order
    return checkpoint.save(cfg.train.out_dir, step, run.model, run.optimizer, run.scheduler, run.tokenizer, cfg, extra,
                           keep=cfg.train.keep_checkpoints)


# -----------------------------------------------------------------------------
# main


def main():
    t_launch = time.time()
    # Checks that need no process group come first: a user error (runguard.run_main prints it once,
    # on rank 0) then stops every rank before any collective, warm start or checkpoint
    cfg = config_checks.validate(C.load_config(), runguard.launch_world())
    if not cfg.model.build_tiny:  # a tiny model is checked once built (a build stopped midway is redone)
        config_checks.check_model_folder(cfg.model.path)
    out_dir_lock = runguard.lock_out_dir(cfg.train.out_dir) if runguard.launch_rank() == 0 else None  # held till exit
    rank, world, device = setup_dist(cfg.train.dist_timeout_s)
    config_checks.check_device_dtype(cfg, device)  # bfloat16 on a GPU without it: names float16
    runguard.stop_with_launcher()  # torchrun killed (kill -9): its ranks stop, not train on as orphans
    stop = runguard.StopSignals()  # Ctrl-C / SIGTERM: at once in set-up, after the step in SFT and GRPO
    if device.type == "cpu":  # large CPU tensors reuse freed heap memory, no fresh pages per step
        malloc_tuning.keep_freed_memory()
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    log = Log(cfg, rank)
    log.print(C.dump(cfg))
    if cfg.stream.sampling_steps_ahead and cfg.grpo.rollout_is == "none":
        log.print(f"WARNING: stream.sampling_steps_ahead={cfg.stream.sampling_steps_ahead} with grpo.rollout_is=none "
                  "trains tokens sampled by older weights as if the current ones had (no importance weight): on the "
                  "toy, k=2 collapsed by step 30 this way; --grpo.rollout_is=token-tis weighs each token by "
                  "pi_old/pi_sampler (grpo.py: the three policies under streaming)")
    if cfg.data.prepare_toy or cfg.model.build_tiny:  # the toy recipes: their data and model, when absent
        # the tiny tokenizer trains on the run's own text (prompts, the warm start's gold episodes)
        runguard.on_rank0(lambda: tiny.prepare_assets(cfg, Transformer, sft.gold_texts), rank)  # a user error stops every rank
    config_checks.check_model_folder(cfg.model.path)
    torch.manual_seed(cfg.train.seed)

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)  # no network at run time
    train_ex, held_out = load_splits(tok, cfg, log, rank, world)
    eval_ex = held_out["eval"]  # the warm start's evals and the random floor read this one
    ck = checkpoint.latest(cfg.train.out_dir) if cfg.train.resume != "false" else None
    # a warm start stopped before GRPO began (no ckpt_000000 yet) continues from its last save
    warm = checkpoint.warm_start_save(cfg.train.out_dir) if cfg.train.resume != "false" and not ck \
        and cfg.sft.steps > 0 else None
    if ck or warm:
        checkpoint.check_resumable(ck or warm, cfg, tok)
    else:
        log.set_aside()
        if rank == 0 and (moved := checkpoint.set_aside(cfg.train.out_dir)):
            log.print(f"note: {cfg.train.out_dir} held an earlier run's checkpoints (train.resume=false): moved to {moved}")
    use_lora = cfg.model.lora_rank > 0
    if use_lora and not ck and cfg.sft.steps > 0:
        # the SFT warm start trains the full model, then LoRA adapts the warm weights: SkyRL's
        # LoRA recipe adapts an already instruction-tuned base, and a rank-r adapter on a random
        # tiny model learns little
        sft.warm_start_base(tok, train_ex, eval_ex, cfg, rank, world, device, log, resume_from=warm, stop=stop)
    # fp32 master weights on every world size; model.dtype is the compute dtype (FSDP2 casts).
    # LoRA: the base (model.path, or <out_dir>/base after a warm start) is frozen and shard()
    # keeps it in the compute dtype; only the fp32 adapters are masters
    base_path = checkpoint.lora_base_path(cfg) if use_lora else cfg.model.path
    model = Transformer.from_pretrained(base_path, dtype=torch.float32, device=device)
    model.set_activation_checkpointing(cfg.model.activation_checkpointing)
    model.fp32_lm_head = cfg.model.fp32_lm_head
    if use_lora:
        spec = lora.apply(model, cfg.model)
        log.print(f"LoRA: rank {spec.rank}, alpha {spec.alpha:g}, targets {','.join(spec.targets)}, base {base_path}")
    # memory: the KV pool sized (sampling.kv_budget_tokens auto) from what is left once the rest of the
    # run is counted, and a config that cannot fit stopped here, before anything large is allocated
    # (this rank already holds the loaded weights)
    sampling_cfg, _ = size_kv_pool(model, cfg, world, device, max(map(len, held_out.values())), log.print)
    model = shard(model, compute_dtype(cfg), cfg.model.fsdp_unit)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # DTensor: global count
    log.print(f"model: {param_count(model) / 1e6:.2f}M params, {trainable / 1e6:.3f}M trainable, world {world}, "
              f"device {device.type}, fp32 masters, {cfg.model.dtype} compute")
    optim_cfg = cfg.optim
    optimizer, scheduler = optim.make_optimizer(model, optim_cfg, optim_cfg.lr, optim_cfg.warmup_steps,
                                          cfg.train.steps * cfg.grpo.ppo_epochs * cfg.grpo.mini_batches)
    # the sampler: an inference copy of the policy in the compute dtype and one engine, kept for the run
    sampler = PolicySampler(model, sampling_cfg, dtype=compute_dtype(cfg))
    # float16: dynamic loss scaling, one scaler from the warm start through GRPO (inactive otherwise)
    scaler = LossScaler(optim_cfg, compute_dtype(cfg), warn=log.print)
    if cfg.model.dtype != "float32":
        log.print(f"{cfg.model.dtype}: trainer forward/backward, KL reference and sampler (weights, KV cache); fp32: "
                  "master weights, reduced gradients, AdamW, logits' log-softmax" +
                  (f"; loss scale from {scaler.scale_value:g}" if scaler.active else ""))
    # what a GRPO step reads and moves (the KL reference joins once ckpt_000000, its weights, exists)
    run = Run(model, None, sampler, optimizer, scheduler, scaler, tok, cfg, log, rank, world, device)
    stream = RolloutStream(sampler, tok, train_ex, cfg, rank, world)  # the training prompts' episodes
    step, bad, synced = 0, 0, False  # synced: the sampler holds the policy's current weights
    if ck:
        extra = checkpoint.load(ck, model, optimizer, scheduler)
        step = extra["step"]
        stream.load_state_dict(extra.get("stream"), extra["cursor"])  # k >= 1: the episodes in flight
        scaler.load_state_dict(extra.get("loss_scale"))
        log.rewind(extra.get("log_sizes"))  # what was logged after the checkpoint is logged again
        # the config's lr wins over the saved one (a no-op when unchanged: resume stays exact)
        scheduler.base_lrs = [optim_cfg.lr for _ in optimizer.param_groups]
        for group, lr_at in zip(optimizer.param_groups, scheduler.lr_lambdas):
            group["initial_lr"], group["lr"] = optim_cfg.lr, optim_cfg.lr * lr_at(scheduler.last_epoch)
        log.print(f"resumed from {ck} at step {step}")
    else:
        if cfg.sft.steps > 0 and not use_lora:  # syncs the sampler before each of its evals; saves as it goes
            synced = sft.run_sft(model, sampler, tok, train_ex, eval_ex, cfg, rank, world, device, log,
                                 resume_from=warm, stop=stop, scaler=scaler)
        save(run, stream, 0)
    if rank == 0:  # the warm start's save is superseded by ckpt_000000 (the weights GRPO starts from)
        shutil.rmtree(Path(cfg.train.out_dir) / checkpoint.WARM_START, ignore_errors=True)
    if not synced:
        sampler.refresh(model)  # weight sync: the weights GRPO starts from
    if sampler.warm_up_s:  # CUDA: the first refresh compiled (or loaded from disk) and captured the decode step
        log.print(f"sampler: decode step compiled and captured in {sampler.warm_up_s:.1f} s")
    if step == 0:  # held-out EX before any GRPO step (after the warm start), beside the random floor
        warm = evaluate_held_out(sampler, tok, held_out, cfg, rank, world, device, log, step)
        if rank == 0:
            report_random_floor(eval_ex, cfg, log, warm)

    if cfg.grpo.kl_beta > 0:  # the frozen reference is the policy at GRPO start (after SFT): ckpt 0
        # (LoRA: the base itself, since every adapter starts at B = 0). Frozen before shard():
        # kept in the compute dtype, the same values FSDP2 would have cast fp32 masters to
        ref_path = base_path if use_lora else str(Path(cfg.train.out_dir) / "ckpt_000000" / "hf")
        ref_model = Transformer.from_pretrained(ref_path, dtype=torch.float32, device=device)
        run.ref_model = shard(ref_model.requires_grad_(False), compute_dtype(cfg), cfg.model.fsdp_unit)

    stop.at_step_boundary()  # from here a signal stops the run after its step, with a checkpoint
    saved_at, stopped = step, 0
    t_start, first_step = time.time(), step
    speed = {"sampled": 0.0, "rollout_s": 0.0, "trained": 0.0, "update_s": 0.0}  # the last line's tokens/s
    phase = Phases(PeakMemory(device))  # seconds per phase (time/*) and, on CUDA, peak GB (mem/*_peak_gb)
    while step < cfg.train.steps:
        t0 = time.time()
        kept, seen, step_metrics = grpo_step(run, stream, step, phase)  # sample, reward, credit, update, sync
        step += 1

        # log / eval / save
        bad = bad + 1 if step_metrics.get("skipped", 0) else 0
        summary = reduce_summary(summarise(seen), device)  # all sampled episodes, not only kept
        n_seen, n_trained = all_sum([len(seen), sum(len(e.trajectory.ids) for e in kept)], device)
        seconds = phase.pop()
        tok_s = summary["resp_tokens"] * n_seen / max(seconds["rollout"], 1e-9) / world
        for key, v in (("sampled", summary["resp_tokens"] * n_seen), ("rollout_s", seconds["rollout"]),
                       ("trained", n_trained), ("update_s", seconds.get("update", 0.0))):
            speed[key] += v
        dt = time.time() - t0
        eta = (time.time() - t_start) / (step - first_step) * (cfg.train.steps - step)
        logged = {**{f"train/{k}": v for k, v in summary.items()}, **{f"train/{k}": v for k, v in step_metrics.items()},
                  **{f"time/{k}": v for k, v in seconds.items()}, "time/step": dt,
                  "train/tokens_per_s": tok_s, "train/lr": scheduler.get_last_lr()[0], **phase.mem.metrics(),
                  **{f"train/{k}": v for k, v in scaler.metrics().items()}}  # float16: scale, cumulative skips
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            log.metrics(step, logged)
            log.print(f"step {step}/{cfg.train.steps} | reward {summary['reward']:+.3f} EX {100 * summary['ex']:.1f}% "
                      f"fmt-err {100 * summary['format_err']:.1f}% trunc {100 * summary['truncated']:.1f}% "
                      f"turns {summary['turns']:.2f} tools {summary['tool_calls']:.2f} | "
                      f"clip {step_metrics.get('clip_frac', 0):.3f} gnorm {step_metrics.get('grad_norm', 0):.3f} | "
                      + (f"scale {scaler.scale_value:g} skips {scaler.overflow_skips} | " if scaler.active else "")
                      + f"{tok_s:.0f} tok/s live {step_metrics['live_row_frac']:.2f}"
                      + (f" stale {step_metrics['staleness_mean']:.2f}" if cfg.stream.sampling_steps_ahead else "")
                      + f" | rollout {seconds['rollout']:.1f}s reward {seconds['reward']:.1f}s "
                      f"update {seconds.get('update', 0.0):.1f}s | ETA {eta / 60:.1f} min")
        if cfg.train.sample_every and step % cfg.train.sample_every == 0:
            log.samples(step, seen, tok, cfg.grpo.group_size, cfg.train.sample_rows)  # printed, samples.jsonl, wandb
        if bad:
            log.print(f"WARNING: non-finite loss/gradient at step {step}: update skipped ({bad} in a row)")
            if bad >= cfg.train.max_bad_steps:
                raise RuntimeError(f"{bad} non-finite steps in a row: stopping")
        if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or step == cfg.train.steps:
            evaluate_held_out(sampler, tok, held_out, cfg, rank, world, device, log, step)
        if (cfg.train.save_every and step % cfg.train.save_every == 0) or step == cfg.train.steps:
            save(run, stream, step)
            saved_at = step
        if rank == 0 and cfg.train.plot_every and (step % cfg.train.plot_every == 0
                                                  or step == cfg.train.steps):
            plot.refresh(cfg.train.out_dir)
        if step < cfg.train.steps and (stopped := stop.requested(device)):  # collective: all ranks agree
            break
    if stopped:  # SIGINT/SIGTERM (or torchrun gone): keep the steps done, then exit 128 + signal
        path = save(run, stream, step) if saved_at != step else checkpoint.latest(cfg.train.out_dir)
        stream.close()
        line = runguard.stop_line(stopped, step, cfg.train.steps, path)
        log.print(line)
        close()
        raise runguard.Stopped(stopped, line if rank == 0 else "")  # the line: torchrun's summary shows it too
    log.metrics(step, {plot.DONE: 1.0})  # the run's final line: plot.py --follow stops on it
    # the machine's speed beside the wall time: sampled tokens per rollout second (all ranks) and
    # tokens (prompt + response) through the update's forward + backward per update second
    log.print(f"done: {cfg.train.steps} steps in {(time.time() - t_start) / 60:.1f} min (whole command "
              f"{(time.time() - t_launch) / 60:.1f} min); rollout {speed['sampled'] / max(speed['rollout_s'], 1e-9):.0f} "
              f"tok/s, update {speed['trained'] / max(speed['update_s'], 1e-9):.0f} tok/s; run in {cfg.train.out_dir}")
    if scaler.active:
        log.print(f"fp16: {scaler.summary()}")
    stream.close()
    close()  # every rank: lets gloo's workers finish before the interpreter exits


if __name__ == "__main__":
    sys.exit(runguard.run_main(main))  # a user error: one line on rank 0, exit 1; a stop: 128 + signal
