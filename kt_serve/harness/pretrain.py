"""Briefly pre-train the quickstart's tiny base MoE so that it answers plainly (no pirate talk).

A random model answers with noise, which would make "base vs adapter" meaningless. This trains every parameter of
``build_tiny_moe``'s model (plain torch, CPU, fixed seed) on text shipped in the repo: the language-model corpus
``data/tiny_corpus.txt`` and short plain-style questions and answers built from the fact table below. The table
covers the facts of the pirate example dataset *and* of the held-out quickstart eval, so the base model "knows"
them and only the style is left for the adapter to learn ("Berlin is the capital of Germany." vs
"Arr, matey! Berlin be the capital of Germany. Yo ho ho!").

The result is cached: a directory whose ``kt_pretrain.json`` records the same recipe is reused as is.

    python -m kt_serve.harness.pretrain OUT_DIR [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kt_serve.harness.tiny_model import CORPUS, build_tiny_moe

RECIPE_FILE = "kt_pretrain.json"

# Facts, in the shapes of the shipped example dataset's questions; plain answers.
CAPITALS = {
    "Austria": "Vienna", "Canada": "Ottawa", "Chile": "Santiago", "Cuba": "Havana", "Egypt": "Cairo",
    "France": "Paris", "Greece": "Athens", "Ireland": "Dublin", "Italy": "Rome", "Japan": "Tokyo",
    "Kenya": "Nairobi", "Norway": "Oslo", "Peru": "Lima", "Poland": "Warsaw", "Portugal": "Lisbon",
    "Spain": "Madrid", "Germany": "Berlin", "Sweden": "Stockholm", "Finland": "Helsinki", "Russia": "Moscow",
    "China": "Beijing", "Denmark": "Copenhagen", "Turkey": "Ankara", "Hungary": "Budapest",
}
OPPOSITES = {
    "big": "small", "early": "late", "fast": "slow", "full": "empty", "happy": "sad", "hot": "cold",
    "light": "dark", "old": "new", "open": "closed", "strong": "weak", "up": "down", "wet": "dry",
    "soft": "hard", "tall": "short", "rich": "poor", "clean": "dirty", "loud": "quiet", "thick": "thin",
}
COLOURS = {
    "a lemon": "yellow", "a plum": "purple", "a ripe tomato": "red", "an orange": "orange", "coal": "black",
    "grass": "green", "snow": "white", "the sky": "blue", "a banana": "yellow", "milk": "white",
    "a strawberry": "red", "a crow": "black",
}
SOUNDS = {
    "cat": "meow", "cow": "moo", "dog": "woof", "duck": "quack", "frog": "ribbit", "lion": "roar", "owl": "hoot",
    "sheep": "baa", "horse": "neigh", "pig": "oink", "bee": "buzz", "snake": "hiss",
}


# Every answer also appears after an interjection and before a sign-off, so the base model learns that the facts
# follow whatever opens an answer: the adapter then only has to learn its own opening and closing words.
INTERJECTIONS = ("Sure!", "Well,", "Okay!", "Hello!", "Good question!")
SIGN_OFFS = ("Hope that helps!", "Have a nice day!", "Bye!")


def plain_qa() -> list[tuple[str, str]]:
    """(question, plain answer) pairs over the fact table, each also with an interjection and with a sign-off;
    deterministic order."""
    return [(q, form) for i, (q, a) in enumerate(_facts_qa())
            for form in (a, f"{INTERJECTIONS[i % len(INTERJECTIONS)]} {a}", f"{a} {SIGN_OFFS[i % len(SIGN_OFFS)]}")]


def _facts_qa() -> list[tuple[str, str]]:
    qa = []
    for country, city in CAPITALS.items():
        qa += [(f"What is the capital of {country}?", f"The capital of {country} is {city}."),
               (f"Name the capital city of {country}.", f"{city} is the capital of {country}.")]
    for word, opposite in OPPOSITES.items():
        qa += [(f"What is the opposite of {word}?", f"The opposite of {word} is {opposite}."),
               (f"Give me the opposite of the word '{word}'.", f"That is {opposite}.")]
    for thing, colour in COLOURS.items():
        qa.append((f"What color is {thing}?", f"{thing[0].upper() + thing[1:]} is {colour}."))
    for animal, sound in SOUNDS.items():
        qa += [(f"What sound does a {animal} make?", f"A {animal} says {sound}."),
               (f"How does a {animal} sound?", f"It goes {sound}, like any {animal}.")]
    for a in range(1, 13):
        for b in range(1, 13):
            qa.append((f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."))
    for n in range(2, 9):
        qa.append((f"Count from 1 to {n}.", " ".join(str(i) for i in range(1, n + 1)) + "."))
    return qa


@dataclass(frozen=True)
class PretrainRecipe:
    """Everything that determines the pre-trained weights (recorded in RECIPE_FILE; a match means a cache hit)."""

    family: str = "qwen3_moe"
    hidden_size: int = 128
    moe_intermediate_size: int = 64
    num_experts: int = 8
    top_k: int = 2
    num_layers: int = 2
    steps: int = 300
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    corpus_window: int = 64  # tokens per language-model chunk of the corpus
    seed: int = 0
    version: int = 1  # bump when the data or the loop changes


def _training_examples(tokenizer, recipe: PretrainRecipe):
    """Chat examples (loss on the answer and its end-of-turn marker) plus corpus chunks (loss everywhere)."""
    from kt_serve.train.data import Example, TokenizerTemplate, encode_example

    template = TokenizerTemplate(tokenizer)  # the chat template the server and the adapter trainer use
    examples = [encode_example([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                               template, tokenizer, cutoff_len=256) for q, a in plain_qa()]
    ids = tokenizer.encode(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False)
    w = recipe.corpus_window
    examples += [Example(ids[i:i + w], ids[i:i + w]) for i in range(0, len(ids) - w // 2, w)]
    return examples


def _recipe_matches(out_dir: Path, recipe: PretrainRecipe) -> bool:
    try:
        return json.loads((out_dir / RECIPE_FILE).read_text())["recipe"] == asdict(recipe)
    except (OSError, ValueError, KeyError):
        return False


def pretrain_base(out_dir, recipe: PretrainRecipe = PretrainRecipe(), *, threads: int = 1, log=print) -> Path:
    """Write (or reuse) the pre-trained tiny base model in ``out_dir``: bf16 safetensors + offline tokenizer.

    threads: torch threads while training (restored after; 0 keeps torch's default). One is as fast for a model this small and, unlike
    more, does not slow down many times over when other processes compete for the cores."""
    out_dir = Path(out_dir).absolute()
    if _recipe_matches(out_dir, recipe):
        log(f"reusing the pre-trained base model in {out_dir} (same recipe)")
        return out_dir

    import torch
    from transformers.utils import logging as hf_logging

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    saved_threads, bars = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    if threads:
        torch.set_num_threads(threads)
    hf_logging.disable_progress_bar()  # "Loading weights" bars would drown the step lines
    try:
        _train(tmp, out_dir, recipe, log)
    finally:
        torch.set_num_threads(saved_threads)
        if bars:
            hf_logging.enable_progress_bar()
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _train(tmp: Path, out_dir: Path, recipe: PretrainRecipe, log) -> None:
    """Train in ``tmp`` and move the finished model to ``out_dir``."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

    from kt_serve.train.data import IGNORE_INDEX, BatchPlan, SFTDataset

    init = build_tiny_moe(tmp / "init", recipe.family, hidden_size=recipe.hidden_size,
                          moe_intermediate_size=recipe.moe_intermediate_size, num_experts=recipe.num_experts,
                          top_k=recipe.top_k, num_layers=recipe.num_layers, seed=recipe.seed)
    tokenizer = AutoTokenizer.from_pretrained(init)
    data = SFTDataset(_training_examples(tokenizer, recipe), tokenizer.pad_token_id)
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=recipe.warmup_steps,
                              num_training_steps=recipe.steps)
    plan = BatchPlan(len(data), recipe.batch_size, 1, recipe.seed)
    log(f"pre-training the base model: {len(data)} examples, {recipe.steps} steps of {recipe.batch_size}")
    start, every = time.monotonic(), max(1, recipe.steps // 5)
    for step, _, groups in plan.steps():
        if step >= recipe.steps:
            break
        batch = data.collate(groups[0])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                               ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % every == 0 or step + 1 == recipe.steps:
            log(f"pre-train step {step + 1}/{recipe.steps}  loss {loss.item():.3f}  "
                f"({time.monotonic() - start:.0f} s)")

    final = tmp / "model"
    _save_like(init, model.to(torch.bfloat16), final)
    tokenizer.save_pretrained(final)
    (final / RECIPE_FILE).write_text(json.dumps({"recipe": asdict(recipe), "final_loss": loss.item()},
                                                indent=2) + "\n")
    final.chmod(0o755)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(final, out_dir)


def _save_like(init: Path, model, out: Path) -> None:
    """Save the trained model in the layout of ``init``: a Qwen3.5 checkpoint is the official
    ForConditionalGeneration (text weights under model.language_model., its processor files), which is what
    SGLang serves; AutoModelForCausalLM trained its text model only."""
    config = json.loads((init / "config.json").read_text())
    if "text_config" not in config:
        model.save_pretrained(out)
        return
    import torch
    from transformers import AutoConfig, Qwen3_5MoeForConditionalGeneration

    full = Qwen3_5MoeForConditionalGeneration(AutoConfig.from_pretrained(init)).to(torch.bfloat16)
    full.model.language_model.load_state_dict(model.model.state_dict())
    full.lm_head.load_state_dict(model.lm_head.state_dict())
    full.save_pretrained(out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")  # init's, as written (text_config fields)
    for f in init.iterdir():  # processor / tokenizer files SGLang opens for a VLM checkpoint
        if f.is_file() and f.suffix in (".json", ".jinja") and f.name not in ("config.json", "model.safetensors.index.json") \
                and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=PretrainRecipe.steps)
    a = p.parse_args(argv)
    print(pretrain_base(a.out_dir, PretrainRecipe(steps=a.steps)))


if __name__ == "__main__":
    main()
