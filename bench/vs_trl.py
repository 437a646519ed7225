"""One GRPO step, ours against TRL's GRPOTrainer, on the same model and the same work, interleaved in
one process (ours, TRL, ours, TRL, ...; the median of the per-pair ratios).

    .venv/bin/python bench/vs_trl.py                        # SmolLM2-135M-Instruct (runs/smollm2), Spider, CPU fp32
    .venv/bin/python bench/vs_trl.py --fresh                # each step in a fresh process (one side in memory)
    .venv/bin/python bench/vs_trl.py --device cuda --dtype bfloat16 [--vllm]   # bench/gpu.sh's vs_trl part
    .venv/bin/python bench/vs_trl.py --toy runs [--smoke]   # the toy set (runs/toy, configs/tiny.yaml's) and a
                                                            # random model in SmolLM2's shape (tiny with
                                                            # --smoke) in runs/vs_trl_model_*: no checkpoint,
                                                            # no Spider

The work, the same on both sides: --prompts (16) training prompts a step, one turn each (TRL's
standard path: the prompt, then one completion), --group (4) completions a prompt, at most
--max-new-tokens (128) new tokens, temperature 1.0 (no top-p, no top-k), one optimizer step. The
reward is ours on both sides (reward.episode_rewards: SkyRL's format rules, then execution match of
the <solution> against the gold); TRL gets it as its reward function, the completion cut after its
first </sql> or </solution> as our sampler's stop strings cut ours (TRL samples on to EOS or the
limit and trains on every token it sampled). The same AdamW (lr, betas, eps; weight decay 0: TRL's
Trainer exempts biases and norms from it, ours would not), grad clip, loss aggregation
(grpo.loss_agg -> TRL's loss_type: token-mean -> dapo, seq-mean-token-mean -> grpo, drgrpo -> dr_grpo)
and ratio clip (grpo.clip_low/high -> epsilon/epsilon_high), no KL, advantages over the group's
std, activation checkpointing on both (TRL's default; --no-checkpointing turns both off). The
prompts are the same token ids on both sides (checked at start). TRL: its default loop, micro-
batches of --trl-micro-batch (8) sequences accumulated into the one step (its default
per_device_train_batch_size), transformers `generate` for the whole step's prompts at once. Ours:
train.grpo_step as train.py runs it (one process: FSDP2 on one rank, the sampler's paged KV cache,
a prompt's G completions packed with the prompt computed once, micro-batches of
optim.micro_batch_tokens).

Measured per step: seconds (generation = sampling + reward + advantages: our rollout, reward and
credit phases, TRL's _generate_and_score_completions; update = the rest: forward, backward,
optimizer step, our weight sync), trained tokens (completion tokens in the loss) per second, and
peak memory: on CPU the peak RSS of the process during the step (/proc/self/status VmHWM, reset
before each step through /proc/self/clear_refs: in one process it includes the other side's
resident model and optimizer, so its growth over the step's start is printed beside it), on CUDA
the peak allocated GPU memory. --fresh runs every step in a fresh process instead, alternately
(ours, TRL, ours, ...: the same pairs of the same prompts): one side in memory at a time (in one
process each side's state stays resident through the other's step: at 8 prompts x 4 on SmolLM2-135M
in float32 the one-process run passed 9 GB), and each step's
process gives its ru_maxrss (set-up and the step), the peak RSS of that side alone; each step is
then its process's first (first-call costs included, on both sides). --warmup leaves the first
pair out of the medians. The machine's load (/proc/loadavg) is printed before and after every
step: this benchmark is meant for a machine shared with other jobs, and only the per-pair ratios
compare.
Headline, last: step_speedup_vs_trl (TRL's step seconds / ours, median of the pairs).

--vllm (CUDA, where vllm imports): a third arm, TRL with use_vllm (colocate mode).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config as C  # noqa: E402
import env  # noqa: E402
import sft  # noqa: E402
import train  # noqa: E402
from model import Transformer  # noqa: E402
from reward import Transcript, episode_rewards  # noqa: E402
from sqltask import dataset  # noqa: E402
from sqltask.chat import render_prompt  # noqa: E402
from sqltask.prompts import build_messages  # noqa: E402
from stream import PromptOrder, RolloutStream  # noqa: E402
from toy import tiny  # noqa: E402
from trainer import malloc_tuning, optim  # noqa: E402
from trainer.distributed import PeakMemory, compute_dtype, setup_dist, shard  # noqa: E402
from trainer.loss_scale import LossScaler  # noqa: E402
from trainer.memory import size_kv_pool  # noqa: E402
from trainer.policy_sampler import PolicySampler  # noqa: E402
from trainer.run_log import Log, Phases  # noqa: E402

TRL_LOSS = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "drgrpo": "dr_grpo"}  # grpo.loss_agg -> loss_type
# SmolLM2-135M's body and vocabulary size (data/prepare_smollm2.py's model), for --toy without --smoke
SMOLLM2_SHAPE = dict(family="llama", hidden_size=576, layers=30, heads=9, kv_heads=3, intermediate_size=1536,
                     vocab_size=49152)


# -----------------------------------------------------------------------------
# the run's config and data


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "runs", "smollm2"), help="HF folder (data/prepare_smollm2.py)")
    ap.add_argument("--data", default=os.path.join(ROOT, "runs", "sql_env", "train.jsonl"),
                    help="training records (data/prepare_sql_env.py or data/prepare_spider.py)")
    ap.add_argument("--db-root", default=os.environ.get("SPIDER_DIR", ""), help="the Spider folder (default $SPIDER_DIR)")
    ap.add_argument("--toy", default="", help="a folder: the toy set in DIR/toy, a random model in SmolLM2's shape "
                    "in DIR/vs_trl_model_<layers>l (each built when absent)")
    ap.add_argument("--smoke", action="store_true", help="tiny: a tiny random model, 2 prompts x 2, 8 tokens")
    ap.add_argument("--pairs", type=int, default=3, help="interleaved pairs, the first a warm-up")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--loss-agg", default="token-mean", choices=sorted(TRL_LOSS))
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--grad-clip", type=float, default=0.5)
    ap.add_argument("--trl-micro-batch", type=int, default=8, help="TRL's per_device_train_batch_size")
    ap.add_argument("--kv-budget", default="auto", help="our sampling.kv_budget_tokens (auto: as train.py sizes it)")
    ap.add_argument("--no-checkpointing", action="store_true", help="activation checkpointing off on both sides")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--vllm", action="store_true", help="also TRL with vLLM (colocate), where it imports")
    ap.add_argument("--fresh", action="store_true",
                    help="each step in a fresh process, alternately (one side in memory at a time; its ru_maxrss)")
    ap.add_argument("--warmup", action="store_true", help="the first pair is a warm-up, not counted")
    ap.add_argument("--only", choices=["ours", "trl"], help=argparse.SUPPRESS)  # a --fresh child: one side
    ap.add_argument("--pair", type=int, default=0, help=argparse.SUPPRESS)  # ... and the step it runs
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.smoke:
        a.prompts, a.group, a.max_new_tokens, a.pairs, a.trl_micro_batch = 2, 2, 8, min(a.pairs, 2), 2
        a.kv_budget = "20000"  # whatever memory the machine has left
    return a


def our_config(a, model_path: str, data_path: str, db_root: str, out_dir: str) -> C.Config:
    """Our run's config for the work above (every other key at its default)."""
    return C.load_config([
        f"--model.path={model_path}", "--model.build_tiny=false", f"--model.dtype={a.dtype}",
        f"--model.activation_checkpointing={str(not a.no_checkpointing).lower()}",
        f"--data.train_path={data_path}", f"--data.db_root={db_root}", "--data.prepare_toy=false",
        "--env.max_turns=1", f"--grpo.group_size={a.group}", f"--grpo.prompts_per_step={a.prompts}",
        f"--grpo.loss_agg={a.loss_agg}", f"--grpo.drgrpo_max_len={a.max_new_tokens}", "--grpo.dynamic_sampling=false",
        "--sampling.temperature=1.0", "--sampling.top_p=1.0", "--sampling.top_k=0",
        f"--sampling.max_new_tokens={a.max_new_tokens}",
        f"--sampling.kv_budget_tokens={a.kv_budget}",
        f"--optim.lr={a.lr}", "--optim.weight_decay=0", f"--optim.grad_clip={a.grad_clip}",
        f"--train.seed={a.seed}", f"--train.threads={a.threads}", f"--train.out_dir={out_dir}"])


