"""Named chat templates against LLaMA-Factory's token layout, written out by hand.

Every expected sequence below is a list of (text, labelled) pieces typed from LLaMA-Factory's template
definitions; each piece is tokenised on its own, as LLaMA-Factory tokenises each slot on its own. Nothing is
derived from the code under test.
"""

import json
from types import SimpleNamespace

import pytest

from kt_serve.train.data import IGNORE_INDEX, DataError, SFTDataset, encode_example
from kt_serve.train.templates import get_template, infer_seqlen

DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def chatml_tokenizer():
    from kt_serve.harness.tiny_model import build_tokenizer

    return build_tokenizer(1000)  # <|endoftext|> = bos = pad, <|im_end|> = eos


@pytest.fixture(scope="module")
def deepseek_tokenizer():
    from kt_serve.harness.tiny_model import build_tokenizer

    tok = build_tokenizer(1000)  # given DeepSeek's special tokens, as a real DeepSeek tokenizer has them
    tok.add_special_tokens({"bos_token": DS_BOS, "eos_token": DS_EOS,
                            "additional_special_tokens": ["<｜User｜>", "<｜Assistant｜>"]})
    return tok


def tokenizer_for(name, request):
    return request.getfixturevalue("deepseek_tokenizer" if name.startswith("deepseek") else "chatml_tokenizer")


