"""The chat template around the model's turns: a prompt's ids, the EOS ids, and what the
conversation format (env.conversation = conversation) puts around an observation. Token in, token
out: the rollout tokenizes each piece once and never re-renders the history.

    prompt_ids = render_prompt(tokenizer, example, cfg.data, cfg.env.protocol, cfg.data.db_root)
    ids = observation_ids(tokenizer, observation_text, cfg.env.conversation, last_sampled_id)
Tests: .venv/bin/pytest tests/test_rollout.py tests/test_sft.py
"""
from __future__ import annotations

import functools

from sqltask.prompts import build_messages


def render_prompt(tokenizer, example: dict, data_cfg, protocol: str, db_root) -> list[int]:
    """Prompt ids of one example: its chat messages rendered with the generation prompt."""
    msgs = build_messages(example, db_root, data_cfg, protocol=protocol)
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def eos_ids(tokenizer) -> list[int]:
    """EOS ids: the tokenizer's eos plus <|im_end|> / <|endoftext|> when the vocab has them."""
    vocab = tokenizer.get_vocab()
    ids = {tokenizer.eos_token_id} | {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab}
    return sorted(i for i in ids if i is not None)


@functools.lru_cache(maxsize=16)
def conversation_wrapper(tokenizer) -> tuple[str, str, str]:
    """(close, before, after) around an observation in the conversation format: `close` ends the
    assistant turn (an EOS token such as <|im_end|>; skipped when the model sampled it),
    `before` opens a user message, `after` closes it and opens the next assistant turn. Found by
    rendering only a dummy exchange with the chat template (template-suffix differencing); the
    real history is never re-rendered."""
    A, O = "\u2063ASSISTANT\u2063", "\u2063OBSERVATION\u2063"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": A}, {"role": "user", "content": O}]
    s = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    a, o = s.index(A) + len(A), s.index(O)
    head = s[a:o]  # e.g. "<|im_end|>\n<|im_start|>user\n"
    close = next((e for e in tokenizer.convert_ids_to_tokens(eos_ids(tokenizer)) if head.startswith(e)), "")
    return close, head[len(close):], s[o + len(O):]


def conversation_pieces(tokenizer, env_cfg) -> tuple[str, ...]:
    """The chat-template text that the conversation format (env.conversation = conversation)
    inserts between an assistant turn and an observation (conversation_wrapper), which
    reward.format_ok removes before its rules run; () in the single-message format, which inserts none."""
    if getattr(env_cfg, "conversation", "single") != "conversation":
        return ()
    return tuple(p for p in conversation_wrapper(tokenizer) if p)


def observation_ids(tokenizer, observation: str, conversation: str, last_id: int | None = None) -> list[int]:
    """The ids appended after a turn (tokenized once): the env's observation text as it is in the
    single-message format; in the conversation format the assistant turn closed (unless its last
    sampled token `last_id` already closed it), the observation as a user message and a new
    assistant turn opened, exactly as the chat template renders the whole conversation."""
    if conversation == "conversation":
        close, before, after = conversation_wrapper(tokenizer)
        sampled_close = close and last_id == tokenizer.convert_tokens_to_ids(close)
        observation = ("" if sampled_close else close) + before + observation.strip() + after
    return tokenizer.encode(observation, add_special_tokens=False)
