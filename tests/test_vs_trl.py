"""Our GRPO step against TRL's GRPOTrainer on the same fixed completions and rewards: the advantages
and the gradients of the optimizer steps are equal, with TRL's own code as the reference (its
trainer's train() on a tiny model: its advantage code, its loss, its accumulation scaling; only the
sampling is replaced, through its public `rollout_func` hook, by the fixed completions).

    .venv/bin/python -m pytest -q tests/test_vs_trl.py      # ~30 s; skipped when trl is not installed

Our side is train.grpo_step itself (credit, update, optimizer step) fed the same episodes by a
stand-in stream. Two optimizer steps on the same batch (TRL num_iterations=2, our grpo.ppo_epochs=2):
the first at ratio 1, the second after an AdamW step large enough that the ratio clip acts on part of
the tokens, so the clip and the old logprobs are compared too.

Each grpo.loss_agg and its TRL counterpart (loss_type):
    token-mean           dapo   (Σ mask·ℓ over the generation batch / its masked tokens; TRL's default)
                         bnpo   (the same per micro-batch: equal with one micro-batch a step, as here)
    seq-mean-token-mean  grpo   (each sequence's token mean, then the mean over sequences)
    drgrpo               dr_grpo (Σ mask·ℓ / (B · L), L = grpo.drgrpo_max_len = max_completion_length)
    seq-mean-token-sum   luspo  (Σ_t mask·ℓ, mean over sequences; TRL allows it only with the sequence
                                 ratio, importance_sampling_level="sequence", which is our gspo loss)
and the losses TRL shares: gspo (grpo + sequence ratio), cispo (TRL's epsilon_high is the ratio's cap
itself, our 1 + ε_high), sapo (the same temperatures 1.0 / 1.05).

Documented differences (each checked below where it shows):
  - the advantage's eps: TRL adds 1e-4 to the std, fixed; ours grpo.adv_eps (1e-6 by default); the
    test sets adv_eps = 1e-4. Both take the unbiased std (n - 1) over the group ("group"), the whole
    batch ("batch"), or none; a group whose rewards are all equal gets 0 on both sides.
  - masked rows (TRL mask_truncated_completions, our grpo.mask_truncated): both leave a truncated
    completion's reward in its group's statistics and its tokens out of the loss. TRL keeps the row in
    the batch, all-masked: grpo's mean over sequences and dr_grpo's B still count it. We leave the
    episode out of the update, so the sequence normaliser does not: with k of B rows masked, our
    seq-mean-token-mean and drgrpo gradients are TRL's times B / (B - k). token-mean / dapo count only
    masked tokens on both sides: equal.
  - TRL's Trainer leaves biases and norm weights out of weight decay; our AdamW decays every
    parameter. The test runs weight decay 0.
  - ours clamps log ρ to ±20 before exp (SkyRL, verl); TRL does not at the token level. No effect
    at these ratios.
"""
import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func, the hook the fixed completions use, is marked experimental

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed (requirements-dev.txt pins it: "
                                        "pip install -r requirements-dev.txt -c constraints.txt)")

import config as C  # noqa: E402
import grpo  # noqa: E402
import train  # noqa: E402
from model import Transformer  # noqa: E402
from reward import Reward  # noqa: E402
from rollout import Episode, Trajectory  # noqa: E402
from toy import tiny  # noqa: E402
from trainer import hf_folder, optim  # noqa: E402
from trainer.distributed import PeakMemory  # noqa: E402
from trainer.loss_scale import LossScaler  # noqa: E402
from trainer.run_log import Phases  # noqa: E402