def conversation(system):
    head = [{"role": "system", "content": system}] if system is not None else []
    return head + [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Arr, hello."},
                   {"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "It be 4."}]


def expected(tokenizer, pieces):
    input_ids, labels = [], []
    for text, labelled in pieces:
        ids = tokenizer.encode(text, add_special_tokens=False)
        input_ids += ids
        labels += ids if labelled else [IGNORE_INDEX] * len(ids)
    return input_ids, labels


M, L = False, True  # masked / labelled
THOUGHT = "<think>\n\n</think>\n\n"
IM_SYSTEM = "<|im_start|>system\nBe brief.<|im_end|>\n"
QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
IM_TURNS = [("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", M), ("Arr, hello.<|im_end|>\n", L),
            ("<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n", M), ("It be 4.<|im_end|>\n", L)]
IM_TURNS_THINKING = [IM_TURNS[0], (THOUGHT, L), IM_TURNS[1], IM_TURNS[2], (THOUGHT, L), IM_TURNS[3]]
IM_TURNS_NOT_THINKING = [IM_TURNS[0], (THOUGHT, M), IM_TURNS[1], IM_TURNS[2], (THOUGHT, M), IM_TURNS[3]]
DS3_TURNS = [("<｜User｜>Hi there<｜Assistant｜>", M), ("Arr, hello.", L), (DS_EOS, L),
             ("<｜User｜>What is 2 plus 2?<｜Assistant｜>", M), ("It be 4.", L), (DS_EOS, L)]

# template -> (layout with the system prompt "Be brief.", layout without a system prompt), enable_thinking on
LAYOUTS = {
    "chatml": ([(IM_SYSTEM, M), *IM_TURNS], IM_TURNS),
    "qwen": ([(IM_SYSTEM, M), *IM_TURNS], [(QWEN_SYSTEM, M), *IM_TURNS]),  # qwen has a default system prompt
    "qwen3_nothink": ([(IM_SYSTEM, M), *IM_TURNS], IM_TURNS),
    "qwen3_5_nothink": ([(IM_SYSTEM, M), *IM_TURNS], IM_TURNS),
    "qwen3": ([(IM_SYSTEM, M), *IM_TURNS_THINKING], IM_TURNS_THINKING),
    "qwen3_5": ([(IM_SYSTEM, M), *IM_TURNS_THINKING], IM_TURNS_THINKING),
    "qwen3_6": ([(IM_SYSTEM, M), *IM_TURNS_THINKING], IM_TURNS_THINKING),
    "deepseek": (
        [(DS_BOS, M), ("Be brief.\n\n", M), ("User: Hi there\n\nAssistant:", M), ("Arr, hello.", L), (DS_EOS, L),
         ("User: What is 2 plus 2?\n\nAssistant:", M), ("It be 4.", L), (DS_EOS, L)],
        [(DS_BOS, M), ("User: Hi there\n\nAssistant:", M), ("Arr, hello.", L), (DS_EOS, L),
         ("User: What is 2 plus 2?\n\nAssistant:", M), ("It be 4.", L), (DS_EOS, L)]),
    "deepseek3": ([(DS_BOS, M), ("Be brief.", M), *DS3_TURNS], [(DS_BOS, M), *DS3_TURNS]),
    "deepseekr1": (
        [(DS_BOS, M), ("Be brief.", M), DS3_TURNS[0], (THOUGHT, L), *DS3_TURNS[1:4], (THOUGHT, L), *DS3_TURNS[4:]],
        [(DS_BOS, M), DS3_TURNS[0], (THOUGHT, L), *DS3_TURNS[1:4], (THOUGHT, L), *DS3_TURNS[4:]]),
    "default": (
        [("System: Be brief.", M), ("<|im_end|>", M), ("\n", M), ("Human: Hi there", M), ("<|im_end|>", M),
         ("\nAssistant:", M), ("Arr, hello.", L), ("<|im_end|>", L), ("\n", L),
         ("Human: What is 2 plus 2?", M), ("<|im_end|>", M), ("\nAssistant:", M), ("It be 4.", L),
         ("<|im_end|>", L), ("\n", L)],
        [("Human: Hi there", M), ("<|im_end|>", M), ("\nAssistant:", M), ("Arr, hello.", L), ("<|im_end|>", L),
         ("\n", L), ("Human: What is 2 plus 2?", M), ("<|im_end|>", M), ("\nAssistant:", M), ("It be 4.", L),
         ("<|im_end|>", L), ("\n", L)]),
    "empty": ([("Be brief.", M), ("Hi there", M), ("Arr, hello.", L), ("What is 2 plus 2?", M), ("It be 4.", L)],
              [("Hi there", M), ("Arr, hello.", L), ("What is 2 plus 2?", M), ("It be 4.", L)]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("with_system", [True, False])
def test_template_layout(name, with_system, request):
    tok = tokenizer_for(name, request)
    layout = LAYOUTS[name][0 if with_system else 1]
    example = encode_example(conversation("Be brief." if with_system else None), get_template(name, tok), tok, 4096)
    assert (example.input_ids, example.labels) == expected(tok, layout)
    # an empty system prompt counts as none, so the default system prompt applies
    if not with_system:
        empty = encode_example(conversation(""), get_template(name, tok), tok, 4096)
        assert (empty.input_ids, empty.labels) == expected(tok, layout)


def test_special_slots_are_the_tokenizers_ids(deepseek_tokenizer, chatml_tokenizer):
    ds = encode_example(conversation(None), get_template("deepseek3", deepseek_tokenizer), deepseek_tokenizer, 4096)
    assert ds.input_ids[0] == deepseek_tokenizer.bos_token_id
    assert ds.labels.count(deepseek_tokenizer.eos_token_id) == 2
    default = encode_example(conversation(None), get_template("default", chatml_tokenizer), chatml_tokenizer, 4096)
    assert default.input_ids.count(2) == 4  # <|im_end|>, the tiny tokenizer's eos, after each turn


# ------------------------------------------------------------------------------------------- reasoning

def reasoning_example(reply, enable_thinking, tok):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": reply}]
    return encode_example(messages, get_template("qwen3", tok, enable_thinking=enable_thinking), tok, 4096)


PROMPT = ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", M)


@pytest.mark.parametrize("reply, enable_thinking, layout", [
    # no think block: an empty one is trained with thinking on, and is part of the prompt with thinking off
    ("Arr.", True, [PROMPT, (THOUGHT, L), ("Arr.<|im_end|>\n", L)]),
    ("Arr.", False, [PROMPT, (THOUGHT, M), ("Arr.<|im_end|>\n", L)]),
    # a think block is trained as written with thinking on; with thinking off it is removed (leading newlines too)
    ("<think>\nhmm\n</think>\n\nArr.", True, [PROMPT, ("<think>\nhmm\n</think>\n\nArr.<|im_end|>\n", L)]),
    ("<think>\nhmm\n</think>\n\n\nArr.", False, [PROMPT, (THOUGHT, M), ("Arr.<|im_end|>\n", L)]),
    # either tag alone counts as a think block: nothing added, and off cannot remove it (no full block)
    ("hmm</think>Arr.", True, [PROMPT, ("hmm</think>Arr.<|im_end|>\n", L)]),
    ("hmm</think>Arr.", False, [PROMPT, ("hmm</think>Arr.<|im_end|>\n", L)]),
])
def test_reasoning_empty_thought(chatml_tokenizer, reply, enable_thinking, layout):
    example = reasoning_example(reply, enable_thinking, chatml_tokenizer)
    assert (example.input_ids, example.labels) == expected(chatml_tokenizer, layout)


def test_nothink_template_ignores_enable_thinking(chatml_tokenizer):
    messages = conversation(None)
    on, off = (encode_example(messages, get_template("qwen3_nothink", chatml_tokenizer, t), chatml_tokenizer, 4096)
               for t in (True, False))
    assert on == off == encode_example(messages, get_template("chatml", chatml_tokenizer), chatml_tokenizer, 4096)


# ------------------------------------------------------------------------------------------- truncation

@pytest.mark.parametrize("lengths, cut", [
    ((10, 3, 20), (10, 3)),   # short response: kept whole, the prompt takes the rest
    ((3, 30, 20), (3, 17)),   # short prompt: kept whole, the response takes the rest
    ((30, 10, 20), (15, 5)),  # both long: cut in proportion, 20 * 10/40 = 5
    ((14, 30, 22), (8, 14)),  # 22 * (30/44) is 14.999... in floats: LLaMA-Factory keeps 14, not 15
    ((5, 5, 0), (0, 0)),
])
def test_infer_seqlen(lengths, cut):
    assert infer_seqlen(*lengths) == cut


def test_cutoff_len_is_shared_per_turn(chatml_tokenizer):
    # the `empty` template adds no text, and these special tokens are one id each: prompt and response lengths
    # are exactly the repeat counts (<|im_start|> = 1, <|im_end|> = 2, <|endoftext|> = 0)
    messages = [{"role": "user", "content": "<|im_start|>" * 10}, {"role": "assistant", "content": "<|im_end|>" * 3},
                {"role": "user", "content": "<|endoftext|>" * 4}, {"role": "assistant", "content": "<|im_end|>" * 30}]
    template = get_template("empty", chatml_tokenizer)
    # cutoff 20: turn 1 (10, 3) fits; turn 2 gets 7 tokens: infer_seqlen(4, 30, 7) = (1, 6)
    example = encode_example(messages, template, chatml_tokenizer, 20)
    assert example.input_ids == [1] * 10 + [2] * 3 + [0] + [2] * 6
    assert example.labels == [IGNORE_INDEX] * 10 + [2] * 3 + [IGNORE_INDEX] + [2] * 6
    # cutoff 13: turn 1 uses it all; turn 2 is dropped whole
    assert encode_example(messages, template, chatml_tokenizer, 13).input_ids == [1] * 10 + [2] * 3
    # cutoff 8: infer_seqlen(10, 3, 8) = (5, 3): the prompt loses its end, the response is kept
    example = encode_example(messages, template, chatml_tokenizer, 8)
    assert example.input_ids == [1] * 5 + [2] * 3 and example.labels == [IGNORE_INDEX] * 5 + [2] * 3


# ------------------------------------------------------------------------------------------- errors, wiring

def test_unknown_template_names_the_field_and_the_choices(chatml_tokenizer):
    with pytest.raises(DataError) as err:
        get_template("llama3", chatml_tokenizer)
    message = str(err.value)
    assert message.startswith("template: unknown template 'llama3'") and "\n" not in message
    for name in ("tokenizer", "qwen", "qwen3", "qwen3_5", "chatml", "deepseek", "deepseek3", "default", "empty"):
        assert f" {name}," in message + ","


def bare_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "x": 1}, "[UNK]")),
                                   unk_token="[UNK]")


