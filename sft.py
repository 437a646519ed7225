"""SFT warm start: next-token training on gold episodes written in the run's protocol (the turns:
sqltask/gold_turns.py; played through the env and tokenized as a rollout appends them: replay.replay).

Loss only on the model-side tokens (mask 1), never on the prompt or the observations.
train.py calls run_sft (the loop) before GRPO when `sft.steps > 0`, or warm_start_base in a LoRA
run (SFT the full model, then write the frozen base); it shares the model, FSDP2 and checkpoints.
A stop (Ctrl-C, SIGTERM, kill -9) loses at most sft.save_every steps: the same command continues
the warm start from <out_dir>/warm_start to the weights an unstopped run reaches.
Tests: .venv/bin/pytest tests/test_sft.py tests/test_sft_resume.py (and the warm-start loop in tests/test_train.py)
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

import replay
import rollout
from eval import evaluate
from model import Transformer
from sqltask import chat, dataset
from sqltask.gold_turns import gold_turns
from trainer import checkpoint, memory, optim, packing, runguard
from trainer.distributed import all_sum, close, compute_dtype, each_micro_batch, shard
from trainer.loss_scale import LossScaler
from trainer.policy_sampler import PolicySampler

# -----------------------------------------------------------------------------
# gold episodes


def gold_episodes(examples, prompt_ids, tokenizer, cfg, db_paths, turns=None) -> list:
    """Every record's gold episode (sqltask/gold_turns.py's turns, or `turns` when given) played
    through the env and tokenized as a rollout appends it (replay.replay): rollout.Trajectory
    each, mask 1 on the model's turns. prompt_ids: rendered prompts (chat.render_prompt);
    tokenizer None: text only. A gold the env does not read as written raises ValueError naming the record."""
    budget = rollout.max_turns(cfg.env)
    turns = turns or [gold_turns(ex, cfg, str(db), budget) for ex, db in zip(examples, db_paths)]
    return replay.replay(turns, db_paths, cfg.env, budget=budget, tokenizer=tokenizer, prompt_ids=prompt_ids,
                          names=[ex.get("id") for ex in examples])


def gold_texts(examples, cfg, db_paths) -> list[str]:
    """The text of every gold turn and observation, one string each (the tiny tokenizer's corpus:
    its tokens then cover what the warm start trains on; toy/tiny.prepare_assets)."""
    budget = rollout.max_turns(cfg.env)
    turns = [gold_turns(ex, cfg, str(db), budget) for ex, db in zip(examples, db_paths)]
    out = []
    for said, t in zip(turns, gold_episodes(examples, None, None, cfg, db_paths, turns)):
        for k, text in enumerate(said):  # each turn, then the observation the env appended after it
            out += [text, t.steps[k]["observation"]] if k < len(said) - 1 else [text]
    return out


def build_dataset(examples, prompt_ids, tokenizer, cfg, db_paths) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of every gold episode that fits sampling.max_context (longer ones are left out;
    none fitting is an error: the warm start would have nothing to train on)."""
    out = [(t.ids, t.loss_mask) for t in gold_episodes(examples, prompt_ids, tokenizer, cfg, db_paths)
           if len(t.ids) <= cfg.sampling.max_context]
    if examples and not out:
        raise ValueError(f"no gold episode fits sampling.max_context {cfg.sampling.max_context}: nothing to warm start on")
    return out


# -----------------------------------------------------------------------------
# training


def batches(n_items: int, batch_size: int, steps: int, seed: int, rank: int, world: int):
    """Yield, for each step, this rank's indices of a global batch drawn from seeded epochs."""
    order, pos, epoch = [], 0, 0
    for _ in range(steps):
        idx = []
        while len(idx) < batch_size:
            if pos >= len(order):
                order = list(range(n_items))
                random.Random(seed * 1000 + epoch).shuffle(order)
                pos, epoch = 0, epoch + 1
            take = min(batch_size - len(idx), len(order) - pos)
            idx += order[pos:pos + take]
            pos += take
        yield idx[rank::world]