P, G, MAX_LEN = 3, 4, 12  # prompts, samples a prompt, max_completion_length (drgrpo's L)
LR = 0.05  # large: after the first AdamW step part of the tokens' ratios leave [0.8, 1.2] and the clip acts
# float32 tolerances, max |ours - TRL| of a tensor against max |TRL| over the whole gradient. The two
# sides differ in summation order and kernels (our fused q/k/v and gate/up against transformers'
# separate projections): the first step measured <= 2.4e-7. The second step's weights come out of
# AdamW's first step, whose update g/(|g| + 1e-8) turns a float32 rounding of a gradient entry near 0
# into a larger weight difference: measured <= 2.0e-5 (sapo), so 1e-4 there.
RTOL_FIRST, RTOL_SECOND = 1e-6, 1e-4
ADV_TOL = 1e-6  # advantages: measured <= 6e-8


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the tiny model's ops are too small to share, and on a loaded 2-core machine
    two threads spin against each other (this file's CPU time was 4x higher with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The tiny model folder, P prompts (token ids), G completions each (some end on EOS, some are
    cut at MAX_LEN without it: truncated), and their rewards (group 2's all equal)."""
    d = tmp_path_factory.mktemp("vs_trl")
    tiny.build_tiny(Transformer, str(d), None, vocab_size=300, hidden_size=32, layers=2, heads=2, kv_heads=1,
                    intermediate_size=64, seed=0)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(d))
    prompts = [tok(text)["input_ids"] for text in ("SELECT name FROM singer", "how many rows are there",
                                                   "list every concert")]
    g = torch.Generator().manual_seed(0)
    specials = {tok.eos_token_id, tok.pad_token_id}
    completions, rewards = [], [1.0, 0.0, -1.0, 1.0, 0.0, 0.0, 1.0, -1.0, 1.0, 1.0, 1.0, 1.0]
    for i, n in enumerate([3, 7, MAX_LEN, 9, 4, MAX_LEN, 8, 2, 5, 6, MAX_LEN, 3]):
        ids = [int(x) for x in torch.randint(3, 290, (n,), generator=g) if int(x) not in specials][:n]
        while len(ids) < n:
            ids.append(7)
        if n < MAX_LEN:  # ended on EOS; the MAX_LEN ones were cut (truncated)
            ids[-1] = tok.eos_token_id
        completions.append(ids)
    return str(d), tok, prompts, completions, rewards


# -----------------------------------------------------------------------------
# TRL: its own trainer, sampling replaced by the fixed completions


def trl_step(case, steps: int, **args) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """TRL's advantages (P*G,) in our order (prompt-major, sample order) and its gradient before each
    of `steps` optimizer steps ({HF name: grad}), from GRPOTrainer.train()."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    d, tok, prompts, completions, rewards = case
    names = [f"prompt{i}" for i in range(P)]
    served: list[tuple[int, int]] = []  # (prompt, sample) of each row TRL asked for, in its order

    def rollout_func(batch_prompts, trainer):  # TRL's hook for a custom sampler: the fixed completions
        seen = {}
        served.clear()
        for name in batch_prompts:
            i = names.index(name)
            served.append((i, seen.setdefault(i, 0)))
            seen[i] += 1
        rows = [completions[i * G + k] for i, k in served]
        return {"prompt_ids": [prompts[i] for i, _ in served], "completion_ids": rows,
                "logprobs": [[0.0] * len(r) for r in rows]}

    def reward_func(prompts, completions, completion_ids, **kwargs):
        return [rewards[i * G + k] for i, k in served]

    grads = []

    class Grads(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    config = GRPOConfig(output_dir=os.path.join(d, "trl_out"), per_device_train_batch_size=P * G,
                        gradient_accumulation_steps=1, num_generations=G, max_completion_length=MAX_LEN,
                        temperature=1.0, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
                        max_grad_norm=0.0, num_iterations=steps, max_steps=steps, use_cpu=True, bf16=False,
                        gradient_checkpointing=False, report_to=[], save_strategy="no", logging_steps=1,
                        disable_tqdm=True, seed=0, **args)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_func, args=config, processing_class=tok,
                          train_dataset=Dataset.from_dict({"prompt": names}), rollout_func=rollout_func,
                          callbacks=[Grads()])
    generate = trainer._generate_and_score_completions
    advantages = {}

    def observed(inputs):  # TRL's own advantages, read as they leave its code (before its shuffle)
        out = generate(inputs)
        for (i, k), a in zip(served, out["advantages"].tolist()):
            advantages[i * G + k] = a
        return out
    trainer._generate_and_score_completions = observed
    trainer.train()
    return torch.tensor([advantages[j] for j in range(P * G)]), grads


# -----------------------------------------------------------------------------
# ours: train.grpo_step on the same episodes


class FixedStream:
    """A stand-in for stream.RolloutStream: the step's round is the fixed episodes."""
    def __init__(self, episodes):
        self.episodes = episodes

    def next_round(self, step, phase, first_group=0):
        return self.episodes

    def step_metrics(self, trajs, step, device):
        return {}