@pytest.mark.parametrize("name, message", [
    ("qwen3", "template: qwen3 needs the token '<|im_end|>' (its eos token)"),
    ("chatml", "template: chatml needs the token '<|im_end|>'"),
    ("default", "template: default ends turns with the eos token"),
])
def test_tokenizer_must_have_the_templates_tokens(name, message):
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        get_template(name, bare_tokenizer())


def test_dataset_build_reads_enable_thinking(tmp_path, chatml_tokenizer):
    (tmp_path / "d.json").write_text(json.dumps([{"instruction": "Hi", "output": "Arr."}]))
    (tmp_path / "dataset_info.json").write_text(json.dumps({"d": {"file_name": "d.json"}}))
    cfg = SimpleNamespace(template="qwen3", dataset_dir=str(tmp_path), dataset_names=["d"], max_samples=None,
                          cutoff_len=64)
    thinking = SFTDataset.build(cfg, chatml_tokenizer).examples[0]  # no enable_thinking field: on, as in LLaMA-Factory
    not_thinking = SFTDataset.build(SimpleNamespace(**vars(cfg), enable_thinking=False), chatml_tokenizer).examples[0]
    assert (thinking.input_ids, thinking.labels) == expected(
        chatml_tokenizer, [PROMPT, (THOUGHT, L), ("Arr.<|im_end|>\n", L)])
    assert (not_thinking.input_ids, not_thinking.labels) == expected(
        chatml_tokenizer, [PROMPT, (THOUGHT, M), ("Arr.<|im_end|>\n", L)])
