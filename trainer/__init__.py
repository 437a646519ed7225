"""The trainer's plumbing, used by train.py, sft.py and eval.py (it imports nothing from the top-level files),
and the three registries a fork adds a loss, a credit or a rollout correction to (config.py reads their names,
so they live here).

    policy_update.py      the update's plumbing: old/ref logprobs once, mini-batches, packed micro-batches, metric sums
    packing.py            a prompt and its G responses packed into padding-free rows; logprobs of loss tokens
    packed_attention.py   who attends to whom inside a packed row (CPU: per-sequence SDPA; CUDA: FlexAttention)
    distributed.py        process group, FSDP2 sharding, collectives, the per-device memory estimate
    optim.py              AdamW, the learning-rate schedule, the clipped step
    checkpoint.py         atomic, world-size independent checkpoints that resume exactly
    hf_folder.py          Hugging Face model folders: load and save (model.py's fused names <-> HF's)
    lora.py               LoRA adapters (merged for rollouts), saved in PEFT's format
    policy_sampler.py     the run's inference copy of the policy and its kept engine; the weight sync (refresh)
    rollout_correction.py sampler-vs-trainer mismatch metrics; the corrections: one registered function per grpo.rollout_is
    losses.py             the policy losses: one registered per-token function per grpo.loss (grpo.policy_loss runs it)
    credits.py            the credits: one registered returns function per grpo.credit (grpo.token_advantages)
    config_checks.py      every config value's range and the keys that must agree, checked before a run
    run_log.py            rank-0 prints, metrics.jsonl, wandb; seconds per phase of a step
    sample_log.py         sampled episodes to samples.jsonl and the wandb table `samples`
    runguard.py           one run per out_dir, Ctrl-C at a step boundary, one line per user error
    config_loader.py      YAML + --key=value applied to config.py's dataclasses, type-checked; ConfigError
    malloc_tuning.py      CPU runs: glibc keeps freed memory for reuse
"""