class NoSampler:
    def refresh(self, model):  # the weight sync has nothing to copy into here
        pass


def episodes_of(case) -> list[Episode]:
    d, tok, prompts, completions, rewards = case
    out = []
    for j, (ids, r) in enumerate(zip(completions, rewards)):
        prompt = prompts[j // G]
        traj = Trajectory.of(prompt, prompt + ids, [0] * len(prompt) + [1] * len(ids), [0.0] * (len(prompt) + len(ids)),
                             turn_spans=[(len(prompt), len(prompt) + len(ids))], num_turns=1,
                             end_reason="eos" if ids[-1] == tok.eos_token_id else "turn_cut")
        out.append(Episode(traj, Reward(r, r == 1.0, r >= 0.0), {}, j // G))
    return out


def our_step(case, steps: int, *overrides: str) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], dict]:
    """Our advantages (P*G,), the gradient before each of `steps` optimizer steps ({HF name: grad}),
    and the step's metrics, from train.grpo_step."""
    d = case[0]
    cfg = C.load_config([f"--model.path={d}", f"--grpo.group_size={G}", f"--grpo.prompts_per_step={P}",
                         f"--grpo.ppo_epochs={steps}", "--grpo.adv_eps=1e-4", f"--grpo.drgrpo_max_len={MAX_LEN}",
                         "--sampling.temperature=1.0", f"--optim.lr={LR}", "--optim.weight_decay=0",
                         "--optim.grad_clip=1e9", *overrides])  # a clip that never acts: grads as computed
    model = Transformer.from_pretrained(d, dtype=torch.float32)
    opt, sched = optim.make_optimizer(model, cfg.optim, cfg.optim.lr, 0, steps)
    grads = []
    opt.register_step_pre_hook(lambda o, a, k: grads.append(
        dict(hf_folder.to_hf({n: p.grad.detach().clone() for n, p in model.named_parameters()}, model.config))))
    run = train.Run(model, None, NoSampler(), opt, sched, LossScaler(cfg.optim, torch.float32), None, cfg, None,
                    rank=0, world=1, device=torch.device("cpu"))
    episodes = episodes_of(case)
    advantages = torch.stack([a[0] for a in grpo.token_advantages(episodes, cfg.grpo)])
    _, _, metrics = train.grpo_step(run, FixedStream(episodes), 0, Phases(PeakMemory(torch.device("cpu"))))
    return advantages, grads, metrics


def assert_grads_equal(ours: dict, theirs: dict, scale: float = 1.0, rtol: float = RTOL_FIRST) -> None:
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    top = max(g.abs().max() for g in theirs.values())
    assert top > 0
    for name in theirs:
        err = (ours[name] - scale * theirs[name]).abs().max()
        assert err <= rtol * scale * top, (name, float(err), float(top))


# -----------------------------------------------------------------------------
# the cases

AGGS = [  # (our grpo.loss_agg and loss, TRL's loss_type and settings)
    ("token-mean", "grpo", {"loss_type": "dapo"}),
    ("token-mean", "grpo", {"loss_type": "bnpo"}),
    ("seq-mean-token-mean", "grpo", {"loss_type": "grpo"}),
    ("drgrpo", "grpo", {"loss_type": "dr_grpo"}),
    ("seq-mean-token-sum", "gspo", {"loss_type": "luspo", "importance_sampling_level": "sequence",
                                    "epsilon": 3e-4, "epsilon_high": 4e-4}),
    ("seq-mean-token-mean", "gspo", {"loss_type": "grpo", "importance_sampling_level": "sequence",
                                     "epsilon": 3e-4, "epsilon_high": 4e-4}),
    ("token-mean", "cispo", {"loss_type": "cispo", "epsilon_high": 1.28}),
    ("seq-mean-token-mean", "sapo", {"loss_type": "sapo"}),
]


@pytest.mark.parametrize("agg,loss,trl_args", AGGS, ids=[f"{a}-{t['loss_type']}-{l}" for a, l, t in AGGS])
def test_two_steps_equal_trl(case, agg, loss, trl_args):
    """The advantages, the first step's gradient (ratio 1) and the second's (after one AdamW step:
    the ratio clip and the old logprobs matter) equal TRL's."""
    trl_adv, trl_grads = trl_step(case, 2, **trl_args)
    adv, grads, metrics = our_step(case, 2, f"--grpo.loss_agg={agg}", f"--grpo.loss={loss}")
    torch.testing.assert_close(adv, trl_adv, atol=ADV_TOL, rtol=0)
    assert len(grads) == len(trl_grads) == 2
    assert_grads_equal(grads[0], trl_grads[0])
    assert_grads_equal(grads[1], trl_grads[1], rtol=RTOL_SECOND)
    if loss in ("grpo", "cispo", "gspo"):  # the second step's ratios left the band: the clip was compared
        assert metrics["clip_frac"] > 0, metrics


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_advantages_equal_trl(case, mode):
    """grpo.advantage group / batch / none = TRL's scale_rewards (eps 1e-4 on both sides), with a group
    whose rewards are all equal (0 on both); and the first step's gradient with it."""
    trl_adv, trl_grads = trl_step(case, 1, scale_rewards=mode)
    adv, grads, _ = our_step(case, 1, f"--grpo.advantage={mode}")
    torch.testing.assert_close(adv, trl_adv, atol=ADV_TOL, rtol=0)
    assert adv[2 * G:].abs().max() == 0  # the all-equal group
    assert_grads_equal(grads[0], trl_grads[0])
    if mode == "group":  # our default eps (1e-6) against TRL's fixed 1e-4: A x (std + 1e-4) / (std + 1e-6)
        rewards = torch.tensor(case[4])
        std = rewards.view(P, G).std(dim=1).repeat_interleave(G)
        ours_default = grpo.advantages(rewards, G, "group", C.GRPOConfig().adv_eps)
        torch.testing.assert_close(ours_default, trl_adv * (std + 1e-4) / (std + 1e-6), atol=ADV_TOL, rtol=1e-6)
        assert (ours_default - trl_adv).abs().max() > 100 * ADV_TOL  # a real difference at the defaults


@pytest.mark.parametrize("agg,loss_type", [("token-mean", "dapo"), ("seq-mean-token-mean", "grpo"),
                                           ("drgrpo", "dr_grpo")])
def test_masked_rows(case, agg, loss_type):
    """Truncated completions masked on both sides (TRL mask_truncated_completions, our
    grpo.mask_truncated): the same advantages (a cut one's reward stays in its group's statistics); the
    same gradient for token-mean; for the sequence normalisers TRL still counts the masked rows,
    we do not: ours = TRL's x B / (B - k)."""
    trl_adv, trl_grads = trl_step(case, 1, loss_type=loss_type, mask_truncated_completions=True)
    adv, grads, _ = our_step(case, 1, f"--grpo.loss_agg={agg}", "--grpo.mask_truncated=true")
    torch.testing.assert_close(adv, trl_adv, atol=ADV_TOL, rtol=0)
    masked = sum(len(c) == MAX_LEN for c in case[3])
    assert masked == 3
    scale = 1.0 if agg == "token-mean" else P * G / (P * G - masked)
    assert_grads_equal(grads[0], trl_grads[0], scale)
