"""Chat templates: how a conversation becomes (input_ids, labels) for supervised fine-tuning.

``tokenizer`` renders the tokenizer's own ``chat_template``. The named templates reproduce LLaMA-Factory's
(``src/llamafactory/data/template.py``) token for token, with its supervised processor's defaults
(``train_on_prompt: false``, ``mask_history: false``): every (user, assistant) pair is a (source, target) pair of
id lists, sources are masked, targets are labelled, and ``cutoff_len`` is shared out pair by pair with
:func:`infer_seqlen`, so a YAML written for LLaMA-Factory trains on the same tokens here.

Each text slot is tokenised on its own (``add_special_tokens=False``), as LLaMA-Factory does: BPE merges never
cross a slot boundary, and the ids only match if the boundaries do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum

IGNORE_INDEX = -100
CONTENT = "{content}"  # where a slot takes the turn's text


class DataError(ValueError):
    """Bad dataset file, dataset_info entry or template; the message names the file and the field."""


class Token(Enum):
    """A slot for the tokenizer's own bos / eos id (LLaMA-Factory's ``{"bos_token"}`` / ``{"eos_token"}``)."""

    BOS = "bos_token"
    EOS = "eos_token"


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> tuple[int, int]:
    """LLaMA-Factory's split of a token budget between a turn's prompt (source) and response (target).

    A response shorter than half the budget is kept whole; else a prompt shorter than half is kept whole and the
    response gets the rest; else both are cut in proportion to their lengths. The prompt gets what the response
    leaves. (The float expression is LLaMA-Factory's, so that the rounding matches too.)
    """
    if target_len * 2 < cutoff_len:
        max_target = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target = cutoff_len - source_len
    else:
        max_target = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target = min(max_target, target_len)
    return min(max(cutoff_len - new_target, 0), source_len), new_target


def split_system(messages: list[dict]) -> tuple[str, list[dict]]:
    """The system prompt (``""`` if none) and the user/assistant turns after it."""
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return "", messages


# ------------------------------------------------------------------------------------------- tokenizer's own

class TokenizerTemplate:
    """The tokenizer's own ``chat_template``, the same one a server applies to chat requests.

    Each assistant turn is located as the text that rendering ``messages[:i+1]`` adds to rendering
    ``messages[:i]`` with the generation prompt; templates that rewrite earlier turns are refused. Over-long
    examples are simply cut at ``cutoff_len``.
    """

    name = "tokenizer"

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("template: the tokenizer has no chat_template; set `template:` to a named template")

    @staticmethod
    def segments(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
        """(text, is_response) pieces whose concatenation is the rendered conversation."""
        def render(msgs, add_generation_prompt):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)

        segments, done = [], ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = render(messages[:i], add_generation_prompt=True)
            full = render(messages[: i + 1], add_generation_prompt=False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise DataError("template: the tokenizer's chat_template is not prefix-stable (it rewrites earlier "
                                "turns); set `template:` to a named template")
            segments += [(prompt[len(done):], False), (full[len(prompt):], True)]
            done = full
        return segments

    def encode(self, tokenizer, messages: list[dict], cutoff_len: int) -> tuple[list[int], list[int]]:
        input_ids, labels = [], []
        for text, is_response in self.segments(tokenizer, messages):
            ids = tokenizer.encode(text, add_special_tokens=False)
            input_ids += ids
            labels += ids if is_response else [IGNORE_INDEX] * len(ids)
        return input_ids[:cutoff_len], labels[:cutoff_len]


# ---------------------------------------------------------------------------------------- LLaMA-Factory's

@dataclass(frozen=True)
class ChatTemplate:
    """One LLaMA-Factory template, as data. Slots are strings (``{content}`` marks the text) or :class:`Token`.

    Turn 0's source is prefix + system (if any, else ``default_system``) + user; later sources are user alone.
    ``replace_eos``: the eos token becomes ``stop_words[0]`` (LLaMA-Factory rewrites the tokenizer; here it must
    already have that token). ``thought_words`` makes it a reasoning template: an assistant turn without a think
    block gets an empty one, labelled when ``enable_thinking`` and masked (appended to the prompt) when not; when
    not, existing think blocks are first removed from every assistant turn.
    """

    name: str
    user: tuple = (CONTENT,)
    assistant: tuple = (CONTENT, Token.EOS)
    system: tuple = (CONTENT,)
    prefix: tuple = ()
    default_system: str = ""
    stop_words: tuple[str, ...] = ()
    replace_eos: bool = False
    thought_words: tuple[str, str] | None = None
    enable_thinking: bool = True

    def check(self, tokenizer) -> None:
        """Refuse a tokenizer LLaMA-Factory would have had to grow: it adds missing stop words as new tokens."""
        added = tokenizer.get_added_vocab()
        for word in self.stop_words:
            if word not in added:
                raise DataError(f"template: {self.name} needs the token {word!r} (its "
                                f"{'eos' if self.replace_eos and word == self.stop_words[0] else 'stop'} token), "
                                f"which the tokenizer does not have")
        uses_eos = any(Token.EOS in slots for slots in (self.prefix, self.system, self.user, self.assistant))
        if uses_eos and self._eos_id(tokenizer) is None:
            raise DataError(f"template: {self.name} ends turns with the eos token, which the tokenizer does not have")

    def _eos_id(self, tokenizer) -> int | None:
        return tokenizer.convert_tokens_to_ids(self.stop_words[0]) if self.replace_eos else tokenizer.eos_token_id

    def _ids(self, tokenizer, slots: tuple, content: str = "") -> list[int]:
        ids = []
        for slot in slots:
            if isinstance(slot, Token):
                token_id = tokenizer.bos_token_id if slot is Token.BOS else self._eos_id(tokenizer)
                if token_id is not None:  # LLaMA-Factory drops a bos slot the tokenizer has no token for
                    ids.append(token_id)
            elif text := slot.replace(CONTENT, content, 1):
                ids += tokenizer.encode(text, add_special_tokens=False)
        return ids

    def _has_thought(self, text: str) -> bool:
        return any(word.strip() in text for word in self.thought_words)

    def _remove_thought(self, text: str) -> str:
        opening, closing = map(re.escape, self.thought_words)
        return re.sub(f"{opening}(.*?){closing}", "", text, flags=re.DOTALL).lstrip("\n")

    def encode_pairs(self, tokenizer, messages: list[dict]) -> list[tuple[list[int], list[int]]]:
        """(source, target) ids per user/assistant pair, before truncation."""
        system, turns = split_system(messages)
        system = system or self.default_system
        queries = [m["content"] for m in turns[0::2]]
        replies = [m["content"] for m in turns[1::2]]
        if self.thought_words and not self.enable_thinking:
            replies = [self._remove_thought(r) for r in replies]
        pairs = []
        for i, (query, reply) in enumerate(zip(queries, replies)):
            source = []
            if i == 0:  # the prefix and the system prompt only open the conversation
                source += self._ids(tokenizer, self.prefix)
                if system:
                    source += self._ids(tokenizer, self.system, system)
            source += self._ids(tokenizer, self.user, query)
            target = self._ids(tokenizer, self.assistant, reply)
            if self.thought_words and not self._has_thought(reply):
                # the empty thought is its own tokenizer call in LLaMA-Factory too
                thought = tokenizer.encode("".join(self.thought_words), add_special_tokens=False)
                source, target = (source, thought + target) if self.enable_thinking else (source + thought, target)
            pairs.append((source, target))
        return pairs

    def encode(self, tokenizer, messages: list[dict], cutoff_len: int) -> tuple[list[int], list[int]]:
        """LLaMA-Factory's supervised example: pairs in order, each cut by infer_seqlen to the budget left."""
        input_ids, labels = [], []
        for source, target in self.encode_pairs(tokenizer, messages):
            if len(input_ids) >= cutoff_len:
                break
            source_len, target_len = infer_seqlen(len(source), len(target), cutoff_len - len(input_ids))
            input_ids += source[:source_len] + target[:target_len]
            labels += [IGNORE_INDEX] * source_len + target[:target_len]
        return input_ids, labels


_THINK = ("<think>\n", "\n</think>\n\n")
_IM_USER = ("<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",)
_IM_ASSISTANT = ("{content}<|im_end|>\n",)
_IM_SYSTEM = ("<|im_start|>system\n{content}<|im_end|>\n",)
_DEEPSEEK3_USER = ("<｜User｜>{content}<｜Assistant｜>",)


def _qwen(name: str, **fields) -> ChatTemplate:
    return ChatTemplate(name, _IM_USER, _IM_ASSISTANT, _IM_SYSTEM, stop_words=("<|im_end|>",), replace_eos=True,
                        **fields)


NAMED_TEMPLATES = {
    t.name: t
    for t in (
        ChatTemplate("default", user=("Human: {content}", Token.EOS, "\nAssistant:"),
                     assistant=("{content}", Token.EOS, "\n"), system=("System: {content}", Token.EOS, "\n")),
        ChatTemplate("empty", assistant=(CONTENT,)),
        ChatTemplate("chatml", _IM_USER, _IM_ASSISTANT, _IM_SYSTEM, stop_words=("<|im_end|>", "<|im_start|>"),
                     replace_eos=True),
        _qwen("qwen", default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
        _qwen("qwen3", thought_words=_THINK),
        _qwen("qwen3_nothink"),
        _qwen("qwen3_5", thought_words=_THINK),
        _qwen("qwen3_5_nothink"),
        _qwen("qwen3_6", thought_words=_THINK),
        ChatTemplate("deepseek", user=("User: {content}\n\nAssistant:",), system=("{content}\n\n",),
                     prefix=(Token.BOS,)),
        ChatTemplate("deepseek3", user=_DEEPSEEK3_USER, prefix=(Token.BOS,)),
        ChatTemplate("deepseekr1", user=_DEEPSEEK3_USER, prefix=(Token.BOS,), thought_words=_THINK),
    )
}


def get_template(name: str, tokenizer, enable_thinking: bool = True):
    """The template the data pipeline encodes with: ``tokenizer`` or a named one, checked against the tokenizer."""
    if name == TokenizerTemplate.name:
        return TokenizerTemplate(tokenizer)
    if name not in NAMED_TEMPLATES:
        raise DataError(f"template: unknown template {name!r}; expected one of "
                        f"{', '.join([TokenizerTemplate.name, *NAMED_TEMPLATES])}")
    template = replace(NAMED_TEMPLATES[name], enable_thinking=enable_thinking)
    template.check(tokenizer)
    return template