def toy_assets(a) -> tuple[str, str, str]:
    """(model folder, training records, db root) of the toy set, with a random model in SmolLM2's shape
    and vocabulary size (a tiny one with --smoke) and the toy's own tokenizer (fewer tokens than the
    model's vocabulary: the rest are never sampled): a.toy/toy (configs/tiny.yaml's when a.toy is runs)
    and a.toy/vs_trl_model_<layers>l, each built when absent."""
    shape = dict(family="qwen2", hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128,
                 vocab_size=1024) if a.smoke else SMOLLM2_SHAPE
    cfg = C.load_config([f"--data.train_path={a.toy}/toy/train.jsonl", f"--data.eval_path={a.toy}/toy/eval.jsonl",
                         f"--data.db_root={a.toy}/toy", f"--model.path={a.toy}/vs_trl_model_{shape['layers']}l",
                         *[f"--model.tiny_{k}={v}" for k, v in shape.items()]])
    tiny.prepare_assets(cfg, Transformer, sft.gold_texts)
    return cfg.model.path, cfg.data.train_path, cfg.data.db_root


def load(a):
    """(config, tokenizer, training records) of the work."""
    from transformers import AutoTokenizer
    out_dir = os.path.join(a.toy or os.path.join(ROOT, "runs"), "vs_trl")
    if a.toy:
        model_path, data_path, db_root = toy_assets(a)
    else:
        if not a.db_root:
            sys.exit("error: no Spider folder: set SPIDER_DIR or pass --db-root (or --toy DIR for the toy set)")
        for path, how in ((os.path.join(a.model, "config.json"), "python data/prepare_smollm2.py --out runs/smollm2"),
                          (a.data, "python data/prepare_sql_env.py (or data/prepare_spider.py)")):
            if not os.path.exists(path):
                sys.exit(f"error: {path} is missing: {how}")
        model_path, data_path, db_root = a.model, a.data, a.db_root
    cfg = our_config(a, model_path, data_path, db_root, out_dir)
    tok = AutoTokenizer.from_pretrained(model_path)
    examples = dataset.load_examples(data_path, db_root)
    return cfg, tok, examples


