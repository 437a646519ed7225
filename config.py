"""All hyperparameters of grpo-sql in one typed place.

Defaults live in the dataclasses below. A YAML file overrides them; `--key=value` on the command
line overrides the file (dotted keys for groups: `--grpo.clip_high=0.28`). Every value is
type-checked against its default; an unknown key or a bad value fails at once, naming the key
and the closest valid ones.

    python config.py                      # print every key with its default
    python config.py configs/tiny.yaml    # print the resolved config of a file (+ overrides), checked
Loading (YAML, overrides, types): trainer/config_loader.py; value ranges and consistency between
keys: trainer/config_checks.py. Each comment below gives a key's meaning, unit and range; why a
recipe sets the value it does is in its YAML file, and what was measured for each default in
bench/RESULTS.md, section "Why the defaults".
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from trainer import config_loader
from trainer.config_loader import ConfigError, dump, to_dict  # noqa: F401 (the config's API in one place)
from trainer.credits import CREDITS  # grpo.credit's values: the registered credits
from trainer.losses import LOSSES  # grpo.loss's values: the registered losses
from trainer.rollout_correction import CORRECTIONS  # grpo.rollout_is's values: the registered corrections


def int_or_auto(default: int | str) -> Any:
    """An int field that also takes the string "auto" (the code resolves it)."""
    return field(default=default, metadata={"auto": True})


def choice(default: str, *options: str, help: str = "") -> Any:
    """A str field restricted to a few values (checked when the config is loaded)."""
    assert default in options
    return field(default=default, metadata={"choices": options, "help": help})


# -----------------------------------------------------------------------------
# groups


@dataclass
class ModelConfig:
    path: str = "runs/tiny/model"  # local HF folder: config.json, safetensors, tokenizer (never downloaded)
    build_tiny: bool = True  # build a tiny random model at `path` when the folder is absent (the toy recipes)
    # compute dtype of every forward and backward (trainer, KL reference, sampler and its KV cache);
    # master weights, reduced gradients and AdamW states stay fp32. float16 (GPUs without bf16: T4,
    # V100) runs with dynamic loss scaling (optim.loss_scale_*)
    dtype: str = choice("float32", "float32", "bfloat16", "float16")
    activation_checkpointing: bool = False  # recompute each block's activations in backward (memory for time)
    # FSDP2 sharding unit: block = one unit per decoder block (only the running block gathered: large
    # models); model = one unit for the whole model (one gather per pass: small models). Same checkpoints
    fsdp_unit: str = choice("block", "block", "model")
    fp32_lm_head: bool = False  # bf16/fp16 runs: the LM head matmul and the loss's log-softmax in fp32
    lora_rank: int = 0  # LoRA rank r (trainer/lora.py), >= 0; 0 = full fine-tune, > 0 freezes the base
    lora_alpha: float = 16.0  # adapter output scaled by lora_alpha / lora_rank, > 0
    lora_dropout: float = 0.0  # dropout on the adapters' input while training, in [0, 1)
    lora_targets: str = "q,k,v,o,gate,up,down"  # comma-separated subset of these seven projections
    lora_save_merged: bool = False  # also write merged HF weights to ckpt_<step>/hf (adapter/ always)
    # the tiny model built when build_tiny and `path` is absent: its family and shape (each >= 1;
    # tiny_hidden_size / tiny_heads must be even: RoPE rotates pairs)
    tiny_family: str = choice("qwen2", "qwen2", "qwen3", "llama")
    tiny_vocab_size: int = 1024  # BPE vocabulary trained on the run's own text
    tiny_hidden_size: int = 128
    tiny_layers: int = 4
    tiny_heads: int = 4
    tiny_kv_heads: int = 2
    tiny_intermediate_size: int = 384


@dataclass
class DataConfig:
    train_path: str = "runs/toy/train.jsonl"  # canonical jsonl (sqltask/dataset.py)
    eval_path: str = "runs/toy/eval.jsonl"  # held-out questions, same format
    db_root: str = "runs/toy"  # folder the records' db_path is relative to
    prepare_toy: bool = True  # generate the toy set at db_root when train_path is absent
    toy_seed: int = 0  # the toy set's generator seed, >= 0
    prompt_template: str = choice("skyrl", "skyrl", "compact")  # skyrl = CREATE TABLE DDL; compact = a line per table
    schema_sample_values: int = 0  # OmniSQL-style `-- example:` values shown per column, >= 0
    schema_max_tokens: int = 4000  # schema budget in tokens, >= 1; a cut schema is reported, never silent
    max_prompt_tokens: int = 6000  # prompts longer than this many tokens are dropped (and counted), >= 1
    max_train_examples: int = 0  # use the first N training records, >= 0; 0 = all
    max_eval_examples: int = 0  # use the first N held-out records, >= 0; 0 = all
    # a second held-out set, evaluated beside eval_path (logged as unseen/*): questions on databases
    # training never reads, so what carries over to a new schema ("" = none)
    unseen_eval_path: str = ""
    max_unseen_examples: int = 0  # use the first N of them, >= 0; 0 = all


@dataclass
class EnvConfig:
    protocol: str = choice("tags", "tags", "actions")  # tags = SkyRL's <sql>/<solution>; actions = sql_env's
    conversation: str = choice("single", "single", "conversation")  # observations inside one message or as user turns
    max_turns: int = 6  # tags: generations per episode (tool turns + the answer), >= 1; 1 = no tool
    step_budget: int = 12  # actions: generations per episode, >= 1
    eos_steps_env: bool = False  # single message: a turn ending on EOS with neither tag gets the
    #                              invalid-action observation and the episode goes on (else it ends)
    tool_overlap_steps: int = 4  # fixed wait: engine steps a tool batch runs beside decoding before its rows wait, >= 0
    # when rows rejoin after a tool batch: fixed = tool_overlap_steps engine steps after it was
    # submitted (a reproducible schedule); async = as soon as their results arrive (same tokens per
    # row, batches depend on timing)
    tool_wait: str = choice("fixed", "fixed", "async")
    tool_threads: int = 4  # async: tool batches in flight at once, >= 1
    tool_timeout_s: float = 5.0  # seconds one tool query may run, > 0
    max_result_rows: int = 50  # rows shown when a result exceeds max_obs_chars, >= 1
    fetch_rows: int = 10000  # rows fetched from SQLite at most (memory bound), >= 1
    max_obs_chars: int = 9000  # characters of a result table shown before it is cut to max_result_rows, >= 1
    workers: int = 0  # SQL worker processes per rank, >= 0; 0 = cores / ranks on this machine
    # observation strings (SkyRL-SQL's); env.py fills {result}, {turns_left}, {error}, {shown}, {total}
    obs_template: str = ("\n\n<observation>{result}\n<reminder>You have {turns_left} turns left to complete"
                         " the task.</reminder></observation>\n\n")
    invalid_text: str = ("Your previous action is invalid. Follow the format of outputting thinking process"
                         " and sql tool, and try again.")
    error_text: str = "Error executing SQL: {error}"
    timeout_text: str = "SQL Timeout"
    truncated_text: str = "Truncated to {shown} of {total} rows since returned response too long."
    actions_max_result_rows: int = 20  # actions: rows of a QUERY result shown, >= 1
    sample_rows: int = 5  # actions: rows SAMPLE <table> shows (LIMIT), >= 1
    # actions: what DESCRIBE shows. ddl = the table's CREATE TABLE as the database stores it; columns =
    # one line of names, types and keys, as sql_env's DESCRIBE (Spider's stored DDL runs to hundreds of
    # tokens a table: every one is prefilled, trained through and kept in the KV cache)
    describe: str = choice("ddl", "ddl", "columns")


@dataclass
class RewardConfig:
    mode: str = choice("set", "set", "bag", "spider")  # execution match: set (SkyRL), bag, spider (test-suite)
    timeout_s: float = 30.0  # seconds a reward query (prediction or gold) may run, > 0
    correct: float = 1.0  # reward of a well-formed answer whose result matches the gold's
    wrong: float = 0.0  # ... that does not match
    format_error: float = -1.0  # reward of an episode that breaks the format rules
    dense: bool = False  # actions: add sql_env's per-step shaping (the dense_* keys)
    dense_needs_answer: bool = True  # actions + dense: pay the shaping only in episodes that ANSWER
    no_answer: float = 0.0  # actions: reward of an episode that never ANSWERs within env.step_budget
    keep_distinct: bool = False  # spider mode: compare with DISTINCT kept (the evaluator's --keep_distinct)
    # dense shaping per step (reward.dense_shaping; sql_env's values, any finite number)
    dense_step: float = -0.005  # every step's cost
    dense_repeat: float = -0.01  # an action repeated (same kind and argument): earns nothing else
    dense_exec_ok: float = 0.02  # a new action that ran
    dense_new_info: float = 0.01  # ... plus this, up to dense_new_info_cap over the episode
    dense_new_info_cap: float = 0.10
    dense_progress: float = 0.15  # x the gain in Jaccard(QUERY rows, gold rows) over the best so far
    dense_step_min: float = -0.2  # each step's shaping clamped to [dense_step_min, dense_step_max]
    dense_step_max: float = 0.5
    # DAPO's soft overlong punishment (reward.overlong_penalty; verl's overlong buffer): with L an
    # episode's generated tokens (the model's own, every turn), 0 up to overlong_max_len -
    # overlong_buffer_len, then falling linearly to -1 at overlong_max_len, -1 beyond; times the factor
    overlong_buffer_len: int = 0  # L_cache, tokens; 0 = off
    overlong_max_len: int = 0  # L_max, tokens; > overlong_buffer_len when the buffer is on
    overlong_penalty_factor: float = 1.0  # >= 0: the penalty's size at L_max (DAPO and verl: 1)


@dataclass
class SamplingConfig:
    temperature: float = 0.6  # sampling temperature of rollouts, > 0; the trainer divides logits by it
    top_p: float = 0.95  # nucleus, in (0, 1]
    top_k: int = 0  # keep the k most likely tokens, >= 0; 0 = off
    max_new_tokens: int = 3000  # tokens one turn may generate, >= 1
    max_context: int = 29000  # tokens of prompt + every turn and observation, >= 2
    # KV cache tokens per rank, >= 1, or auto: kv_memory_fraction of the memory left after everything
    # else the run holds at its peak, capped at what the work can use (trainer/memory.py). Rows run
    # while their blocks fit. A number gives the same pool, so the same batches, on any machine
    kv_budget_tokens: int | str = int_or_auto("auto")
    kv_memory_fraction: float = 0.8  # auto: the KV pool's share of the memory left, in (0, 1]
    block_size: int = 16  # tokens per KV cache block (the unit of paging and prompt sharing), >= 1
    max_decode_rows: int = 0  # sequences decoding at once, >= 0; 0 = as many as the KV budget holds
    cuda_graphs: bool = True  # CUDA: replay the whole decode step from captured graphs (ignored on CPU)
    compile_decode: bool = False  # CUDA graphs: compile the decode step (inductor) before capturing it
    prefill_tokens: int = 16384  # padded tokens per prefill forward (bounds its activations), >= 1
    # how a decode step reads the paged KV cache: flex = FlexAttention over the blocks in place,
    # gather = copy each row's blocks out then SDPA (the reference); auto = flex on CUDA, gather elsewhere
    paged_attention: str = choice("auto", "auto", "gather", "flex")
    decode_steps_per_sync: int = 0  # decode steps between host reads, >= 0; 0 = by device (8 CUDA, 1 CPU)
    eval_temperature: float = 0.0  # evaluation temperature, >= 0; 0 = greedy


@dataclass
class GRPOConfig:
    group_size: int = 5  # samples per prompt (G), >= 2
    prompts_per_step: int = 256  # prompts per step over all ranks, >= 1
    # advantage normalisation: group = (R - mean_G) / (std_G + eps); batch = std over the batch; none = R - mean_G
    advantage: str = choice("group", "group", "batch", "none")
    adv_eps: float = 1e-6  # the eps above, > 0
    # the policy loss: a function registered in trainer/losses.py (its docstring gives the formula)
    loss: str = choice("grpo", *LOSSES, help="a loss registered in trainer/losses.py")
    clip_low: float = -1.0  # ε_low of the ratio clip; < 0 = the loss's declared default (grpo's 0.2)
    clip_high: float = -1.0  # ε_high; < 0 = the loss's declared default (grpo's 0.2); 0.28 = DAPO clip-higher
    dual_clip_c: float = 0.0  # dual-clip bound c for negative advantages, 0 = off, else > 1 (3.0 in verl)
    kl_beta: float = 0.0  # weight of the k3 KL to a frozen reference, >= 0; > 0 loads the reference
    # loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum, drgrpo (sum / (B·L))
    loss_agg: str = choice("token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "drgrpo")
    drgrpo_max_len: int = 0  # L of drgrpo's sum / (B·L), tokens, >= 0; 0 = sampling.max_context
    # the rollout correction: a function registered in trainer/rollout_correction.py (its docstring gives
    # the formula), with r = π_old / π_rollout: token-/seq-tis weight min(r, cap); token-/seq-mis drop
    # outside [low, high]; geo-mask drops a sequence whose geometric-mean r leaves [1 - delta, 1 + delta];
    # age-mask drops tokens sampled more than max_age steps before the trainer's step
    rollout_is: str = choice("none", *CORRECTIONS, help="a correction registered in trainer/rollout_correction.py")
    rollout_is_cap: float = 2.0  # the tis cap, > 0
    rollout_is_low: float = 0.5  # the mis lower bound, >= 0
    rollout_is_high: float = 5.0  # the mis upper bound, > 0
    rollout_is_delta: float = 0.01  # geo-mask's delta, > 0
    rollout_is_max_age: int = 1  # age-mask's N: oldest trained token, steps, >= 0; below stream.sampling_steps_ahead
    dynamic_sampling: bool = False  # drop groups whose dynamic_sampling_metric is all equal, then refill
    # what must differ within a group for it to be kept: reward (any difference, shaping included)
    # or exec_match (some samples right, some wrong: DAPO's accuracy filter)
    dynamic_sampling_metric: str = choice("reward", "reward", "exec_match")
    max_resample_rounds: int = 3  # extra sampling rounds to refill dropped groups, >= 0
    ppo_epochs: int = 1  # passes over each rollout batch, >= 1
    mini_batches: int = 1  # optimizer steps per rollout batch per epoch, >= 1
    # the credit: each turn's return, a function registered in trainer/credits.py; outcome = the
    # outcome reward on every turn
    credit: str = choice("outcome", *CREDITS, help="a credit registered in trainer/credits.py")
    # the lookup_bonus credit's b: reward added to the first tool turn whose observation shows a value
    # the gold needs, credited reward-to-go, >= 0 (0.2 was measured); 0 with any other credit
    lookup_bonus: float = 0.0
    # the turn_discount credit's γ: turn k of K gets γ^(K-1-k) x the outcome, in (0, 1]; 1 with any other credit
    turn_discount: float = 1.0
    # leave episodes that ran out of room (rollout.TRUNCATED: a turn cut at sampling.max_new_tokens,
    # or sampling.max_context reached) out of the loss; their rewards still enter their group's
    # mean and std, as in TRL's mask_truncated_completions and DAPO's overlong filtering.
    # grpo.loss_episodes. Where we differ from TRL: TRL keeps a sample whose tool observation left no
    # room (it drops the tool result, and the sample ends at EOS); we mask it (rollout's `context` end)
    mask_truncated: bool = False


@dataclass
class StreamConfig:
    # steps the sampler may run ahead of the trainer (tinker's sampling_steps_ahead), >= 0. 0 = synchronous:
    # a step samples its prompts, waits for its last episode, trains. k >= 1: the sampler keeps decoding
    # across step boundaries, starting the next steps' groups as episodes end (at most one rank share's
    # episodes open, chunks up to k past the step's own); no trained token is older than k steps (stream.py)
    sampling_steps_ahead: int = 0
    # after a weight sync, recompute the KV cache of the episodes in flight from their ids with the new
    # weights (NeMo-RL's recompute_kv_cache_after_weight_updates); false keeps it (PipelineRL)
    recompute_kv: bool = False


@dataclass
class OptimConfig:
    lr: float = 1e-6  # AdamW learning rate of GRPO, > 0
    weight_decay: float = 0.01  # AdamW decoupled weight decay, >= 0
    beta1: float = 0.9  # AdamW β1, in [0, 1)
    beta2: float = 0.999  # AdamW β2, in [0, 1)
    warmup_steps: int = 0  # optimizer steps of linear warm-up, >= 0
    schedule: str = choice("constant", "constant", "cosine")  # learning rate after the warm-up
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr, in [0, 1]
    grad_clip: float = 0.5  # the gradient's global norm is clipped to this, > 0
    micro_batch_tokens: int = 16384  # tokens per forward/backward micro-batch, >= 1
    pack_row_tokens: int = 0  # packed rows of at most this many tokens, >= 0; 0 = one row per micro-batch
    # dynamic loss scaling, float16 only (trainer/loss_scale.py; off for float32 and bfloat16): the loss
    # is multiplied by the scale before backward so small fp16 gradients do not flush to zero; a step
    # whose gradients overflow is skipped and the scale backs off; after loss_scale_interval clean
    # optimizer steps in a row it grows
    loss_scale_init: float = 65536.0  # the first scale (2^16), > 0
    loss_scale_growth: float = 2.0  # x the scale after loss_scale_interval clean steps, > 1
    loss_scale_backoff: float = 0.5  # x the scale after an overflow, in (0, 1)
    loss_scale_interval: int = 200  # clean optimizer steps in a row before the scale grows, >= 1


@dataclass
class SFTConfig:
    steps: int = 0  # warm-start steps, >= 0; 0 = no warm start; with the stop rule below, the cap
    lr: float = 1e-5  # AdamW learning rate of the warm start, > 0
    batch_size: int = 32  # gold episodes per step over all ranks, >= 1
    warmup_steps: int = 0  # steps of linear warm-up, >= 0
    think_text: str = "Let me write the query."  # the think of every gold turn ("" = an empty think)
    with_tool_turn: bool = True  # every gold episode first runs the gold as a tool call and sees its rows
    eval_every: int = 0  # held-out EX every K steps (sft/eval_ex), >= 0; 0 = never
    save_every: int = 50  # save <out_dir>/warm_start every K steps, >= 0 (0 = at its end and at a stop only)

    # The stop rule (sft.run_sft). From step stop_check_from, every stop_check_every steps (every
    # stop_check_every_near while the last check's EX is >= stop_near_ex), a greedy check on
    # stop_check_questions training questions (from whole databases the warm start leaves out, when
    # stop_check_unseen); the warm start stops after stop_checks_in_a_row checks in a row with
    # EX >= stop_at_train_ex and recovery >= stop_at_train_recovery. stop_at_train_ex 0: no checks, run `steps`.
    stop_at_train_ex: float = 0.0  # EX to stop at, a fraction in [0, 1]; 0 = the rule is off
    stop_at_train_recovery: float = 0.0  # ... and recovery (empty first lookups that end right), in [0, 1]; 0 = any
    stop_check_from: int = 0  # the first step that may check, >= 0
    stop_check_every: int = 10  # steps between checks, >= 1
    stop_near_ex: float = 0.0  # from this EX on, check every stop_check_every_near steps, in [0, 1]; 0 = never
    stop_check_every_near: int = 0  # steps between checks near the threshold, >= 0; 0 = off
    stop_check_questions: int = 128  # training questions per check, >= 1
    stop_checks_in_a_row: int = 1  # passing checks in a row needed to stop, >= 1
    stop_check_unseen: bool = False  # check on whole training databases the warm start does not train on


@dataclass
class TrainConfig:
    steps: int = 60  # GRPO steps, >= 0
    seed: int = 0  # seed of the prompt order, sampling and initialisation, >= 0
    out_dir: str = "runs/default"  # the run's folder: metrics, samples, checkpoints
    log_every: int = 1  # log the step's metrics every K steps, >= 1
    sample_every: int = 10  # print a few trajectories every K steps, >= 0; 0 = never
    sample_rows: int = 8  # ... and write this many (one per prompt) to samples.jsonl / wandb, >= 0
    plot_every: int = 0  # redraw out_dir/metrics.png every K steps, >= 0; 0 = off
    eval_every: int = 10  # held-out eval every K steps (and at start and end), >= 0; 0 = start and end
    save_every: int = 0  # checkpoint every K steps, >= 0; 0 = at the end only
    keep_checkpoints: int = 2  # newest checkpoints kept, >= 0; 0 = all
    # continue from out_dir's latest checkpoint: true (refused when the config differs outside
    # checkpoint.RESUMABLE_KEYS), force (continue anyway), false (start anew)
    resume: str = choice("true", "true", "false", "force")
    dist_timeout_s: float = 7200.0  # seconds a rank waits at a collective, > 0
    max_bad_steps: int = 3  # stop after this many non-finite steps in a row, >= 1
    threads: int = 0  # torch threads per rank, >= 0; 0 = torch's choice


@dataclass
class WandbConfig:
    mode: str = choice("disabled", "disabled", "offline", "online")  # offline writes ./wandb, no network
    project: str = "grpo-sql"
    name: str = ""  # the run's name ("" = wandb's)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


# -----------------------------------------------------------------------------
# loading (trainer/config_loader.py)


def load_config(argv: list[str] | None = None, base: Config | None = None) -> Config:
    """argv: [config.yaml] [--group.key=value ...] (a YAML path is optional), applied over `base`
    (default: the defaults; eval.py passes a checkpoint's saved config)."""
    return config_loader.load(base if base is not None else Config(), sys.argv[1:] if argv is None else argv)


def all_keys(cfg: Config | None = None) -> dict:
    """Flat {"group.key": value} of a config (the defaults if none given)."""
    return config_loader.all_keys(cfg if cfg is not None else Config())


def from_dict(d: dict) -> Config:
    """A Config from to_dict() output (a checkpoint's config.yaml; renamed keys read as their new names)."""
    return config_loader.from_dict(Config(), d)


if __name__ == "__main__":
    from trainer import config_checks  # value ranges and consistency (world size 1)
    try:
        c = config_checks.validate(load_config())
    except ConfigError as e:
        sys.exit(f"error: {e}")
    print(dump(c), end="")