def sft_loss_sum(model, seqs, temperature: float = 1.0, row_tokens: int = 0):
    """Sum over masked tokens of −logp for a micro-batch of (ids, mask), packed into one
    padding-free row (each sequence attends to itself only; rows of ≤ row_tokens when > 0, see
    packing.plan); the caller divides by the global
    token count so micro-batches and ranks add up to one token-mean."""
    device = next(model.parameters()).device
    mb, = packing.plan(seqs, None, budget=1 << 62, row_tokens=row_tokens or sum(len(s[0]) for s in seqs))
    logp, _ = packing.forward(model, mb, device, temperature)  # (N,) loss tokens only
    return -logp.sum()


# -----------------------------------------------------------------------------
# the warm start: the SFT loop, and the full-model base of a LoRA run


def warm_start_base(tok, train_ex, eval_ex, cfg, rank, world, device, log, *, resume_from=None, stop=None):
    """LoRA runs: SFT the full model, then write it to <out_dir>/base (HF folder), the frozen
    base the adapters train on. Written to a temporary folder and renamed (a kill leaves none).
    The full model's evals sample on a sampler of its own, freed with it. resume_from, stop: as
    run_sft's (its save is the full model's)."""
    full = Transformer.from_pretrained(cfg.model.path, dtype=torch.float32, device=device)
    full.set_activation_checkpointing(cfg.model.activation_checkpointing)
    full.fp32_lm_head = cfg.model.fp32_lm_head
    sampling_cfg, _ = memory.size_kv_pool(full, cfg, world, device, len(eval_ex), log.print)
    full = shard(full, compute_dtype(cfg), cfg.model.fsdp_unit)
    sampler = PolicySampler(full, sampling_cfg, dtype=compute_dtype(cfg))
    run_sft(full, sampler, tok, train_ex, eval_ex, cfg, rank, world, device, log, resume_from=resume_from, stop=stop)
    msd = checkpoint.full_model_state(full)
    if rank == 0:
        final, tmp = Path(checkpoint.lora_base_path(cfg)), Path(cfg.train.out_dir) / ".tmp_base"
        shutil.rmtree(tmp, ignore_errors=True)
        checkpoint.export_hf(full, msd, tmp, tok)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        log.print(f"warm start: full-model SFT written to {final} (the LoRA base)")
    if dist.is_initialized():
        dist.barrier()
    del full, msd, sampler


# stop_check_unseen leaves about 8 whole databases out of the warm start: a set with fewer than this
# (a quick run with data.max_train_examples, a small dataset) uses trained questions instead
UNSEEN_MIN_DATABASES = 10


