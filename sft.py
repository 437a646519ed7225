"""SFT warm start: next-token training on gold trajectories rendered in the protocol.

A gold trajectory is what a perfect policy would write, tokenized segment by segment exactly as
the rollout appends them (token-in-token-out), so SFT and RL see the same token boundaries:

    prompt | <think>{think}</think>\\n<sql>{query}</sql> | observation (real rows) |
           <think>{think}</think>\\n<solution>{gold}</solution><end of turn>

The tool turn's query is the record's `lookup_sql` when it has one (toy questions that name a
category the database stores as a code: the lookup lists the codes, the solution copies one),
after the record's `first_lookup_sql` (a lookup that returns no rows) when it has one and
env.max_turns leaves a turn for each;
otherwise, with `sft.with_tool_turn`, the gold itself (a check); otherwise there is no tool turn.
The think after the observation keeps SkyRL's rule: every </observation> is followed by <think>.

Loss only on the model-side segments (mask 1), never on the prompt or the observation. The end
of turn is the chat template's own token (end_of_turn_id), so the warm start teaches the token
the rollout stops on for any model family.
train.py runs it before GRPO when `sft.steps > 0`; it shares the model, FSDP2 and checkpoints.
"""
from __future__ import annotations

import random

import torch

import config as C
import env
import packing
import rollout


def gold_trajectory(example: dict, prompt_ids: list[int], tokenizer, cfg: C.Config, db_path: str):
    """-> (ids, mask): one gold episode as token ids with a 1 on every model-side token."""
    think = f"<think>{cfg.sft.think_text}</think>\n"
    ids, mask = list(prompt_ids), [0] * len(prompt_ids)

    def model_says(text):
        t = tokenizer.encode(text, add_special_tokens=False)
        ids.extend(t)
        mask.extend([1] * len(t))

    turns_left = cfg.env.max_turns
    query = example.get("lookup_sql") or (example["gold_sql"] if cfg.sft.with_tool_turn else "")
    # a toy record's first_lookup_sql: the natural lookup that returns no rows, tried first when
    # there are turns for both lookups and the answer (the failed-then-fixed lookup)
    first = example.get("first_lookup_sql", "") if query and cfg.env.max_turns > 2 else ""
    for query in [q for q in (first, query) if q and cfg.env.max_turns > 1]:
        model_says(f"{think}<sql>{query}</sql>")
        turns_left -= 1
        res = env.run_sql(db_path, query, timeout_s=cfg.env.tool_timeout_s,
                          max_rows=cfg.env.fetch_rows)
        obs = observation_ids(tokenizer, env.format_observation(res, turns_left, cfg.env), cfg.env.conversation)
        ids.extend(obs)
        mask.extend([0] * len(obs))
    model_says(f"{think}<solution>{example['gold_sql']}</solution>")
    ids.append(end_of_turn_id(tokenizer))
    mask.append(1)
    return ids, mask


def end_of_turn_id(tokenizer) -> int:
    """The token the chat template closes an assistant turn with (Qwen: <|im_end|>, Llama 3:
    <|eot_id|>); the tokenizer's eos_token when there is no template or it adds none."""
    marker = "\x00END\x00"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": marker}], tokenize=False)
    except Exception:  # no chat template
        text = ""
    tail = text[text.rfind(marker) + len(marker):] if marker in text else ""
    for token in sorted(tokenizer.get_added_vocab(), key=len, reverse=True):
        if token and tail.startswith(token):
            return tokenizer.convert_tokens_to_ids(token)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither an end-of-turn token in its chat template nor an eos_token")
    return tokenizer.eos_token_id


def render_prompts(tokenizer, examples, data_cfg, protocol, db_root) -> list[list[int]]:
    """Prompt ids exactly as rollout.rollout renders them."""
    return [rollout.render_prompt(tokenizer, ex, data_cfg, protocol, db_root) for ex in examples]


def observation_ids(tokenizer, obs: str, conversation: str) -> list[int]:
    """Observation ids exactly as rollout.rollout appends them after a turn that ended in a stop string."""
    return rollout.observation_ids(tokenizer, obs, conversation)


def build_dataset(examples, prompts, tokenizer, cfg: C.Config, db_paths) -> list[tuple[list[int], list[int]]]:
    out = []
    for ex, p, dbp in zip(examples, prompts, db_paths):
        ids, mask = gold_trajectory(ex, p, tokenizer, cfg, dbp)
        if len(ids) <= cfg.sampling.max_context:
            out.append((ids, mask))
    return out


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
    token count so micro-batches and ranks add up to one token-mean. Sequences whose prompts
    start alike (system prompt, a database's schema) compute that prefix once
    (packing.shared_prefix_lens): the same logprobs, fewer tokens."""
    device = next(model.parameters()).device
    mb, = packing.plan(seqs, packing.shared_prefix_lens(seqs), budget=1 << 62,
                       row_tokens=row_tokens or sum(len(s[0]) for s in seqs))
    logp, _ = packing.forward(model, mb, device, temperature)  # (N,) loss tokens only
    return -logp.sum()