def step_examples(examples: list[dict], cfg: C.Config, steps: int) -> list[list[dict]]:
    """Each step's prompts: our stream's order (stream.PromptOrder, the run's seed), chunk by chunk,
    so TRL gets the prompts our step samples."""
    order = PromptOrder(len(examples), cfg.train.seed)
    return [[examples[i] for i in order.take(cfg.grpo.prompts_per_step)] for _ in range(steps)]


def fit_context(cfg: C.Config, tok, steps: list[list[dict]]) -> C.Config:
    """sampling.max_context set to the work's longest row (prompt + max_new_tokens, in whole blocks), as
    a one-turn run would set it: kv_budget_tokens=auto reserves the step's rows x max_context, and at
    the default (29000) that would be a pool of every free gigabyte, not the work's."""
    longest = max(len(render_prompt(tok, x, cfg.data, "tags", cfg.data.db_root)) for work in steps for x in work)
    block = cfg.sampling.block_size
    context = -(-(longest + cfg.sampling.max_new_tokens) // block) * block
    return dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, max_context=context))


# -----------------------------------------------------------------------------
# the machine


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


class StepMemory:
    """The peak memory of one step: CUDA's max allocated, else the process's peak RSS over the step
    (VmHWM after writing 5 to /proc/self/clear_refs, which resets it to the current RSS)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.start = status_kb("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        self.peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" \
            else status_kb("VmHWM") * 1024


# -----------------------------------------------------------------------------
# ours: train.grpo_step as train.py runs it


class Ours:
    name = "ours"

    def __init__(self, cfg: C.Config, tok, examples: list[dict], device: torch.device, cursor: int = 0):
        model = Transformer.from_pretrained(cfg.model.path, dtype=torch.float32, device=device)
        model.set_activation_checkpointing(cfg.model.activation_checkpointing)
        sampling_cfg, _ = size_kv_pool(model, cfg, 1, device, 0, print)  # the KV pool, as train.py sizes it
        cfg = dataclasses.replace(cfg, sampling=sampling_cfg)
        model = shard(model, compute_dtype(cfg), cfg.model.fsdp_unit)
        opt, sched = optim.make_optimizer(model, cfg.optim, cfg.optim.lr, 0, 1000)
        sampler = PolicySampler(model, cfg.sampling, dtype=compute_dtype(cfg))
        sampler.refresh(model)
        self.run = train.Run(model, None, sampler, opt, sched, LossScaler(cfg.optim, compute_dtype(cfg)), tok, cfg,
                             Log(cfg, rank=1), rank=0, world=1, device=device)
        self.stream = RolloutStream(sampler, tok, examples, cfg, 0, 1, cursor)  # the run's prompt order
        self.device, self.steps = device, cursor // cfg.grpo.prompts_per_step

    def step(self, examples: list[dict]) -> dict:
        phase = Phases(PeakMemory(self.device))
        with StepMemory(self.device) as mem:
            t0 = time.perf_counter()
            kept, seen, metrics = train.grpo_step(self.run, self.stream, self.steps, phase)
            total = time.perf_counter() - t0
        got = sorted(e.example["id"] for e in seen[::self.run.cfg.grpo.group_size])
        assert got == sorted(x["id"] for x in examples), "our stream sampled other prompts than TRL's"
        self.steps += 1
        s = phase.pop()
        lengths = [e.trajectory.generated_tokens for e in kept]
        return dict(total=total, generation=s.get("rollout", 0) + s.get("reward", 0) + s.get("credit", 0),
                    update=s.get("update", 0) + s.get("sync", 0), trained=sum(lengths), peak=mem.peak, start=mem.start,
                    mean_len=statistics.mean(lengths), cut=statistics.mean(n >= self.run.cfg.sampling.max_new_tokens
                                                                           for n in lengths),
                    reward=statistics.mean(e.reward.value for e in seen))

    def close(self):
        self.stream.close()


# -----------------------------------------------------------------------------
# TRL: GRPOTrainer.train(), one optimizer step a call


def first_turn(text: str) -> str:
    """The completion up to its first stop string, kept (what our sampler's turn would be)."""
    cuts = [text.find(s) + len(s) for s in env.STOP_STRINGS["tags"] if s in text]
    return text[:min(cuts)] if cuts else text


class Trl:
    def __init__(self, a, cfg: C.Config, tok, device: torch.device, first: list[dict], vllm: bool = False):
        from transformers import AutoConfig, AutoModelForCausalLM, PrinterCallback, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
        self.name, self.cfg, self.device = "trl+vllm" if vllm else "trl", cfg, device
        micro = min(a.trl_micro_batch, a.prompts * a.group)
        assert a.prompts * a.group % micro == 0, "--trl-micro-batch must divide prompts x group"
        extra = dict(use_vllm=True, vllm_mode="colocate") if vllm else {}
        args = GRPOConfig(
            output_dir=os.path.join(cfg.train.out_dir, self.name), per_device_train_batch_size=micro,
            gradient_accumulation_steps=a.prompts * a.group // micro, num_generations=a.group,
            max_completion_length=a.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
            loss_type=TRL_LOSS[a.loss_agg], epsilon=0.2, epsilon_high=0.2, beta=0.0, scale_rewards="group",
            learning_rate=a.lr, weight_decay=0.0, adam_beta1=cfg.optim.beta1, adam_beta2=cfg.optim.beta2,
            max_grad_norm=a.grad_clip, lr_scheduler_type="constant", max_steps=1,
            gradient_checkpointing=not a.no_checkpointing, bf16=a.dtype == "bfloat16", use_cpu=device.type == "cpu",
            report_to=[], save_strategy="no", logging_steps=1000, disable_tqdm=True, seed=a.seed, **extra)
        config = AutoConfig.from_pretrained(cfg.model.path)
        if getattr(config, "quantization_config", None):  # a GGUF-built folder may still name its source's
            del config.quantization_config               # quantization; its weights are plain float32
        model = AutoModelForCausalLM.from_pretrained(cfg.model.path, config=config, dtype=torch.float32)
        self.trainer = GRPOTrainer(model=model, reward_funcs=self.reward, args=args, processing_class=tok,
                                   train_dataset=self.dataset(first))
        self.times: dict[str, float] = {}
        times, generate = self.times, self.trainer._generate_and_score_completions
        self.batches: list[dict] = []

        def timed_generation(inputs):  # TRL's sampling, reward and advantages, timed (it returns them unchanged)
            t0 = time.perf_counter()
            out = generate(inputs)
            times["generation"] = times.get("generation", 0.0) + time.perf_counter() - t0
            self.batches.append(out)
            return out
        self.trainer._generate_and_score_completions = timed_generation

        class StepClock(TrainerCallback):  # the optimizer step's seconds: its first micro-batch to after the step
            def on_step_begin(self, args, state, control, **kwargs):
                times["begin"] = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                times["end"] = time.perf_counter()
        self.trainer.add_callback(StepClock())
        self.trainer.remove_callback(PrinterCallback)  # its per-call summary lines
        print(f"{self.name}: TRL {__import__('trl').__version__}, accelerate {self.trainer.accelerator.distributed_type}, "
              f"micro-batches of {micro} x {args.gradient_accumulation_steps}, loss_type {args.loss_type}, "
              f"gradient checkpointing {args.gradient_checkpointing}", flush=True)

    def dataset(self, examples: list[dict]):
        from datasets import Dataset
        db_root = self.cfg.data.db_root
        return Dataset.from_list([{"prompt": build_messages(x, db_root, self.cfg.data, "tags"),
                                   "db_path": dataset.abs_db_path(x, db_root), "gold_sql": x["gold_sql"]}
                                  for x in examples])

    def reward(self, prompts, completions, completion_ids, db_path, gold_sql, **kwargs) -> list[float]:
        """Our reward (reward.episode_rewards) of each completion's first turn."""
        scripts = []
        for completion, ids, db, gold in zip(completions, completion_ids, db_path, gold_sql):
            turn = first_turn(completion[0]["content"] if isinstance(completion, list) else completion)
            action = env.parse_turn(turn, "tags")
            finished = action.kind == "solution"
            scripts.append(Transcript(db, gold, turn, action.arg if finished else "", finished, [], len(ids)))
        self.rewards = [r.value for r in episode_rewards(scripts, self.cfg.reward, "tags")]
        return self.rewards

    def prompt_ids(self, examples: list[dict]) -> list[list[int]]:
        """The prompts' ids as TRL renders them (its _tokenize_prompts)."""
        msgs = [build_messages(x, self.cfg.data.db_root, self.cfg.data, "tags") for x in examples]
        return self.trainer._tokenize_prompts(msgs)[0]

    def step(self, examples: list[dict]) -> dict:
        self.trainer.train_dataset = self.dataset(examples)
        self.times.clear()
        self.batches.clear()
        with StepMemory(self.device) as mem:
            t0 = time.perf_counter()
            self.trainer.train()
            call = time.perf_counter() - t0
        assert len(self.batches) == 1, "one generation a step"
        out = self.batches[0]
        total = self.times["end"] - self.times["begin"]
        lengths = out["completion_mask"].sum(dim=1).tolist()
        return dict(total=total, generation=self.times["generation"], update=total - self.times["generation"],
                    trained=int(out["completion_mask"].sum()), peak=mem.peak, start=mem.start, outside=call - total,
                    mean_len=statistics.mean(lengths), cut=statistics.mean(n >= self.trainer.max_completion_length
                                                                           for n in lengths),
                    reward=statistics.mean(self.rewards))

    def close(self):
        pass


# -----------------------------------------------------------------------------


def describe(side: str, r: dict, device: torch.device) -> str:
    unit = "GPU peak" if device.type == "cuda" else "peak RSS"
    extra = f", whole process ru_maxrss {r['maxrss'] / 2 ** 30:.2f} GB" if "maxrss" in r else ""
    return (f"{side} {r['total']:.1f}s (generation {r['generation']:.1f} + update {r['update']:.1f}), "
            f"{r['trained']} trained tok ({r['trained'] / r['total']:.0f}/s), mean completion {r['mean_len']:.0f} tok, "
            f"{100 * r['cut']:.0f}% cut, reward {r['reward']:+.2f}, {unit} {r['peak'] / 2 ** 30:.2f} GB "
            f"(+{(r['peak'] - r['start']) / 2 ** 30:.2f} over the step's start){extra}")


def fresh_step(argv: list[str], side: str, pair: int) -> dict:
    """One side's step `pair` alone in a fresh process (set-up, then that step): its result, with the
    process's ru_maxrss (set-up and step)."""
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--only", side, "--pair", str(pair)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("child_result: ")]
    if proc.returncode or not line:
        sys.exit(f"error: the {side} child failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(line[-1].split(" ", 1)[1])


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if a.only != "ours":  # (a child running our side alone imports none of TRL: its RSS is ours alone)
        try:
            import trl  # noqa: F401
        except ImportError:
            sys.exit("error: trl is not installed: pip install -r requirements-dev.txt -c constraints.txt")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: no GPU visible")
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # setup_dist and TRL both follow torch's device choice
        if a.only != "trl":  # as train.py does on a CPU (in one process it serves TRL's step too)
            malloc_tuning.keep_freed_memory()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    results: dict[str, list[dict]] = {"ours": [], "trl": []}
    if a.fresh:  # every step in a fresh process, alternately: one side's memory at a time, its ru_maxrss
        child_argv = [x for x in argv if x != "--fresh"]
        print(f"work: {a.prompts} prompts x {a.group}, <= {a.max_new_tokens} new tokens, {a.loss_agg}, {a.dtype} on "
              f"{a.device}; each step in a fresh process ({'toy' if a.toy else a.model}), alternately", flush=True)
        for pair in range(a.pairs):
            for side in ("ours", "trl"):
                before = loadavg()
                r = fresh_step(child_argv, side, pair)
                results[side].append(r)
                print(f"pair {pair + 1}{' (warm-up)' if pair == 0 and a.warmup else ''}, fresh process: "
                      f"{describe(side, r, device)} | load {before} -> {loadavg()}", flush=True)
        sides = ["ours", "trl"]
    else:
        setup_dist(3600)  # train.py's one-rank process group (FSDP2 on one rank)
        cfg, tok, examples = load(a)
        steps = step_examples(examples, cfg, max(a.pairs, a.pair + 1))
        cfg = fit_context(cfg, tok, steps)
        print(f"work: {a.prompts} prompts x {a.group}, <= {a.max_new_tokens} new tokens, temperature 1.0, one turn, "
              f"{a.loss_agg}, lr {a.lr:g}, clip 0.2/0.2, grad clip {a.grad_clip:g}, {a.dtype} on {device}, "
              f"{torch.get_num_threads()} threads, activation checkpointing {not a.no_checkpointing}, "
              f"sampling.max_context {cfg.sampling.max_context}; "
              f"model {cfg.model.path}, data {cfg.data.train_path}", flush=True)
        arms = []
        if a.only != "trl":
            arms.append(Ours(cfg, tok, examples, device, cursor=a.pair * a.prompts if a.only else 0))
        if a.only != "ours":
            arms.append(Trl(a, cfg, tok, device, steps[a.pair if a.only else 0]))
            ours_ids = [render_prompt(tok, x, cfg.data, "tags", cfg.data.db_root) for x in steps[0]]
            assert arms[-1].prompt_ids(steps[0]) == ours_ids, "TRL renders other prompt ids than ours"
            print(f"prompts: the same token ids on both sides (first step: "
                  f"{sum(map(len, ours_ids)) / len(ours_ids):.0f} tokens on average)", flush=True)
        if a.vllm and not a.only:
            try:
                import vllm  # noqa: F401
                arms.append(Trl(a, cfg, tok, device, steps[0], vllm=True))
            except ImportError:
                print("trl+vllm: vllm is not installed here: that arm is skipped", flush=True)
        if a.only:  # a --fresh child: set-up, one step, its result and the process's peak RSS
            r = arms[0].step(steps[a.pair])
            r["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            arms[0].close()
            print(describe(a.only, r, device))
            print("child_result: " + json.dumps(r))
            return
        results = {arm.name: [] for arm in arms}
        for pair, work in enumerate(steps):
            for arm in arms:
                before = loadavg()
                r = arm.step(work)
                results[arm.name].append(r)
                print(f"pair {pair + 1}{' (warm-up)' if pair == 0 and a.warmup else ''}: {describe(arm.name, r, device)} "
                      f"| load {before} -> {loadavg()}", flush=True)
        for arm in arms:
            arm.close()
        sides = [arm.name for arm in arms]
    counted = {name: rs[1:] if a.warmup and len(rs) > 1 else rs for name, rs in results.items()}
    ours = counted["ours"]

    def median_ratio(other: list[dict], key: str) -> float:
        return statistics.median(o[key] / max(m[key], 1e-9) for o, m in zip(other, ours))
    lines = []
    for name in [s for s in sides if s != "ours"]:
        theirs = counted[name]
        tag = name.replace("+", "_")
        speed = statistics.median((m["trained"] / m["total"]) / (o["trained"] / o["total"]) for o, m in zip(theirs, ours))
        print(f"{name}: median of {len(ours)} pair(s): our step {median_ratio(theirs, 'total'):.2f}x faster (generation "
              f"{median_ratio(theirs, 'generation'):.2f}x, update {median_ratio(theirs, 'update'):.2f}x), trained tokens/s "
              f"{speed:.2f}x; TRL's train() call outside its step {statistics.median(o['outside'] for o in theirs):.1f}s "
              "(set-up per call, not counted)")
        lines += [f"generation_speedup_vs_{tag}: {median_ratio(theirs, 'generation'):.2f}",
                  f"update_speedup_vs_{tag}: {median_ratio(theirs, 'update'):.2f}",
                  f"trained_tok_s_ratio_vs_{tag}: {speed:.2f}",
                  f"peak_mem_gb_{tag}: {max(o['peak'] for o in theirs) / 2 ** 30:.2f}"]
    lines.append(f"peak_mem_gb_ours: {max(m['peak'] for m in ours) / 2 ** 30:.2f}")
    if a.fresh:
        lines += [f"fresh_process_maxrss_gb_{name}: {max(r['maxrss'] for r in counted[name]) / 2 ** 30:.2f}"
                  for name in sides]
    print("\n".join(lines))
    print(f"step_speedup_vs_trl: {median_ratio(counted['trl'], 'total'):.2f}")


if __name__ == "__main__":
    main()
