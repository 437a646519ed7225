"""All hyperparameters of grpo-sql in one typed place.

Defaults live in the dataclasses below. A YAML file overrides them; `--key=value` on the command
line overrides the file (dotted keys for groups: `--grpo.clip_high=0.28`). Every value is
type-checked against its default; an unknown key or a bad value fails at once, naming the key
and the closest valid ones.

    python config.py                      # print every key with its default
    python config.py configs/tiny.yaml    # print the resolved config of a file (+ overrides), checked
Loading (YAML, overrides, types): trainer/config_loader.py; value ranges and consistency between
keys: trainer/config_checks.py.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from trainer import config_loader
from trainer.config_loader import ConfigError, dump, to_dict  # noqa: F401 (the config's API in one place)


def choice(default, *options, help=""):
    """A str field restricted to a few values (checked when the config is loaded)."""
    assert default in options
    return field(default=default, metadata={"choices": options, "help": help})


# -----------------------------------------------------------------------------
# groups


@dataclass
class ModelConfig:
    path: str = "runs/tiny/model"  # local HF folder (config.json + safetensors + tokenizer)
    build_tiny: bool = True  # if `path` does not exist, build a tiny random model there
    # compute dtype; weights, gradients and AdamW states are always fp32 (FSDP2 mixed precision)
    dtype: str = choice("float32", "float32", "bfloat16")
    activation_checkpointing: bool = False
    # FSDP2 units. block: each block its own unit, so only the running block's full weights are
    # gathered (what a 7B needs on a GPU). model: one unit, gathered once per forward and
    # reduce-scattered once per backward, instead of two all-gathers per block, one for the root
    # and a reduce-scatter per unit, each with its hooks: for a model whose full weights fit every
    # device many times over (the tiny model's SFT steps on 2 CPU ranks: 1.14x, bench/cpu_step.py
    # --against block). Same shards and checkpoints either way.
    fsdp_unit: str = choice("block", "block", "model")
    fp32_lm_head: bool = False  # bf16 runs: LM head matmul + log-softmax of the loss in fp32
    # LoRA (trainer/lora.py): 0 = full fine-tune; > 0 freezes the base and trains rank-r adapters
    lora_rank: int = 0
    lora_alpha: float = 16.0  # adapter output scaled by lora_alpha / lora_rank
    lora_dropout: float = 0.0  # on the adapters' input, training only
    lora_targets: str = "q,k,v,o,gate,up,down"  # comma-separated subset of these seven
    lora_save_merged: bool = False  # also write merged HF weights to ckpt_<step>/hf (adapter/ always)
    # shape of the tiny model built when build_tiny and the folder is absent
    tiny_family: str = choice("qwen2", "qwen2", "qwen3", "llama")
    tiny_vocab_size: int = 1024
    tiny_hidden_size: int = 128
    tiny_layers: int = 4
    tiny_heads: int = 4
    tiny_kv_heads: int = 2
    tiny_intermediate_size: int = 384


@dataclass
class DataConfig:
    train_path: str = "runs/toy/train.jsonl"  # canonical jsonl (see sqltask/dataset.py)
    eval_path: str = "runs/toy/eval.jsonl"
    db_root: str = "runs/toy"  # records' db_path is relative to this folder
    prepare_toy: bool = True  # generate the toy set at db_root if train_path is absent
    toy_seed: int = 0
    prompt_template: str = choice("skyrl", "skyrl", "compact")
    schema_sample_values: int = 0  # OmniSQL-style `-- example:` values per column
    schema_max_tokens: int = 4000  # schema budget; truncation is reported, never silent
    max_prompt_tokens: int = 6000  # longer prompts are dropped (SkyRL drops > 6000)
    max_train_examples: int = 0  # 0 = all
    max_eval_examples: int = 0  # 0 = all


@dataclass
class EnvConfig:
    protocol: str = choice("tags", "tags", "actions")  # SkyRL tags or sql_env actions
    conversation: str = choice("single", "single", "conversation")  # obs inside one message or as user turns
    max_turns: int = 6  # generations per episode (tool turns + final); tags protocol
    step_budget: int = 12  # actions protocol: generations per episode (sql_env's step budget)
    eos_steps_env: bool = False  # single format: a turn ending on EOS without a tag still gets the
    #                              invalid-action observation and the episode goes on (SkyRL's generator)
    tool_overlap_steps: int = 4  # engine steps a batch of tool calls runs beside decoding before
    #                              its rows wait for it (a fixed count keeps the rollout deterministic)
    tool_wait: str = choice("fixed", "fixed", "async")  # fixed: a tool batch is collected tool_overlap_steps
    #   engine steps after it was submitted (the loop waits for it there; a reproducible schedule); async: rows
    #   rejoin as soon as their results arrive and the loop waits only when nothing else can run (a slow query
    #   stalls only its own rows; each row samples the same tokens, the engine's batches depend on timing)
    tool_threads: int = 4  # async: tool batches stepped at once (a slow one does not hold the next in line)
    tool_timeout_s: float = 5.0
    max_result_rows: int = 50  # rows shown when the table is too long
    fetch_rows: int = 10000  # rows fetched at most (memory bound)
    max_obs_chars: int = 9000  # longer tables are cut to max_result_rows rows with a note
    workers: int = 0  # SQL worker processes per rank; 0 = cores / ranks on this machine
    # observation strings (SkyRL-SQL's); env.py fills {result}, {turns_left}, {error}, {shown}, {total}
    obs_template: str = ("\n\n<observation>{result}\n<reminder>You have {turns_left} turns left to complete"
                         " the task.</reminder></observation>\n\n")
    invalid_text: str = ("Your previous action is invalid. Follow the format of outputting thinking process"
                         " and sql tool, and try again.")
    error_text: str = "Error executing SQL: {error}"
    timeout_text: str = "SQL Timeout"
    truncated_text: str = "Truncated to {shown} of {total} rows since returned response too long."
    actions_max_result_rows: int = 20  # actions protocol: QUERY results cut to 20 rows (sql_env)
    sample_rows: int = 5  # actions protocol: SAMPLE <table> = LIMIT 5


@dataclass
class RewardConfig:
    mode: str = choice("set", "set", "bag", "spider")
    timeout_s: float = 30.0
    correct: float = 1.0
    wrong: float = 0.0
    format_error: float = -1.0
    dense: bool = False  # actions protocol: sql_env's dense shaping
    # actions + dense: pay the shaping only in episodes that end with an ANSWER. sql_env paid it in
    # every episode; then a policy that never answers (budget spent on new DESCRIBE/QUERYs, each
    # +0.025) outscores one that answers wrong after fewer calls, and GRPO drifts to no answer.
    # false = sql_env's rule
    dense_needs_answer: bool = True
    # actions: the reward of an episode that never ANSWERs within env.step_budget (sql_env: 0, as a
    # wrong answer). Below a wrong answer's, GRPO is pushed to answer: at 0, seed 1 of tiny_actions
    # drifted to 19% of held-out episodes without an answer by step 32; at -1, 0.0%
    no_answer: float = 0.0
    keep_distinct: bool = False  # spider mode: compare with DISTINCT kept (the evaluator's --keep_distinct)
    # dense shaping (reward.dense_shaping), per step; sql_env's values
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
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 3000  # per turn
    max_context: int = 29000  # prompt + all turns
    kv_budget_tokens: int = 1_000_000  # KV cache tokens per rank: rows run while their blocks fit
    block_size: int = 16  # tokens per KV cache block (the unit of paging and prompt sharing)
    max_decode_rows: int = 0  # most sequences decoding at once; 0 = as many as the KV budget holds
    cuda_graphs: bool = True  # CUDA: replay the whole decode step from captured graphs (ignored on CPU)
    # CUDA graphs: compile the decode step (inductor) before capturing it, to fuse the norms, RoPE,
    # slot arithmetic and sampling into a few kernels instead of ~40 small ones per layer. Off: on the
    # H200 (torch 2.11) inductor has not yet lowered FlexAttention inside the step, so the compile
    # failed and fell back after ~45 s (bench/RESULTS.md, fourth GPU session); on for measuring it
    compile_decode: bool = False
    prefill_tokens: int = 16384  # padded tokens per prefill forward: bounds its activations
    # how a decode step reads the paged KV cache (paged_attention.py): flex = FlexAttention over the
    # blocks in place, gather = copy each row's blocks out then SDPA (the reference); auto = flex on CUDA
    paged_attention: str = choice("auto", "auto", "gather", "flex")
    # decode steps run on the device between two host reads of the sampled tokens (1 = every step);
    # a row that ends its turn inside a window idles for the rest of it. 0 = by device: 8 on CUDA
    # (a host read costs a sync there), 1 elsewhere (on CPU the read is cheap and every idle row still
    # costs its share of each forward: windows of 8 ran 168 forwards where 1 ran 90, toy rollout)
    decode_steps_per_sync: int = 0
    eval_temperature: float = 0.0  # 0 = greedy


@dataclass
class GRPOConfig:
    group_size: int = 5  # samples per prompt (n)
    prompts_per_step: int = 256  # global, over all ranks
    advantage: str = choice("group", "group", "batch", "none")
    adv_eps: float = 1e-6
    loss: str = choice("grpo", "grpo", "gspo", "gspo-token", "cispo",
                       help="grpo = PPO-clip per token; gspo(-token) = sequence ratio; cispo = clipped IS weight")
    clip_low: float = -1.0  # < 0: the loss's default (grpo 0.2, gspo 3e-4, cispo 1.0 = no lower bound)
    clip_high: float = -1.0  # < 0: the loss's default (grpo 0.2, gspo 4e-4, cispo 0.28); 0.28 = DAPO clip-higher
    dual_clip_c: float = 0.0  # 0 = off; 3.0 = dual-clip
    kl_beta: float = 0.0  # > 0 loads a frozen reference model (k3 KL)
    loss_agg: str = choice("token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "drgrpo")
    drgrpo_max_len: int = 0  # L in Dr. GRPO's sum/(B*L); 0 = max_context
    # sampler vs trainer logprob correction (trainer/rollout_correction.py): weight min(r, cap) or drop
    # outside [low, high] with r = π_old/π_rollout per token or per sequence; geo-mask drops a
    # sequence whose geometric-mean r leaves [1 - delta, 1 + delta]
    rollout_is: str = choice("none", "none", "token-tis", "seq-tis", "token-mis", "seq-mis", "geo-mask")
    rollout_is_cap: float = 2.0
    rollout_is_low: float = 0.5
    rollout_is_high: float = 5.0
    rollout_is_delta: float = 0.01
    dynamic_sampling: bool = False  # drop all-equal groups and refill
    # what must differ within a group for it to be kept: reward (any difference, shaping included)
    # or exec_match (some samples right, some wrong: DAPO's accuracy filter). With dense shaping,
    # reward keeps all-wrong groups whose advantages are the shaping's small differences scaled up
    # to unit size by the group's std
    dynamic_sampling_metric: str = choice("reward", "reward", "exec_match")
    max_resample_rounds: int = 3
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per rollout batch per epoch
    # turn credit (grpo.token_advantages): > 0 adds a per-turn reward of this size to the first tool
    # turn whose observation shows a value the gold answer needs (a quoted literal of the gold SQL
    # the question does not spell out), credited to that turn and the turns before it; 0 = off (the
    # episode's advantage on every token). README "Fork for an ablation" has the sweep against 0
    lookup_bonus: float = 0.0
    # leave episodes that ran out of room (rollout.TRUNCATED: a turn cut at sampling.max_new_tokens,
    # or sampling.max_context reached) out of the loss; their rewards still enter their group's
    # mean and std (TRL's mask_truncated_completions, DAPO's overlong filtering). grpo.loss_episodes
    mask_truncated: bool = False


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.999
    warmup_steps: int = 0
    schedule: str = choice("constant", "constant", "cosine")
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 0.5
    micro_batch_tokens: int = 16384  # tokens per forward/backward micro-batch
    # packed rows of at most this many tokens, several per micro-batch (0: one row per micro-batch).
    # 0 is best on both devices: CUDA's FlexAttention skips masked blocks, and CPU attention runs per
    # sequence (trainer/packed_attention.py), never over a row's T² pairs
    pack_row_tokens: int = 0


@dataclass
class SFTConfig:
    steps: int = 0  # 0 = no warm start
    lr: float = 1e-5
    batch_size: int = 32  # sequences per step, global
    warmup_steps: int = 0
    think_text: str = "Let me write the query."  # the short think in gold trajectories
    with_tool_turn: bool = True  # gold trajectory includes <sql>gold</sql> + its real observation
    eval_every: int = 0  # held-out EX every K SFT steps, logged as sft/eval_ex (0 = never)
    # Stop mid-climb whatever the seed: every stop_check_every steps, greedy EX on 128 training
    # questions (logged as sft/train/*); the warm start ends once it reaches stop_at_train_ex (0 = off:
    # always `steps`, which is otherwise the cap). A step count alone lands each seed elsewhere on
    # a steep climb (the toy's copy-from-the-observation skill appears within ~30 steps).
    stop_at_train_ex: float = 0.0
    # ... and, when > 0, once the recovery rate at that check reaches it too (episodes whose first
    # query came back empty or failed and still ended right, over those whose first query did; a
    # check where no first query failed passes it). EX alone can be reached by copying from one
    # lookup before the second look after an empty one is learned, and GRPO then has little
    # recovery to build on. A condition on the EX stop: with stop_at_train_ex 0 nothing stops.
    stop_at_train_recovery: float = 0.0
    stop_check_every: int = 10
    # Near the threshold, finer checks: while the last check's training EX is at or above stop_near_ex
    # (0 = never), check every stop_check_every_near steps; a check back below it returns to
    # stop_check_every (both grids are the multiples of their step count). The climb can take training
    # EX from 45% to 62% within 10 steps, and the first check past stop_at_train_ex then lands far above it.
    stop_near_ex: float = 0.0
    stop_check_every_near: int = 0
    stop_check_questions: int = 128  # training questions the stop check evaluates (spread over the set)
    # Checks in a row that must pass before the stop. 128 questions carry about +-4 points of binomial
    # noise: on a plateau a lone check can pass the threshold (toy, actions protocol: 39.1% between
    # 33.6% and 31.2%, the copy GRPO builds on not yet formed).
    stop_checks_in_a_row: int = 1
    # The check's questions come from whole training databases the warm start leaves out (about 8 of
    # them for 128 questions): on questions it trains on, a late stop reads memorised answers as skill
    # (toy set: 41% training EX at step 648 where held-out EX was 25%).
    stop_check_unseen: bool = False
    # no check before this step: checks cost a greedy eval each, and early ones, before the model
    # closes its tags, run every turn to max_new_tokens (on the toy: ~20 s of a 2-minute warm start
    # before step 200; the earliest stop measured, 3 seeds on 2 machines, came at step 240). The
    # models have no dropout and greedy checks draw no random numbers: skipping them changes nothing else.
    stop_check_from: int = 0
    # save the warm start (<out_dir>/warm_start: weights, AdamW, RNG, step, the stop checks' grid) every
    # K steps, at its end and at a Ctrl-C / SIGTERM: the same command then continues it from there, to the
    # same weights (0 = at its end and at a stop only). On the toy a save takes ~0.1 s beside ~0.3 s per
    # step: at 50, a kill -9 loses at most ~15 s of work
    save_every: int = 50


@dataclass
class TrainConfig:
    steps: int = 60  # GRPO steps
    seed: int = 0
    out_dir: str = "runs/default"
    log_every: int = 1
    sample_every: int = 10  # print a few trajectories every K steps (0 = never)
    sample_rows: int = 8  # ... and write this many (one per prompt) to samples.jsonl / the wandb table
    plot_every: int = 0  # redraw out_dir/metrics.png every K steps (plot.py; 0 = off; needs matplotlib)
    eval_every: int = 10  # held-out eval every K steps (also at start and end; 0 = start+end)
    save_every: int = 0  # checkpoint every K steps (0 = end only)
    keep_checkpoints: int = 2
    # continue from out_dir's latest checkpoint if present; "true" refuses a checkpoint whose
    # config differs in more than RESUMABLE_KEYS, "force" continues anyway, "false" starts anew
    resume: str = choice("true", "true", "false", "force")
    dist_timeout_s: float = 7200.0  # collective timeout (a rank waits at a barrier this long)
    max_bad_steps: int = 3  # stop after this many non-finite steps in a row
    threads: int = 0  # torch threads per rank; 0 = leave torch's choice


@dataclass
class WandbConfig:
    mode: str = choice("disabled", "disabled", "offline", "online")
    project: str = "grpo-sql"
    name: str = ""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
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