def stop_check_questions(train_ex: list[dict], s) -> tuple[list[dict], list[dict]]:
    """(the stop check's questions, the warm start's training examples); s: config.SFTConfig.
    No check (stop_at_train_ex 0): none, all of train_ex. Otherwise s.stop_check_questions (128)
    questions spread over the training set (it is ordered by database); with stop_check_unseen, those
    of s.stop_check_databases databases spread over the set (0: every k-th, as few as hold the
    questions: about 8 for 128), which the warm start then leaves out (at most half the databases)."""
    n = s.stop_check_questions
    if s.stop_at_train_ex <= 0:
        return [], train_ex
    if not s.stop_check_unseen:
        return train_ex[::max(1, len(train_ex) // n)][:n], train_ex
    dbs = list(dict.fromkeys(ex["db_id"] for ex in train_ex))
    if len(dbs) < UNSEEN_MIN_DATABASES:
        raise ValueError(f"sft.stop_check_unseen leaves whole training databases out of the warm start, "
                         f"and the training set has {len(dbs)}: set it false")
    rest = lambda held: [ex for ex in train_ex if ex["db_id"] not in held]  # noqa: E731
    if not s.stop_check_databases:
        per_db = len(train_ex) / len(dbs)
        held = set(dbs[::max(1, int(len(dbs) * per_db / n))])
        probe = [ex for ex in train_ex if ex["db_id"] in held]
        return probe[::max(1, len(probe) // n)][:n], rest(held)
    k = min(s.stop_check_databases, len(dbs) // 2)
    held = [dbs[i * len(dbs) // k] for i in range(k)]
    probe = []
    for i, db in enumerate(held):  # n // k questions of each database (one more for the first n % k), spread
        mine = [ex for ex in train_ex if ex["db_id"] == db]
        take = min(len(mine), n // k + (i < n % k))
        probe += [mine[j * len(mine) // take] for j in range(take)]
    return probe, rest(set(held))


def run_sft(model, sampler, tok, train_ex, eval_ex, cfg, rank, world, device, log, *, resume_from=None,
            stop=None, scaler=None) -> bool:
    """Warm start on gold trajectories (loss on model-side tokens only, token-mean over the batch).
    sampler: the model's PolicySampler, refreshed with the current weights before the evals
    (sft.eval_every, eval.evaluate) and the sft.stop_at_train_ex check; log: run_log.Log.
    Saves to <out_dir>/warm_start (checkpoint.save) every sft.save_every steps, at its end and, with
    `stop` (runguard.StopSignals), after the step in which a signal came (then raises Stopped);
    resume_from: such a save, continued exactly (weights, AdamW, RNG, the data order, the check grid,
    the log, float16's loss scale). scaler: trainer/loss_scale.LossScaler (train.py's, which GRPO
    continues with; default a new one for model.dtype). Returns whether the sampler holds the final
    weights (the run stopped right after a check)."""
    s = cfg.sft
    t0 = time.time()
    n_dbs = len({ex["db_id"] for ex in train_ex})
    if s.stop_at_train_ex > 0 and s.stop_check_unseen and n_dbs < UNSEEN_MIN_DATABASES:
        log.print(f"note: sft.stop_check_unseen needs >= {UNSEEN_MIN_DATABASES} training databases to leave "
                  f"some out of the warm start, this training set has {n_dbs}: the stop check uses trained questions")
        s = dataclasses.replace(s, stop_check_unseen=False)
    probe, train_ex = stop_check_questions(train_ex, s)
    prompts = [chat.render_prompt(tok, ex, cfg.data, cfg.env.protocol, cfg.data.db_root) for ex in train_ex]
    db_paths = [dataset.abs_db_path(ex, cfg.data.db_root) for ex in train_ex]
    data = build_dataset(train_ex, prompts, tok, cfg, db_paths)
    opt, sch = optim.make_optimizer(model, cfg.optim, s.lr, s.warmup_steps, s.steps)
    scaler = scaler or LossScaler(cfg.optim, compute_dtype(cfg), warn=log.print)
    check_every = s.stop_check_every  # stop_check_every_near while the last check is at or above stop_near_ex
    passed_in_a_row = 0  # the last checks that passed the stop's thresholds, in a row
    start, finished = 0, False  # steps done; whether the warm start ended (cap or stop check)
    if resume_from:
        saved = checkpoint.load(resume_from, model, opt, sch)
        start, check_every, finished = saved["step"], saved["check_every"], saved["finished"]
        passed_in_a_row = saved.get("passed_in_a_row", 0)  # saves before sft.stop_checks_in_a_row: 0
        scaler.load_state_dict(saved.get("loss_scale"))
        log.rewind(saved.get("log_sizes"))  # what was logged after the save is logged again
        log.print(f"warm start: resumed from {resume_from} at step {start}" + (" (it had ended)" if finished else ""))

    def save(step: int, ended: bool) -> str | None:
        return checkpoint.save(cfg.train.out_dir, step, model, opt, sch, tok, cfg,
                               {"check_every": check_every, "passed_in_a_row": passed_in_a_row,
                                "finished": ended, "log_sizes": log.sizes(), "loss_scale": scaler.state_dict()},
                               name=checkpoint.WARM_START)

    synced = False  # the sampler holds this step's weights
    was_training = model.training
    model.train()  # dropout on for the loss (the evals inside run in eval mode: the engine sets it)
    if stop is not None:
        stop.at_step_boundary()  # a signal now stops after the step in progress, with a save
    # the global batches are a function of (seed, step) alone: skipping the first `start` resumes the order
    for i, idx in enumerate(batches(len(data), s.batch_size, 0 if finished else s.steps, cfg.train.seed, rank, world)):
        if i < start:
            continue
        seqs = [data[j] for j in idx]
        n_tok = all_sum([sum(sum(m[1:]) for _, m in seqs)], device)[0]
        opt.zero_grad(set_to_none=True)
        tot = 0.0
        mbs = packing.plan(seqs, None, cfg.optim.micro_batch_tokens, cfg.optim.pack_row_tokens)
        for mb in each_micro_batch(model, mbs, device, backward=True):
            loss_sum = sft_loss_sum(model, [seqs[j] for j in mb.members], row_tokens=cfg.optim.pack_row_tokens)
            scaler.scale(loss_sum / n_tok * world).backward()  # float16: × the loss scale
            tot += loss_sum.detach().item()
        grad_norm = optim.step_optimizer(model, opt, sch, cfg.optim, scaler)  # unscales, skips an overflow
        synced = synced and not math.isfinite(grad_norm)  # a step moved the weights
        loss = all_sum([tot], device)[0] / n_tok
        if (i + 1) % max(1, s.steps // 20) == 0 or i + 1 == s.steps:
            log.metrics(i + 1, {"sft/loss": loss, "sft/grad_norm": grad_norm,
                                **{f"sft/{k}": v for k, v in scaler.metrics().items()}})  # float16: scale, skips
            log.print(f"sft {i + 1}/{s.steps} | loss {loss:.4f} | gnorm {grad_norm:.2f} | " +
                      (f"scale {scaler.scale_value:g} skips {scaler.overflow_skips} | " if scaler.active else "") +
                      f"{time.time() - t0:.0f}s")
        run_eval = s.eval_every and (i + 1) % s.eval_every == 0 and i + 1 < s.steps
        run_check = probe and (i + 1) % max(1, check_every) == 0 and s.stop_check_from <= i + 1 < s.steps
        if (run_eval or run_check) and not synced:
            sampler.refresh(model)  # weight sync: the evals sample this step's weights
            synced = True
        if run_eval:
            evaluate(sampler, tok, eval_ex, cfg, rank, world, device, log, i + 1, prefix="sft/eval")
        if run_check:
            # all-reduced: every rank sees the same EX and stops at the same step
            m = evaluate(sampler, tok, probe, cfg, rank, world, device, log, i + 1, prefix="sft/train")
            ex, recovery = m["sft/train/ex"], m.get("sft/train/recovery_rate", 1.0)  # absent: none failed
            near = s.stop_near_ex > 0 and ex >= s.stop_near_ex and s.stop_check_every_near > 0
            check_every = s.stop_check_every_near if near else s.stop_check_every
            passed = ex >= s.stop_at_train_ex and recovery >= s.stop_at_train_recovery
            passed_in_a_row = passed_in_a_row + 1 if passed else 0
            if passed_in_a_row >= s.stop_checks_in_a_row:
                log.metrics(i + 1, {"sft/stopped_at": i + 1})
                log.print(f"sft: stopped at step {i + 1} of {s.steps}: training EX {100 * ex:.1f}% >= "
                          f"sft.stop_at_train_ex {100 * s.stop_at_train_ex:.0f}%" +
                          (f", recovery {100 * recovery:.1f}% >= sft.stop_at_train_recovery "
                           f"{100 * s.stop_at_train_recovery:.0f}%" if s.stop_at_train_recovery > 0 else "") +
                          (f", on {passed_in_a_row} checks in a row" if s.stop_checks_in_a_row > 1 else ""))
                finished = True
        finished = finished or i + 1 == s.steps
        signum = stop.requested(device) if stop is not None else 0  # collective: every rank agrees
        if finished or signum or (s.save_every and (i + 1) % s.save_every == 0):
            path = save(i + 1, finished)  # the end too: a kill before ckpt_000000 loses no step
        if signum:
            line = runguard.stop_line(signum, i + 1, s.steps, path, what="warm-start step")
            log.print(line)
            close()
            raise runguard.Stopped(signum, line if rank == 0 else "")
        if finished:
            break
    if stop is not None:
        stop.at_once()  # set-up until the GRPO loop: a signal stops at once (this save resumes)
    model.train(was_training)
    del opt, sch
    return synced
