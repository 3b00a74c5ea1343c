"""Synthetic long-context tasks in the style of RULER, generated locally from a seed.

Five tasks, each a prompt of an exact number of tokens (so that samples of one cell batch without
padding) and a set of expected answer items:

  niah_single      one needle "One of the special magic numbers for KEY is: 1234567." in a
                   repeated noise text; asked for KEY's number (1 item).
  niah_multikey    four needles with different keys; asked for one of them (1 item).
  niah_multivalue  four needles with the same key and different numbers; asked for all (4 items).
  vt               variable tracking: "VAR ABCDE = 12345." followed by a chain of 4 assignments
                   "VAR FGHIJ = VAR ABCDE." spread over the noise; asked for every variable that
                   holds the value (5 items).
  cwe              common-word extraction: a numbered list of words where 5 words recur and the
                   others appear once; asked for the 5 most common (5 items).

The prompt is built in token space: head (chat template start + instruction) + context + tail
(question + template end + answer prefix). The context is the noise text's token ids repeated and
cut to the exact length, with the needles' token ids inserted at sentence boundaries, so the
prompt has exactly the requested length whatever the tokenizer. A sample depends only on (task,
context length, index, seed) and the tokenizer: the same seed gives the same samples.
"""

import hashlib
import os
import random
import re
from dataclasses import dataclass, field
from typing import Callable, List, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
# RULER's noise haystack (niah, vt): one unit, repeated.
NOISE = (" The grass is green. The sky is blue. The sun is yellow. Here we go. There and back"
         " again.")
# Tokens a greedy answer may take before it is called truncated (never reached in practice: the
# answers are one line of at most five short items).
MAX_NEW_TOKENS = {"niah_single": 48, "niah_multikey": 48, "niah_multivalue": 96, "vt": 96,
                  "cwe": 96}

Encode = Callable[[str], List[int]]


@dataclass
class Sample:
    task: str
    context: int                 # prompt length in tokens (exact)
    index: int
    ids: List[int]               # the whole prompt
    answers: List[str]           # expected items (lowercase); order does not matter
    max_new_tokens: int
    meta: dict = field(default_factory=dict)


def _rng(task: str, context: int, index: int, seed: int) -> random.Random:
    digest = hashlib.sha256(f"{seed}/{task}/{context}/{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


_WORDS: List[str] = []


def word_pool() -> List[str]:
    """Distinct lowercase words (4-10 letters) of the texts in data/, in first-seen order."""
    if not _WORDS:
        seen = set()
        for name in sorted(os.listdir(DATA)):
            if not name.endswith(".txt"):
                continue
            with open(os.path.join(DATA, name), encoding="utf-8") as f:
                for w in re.findall(r"[A-Za-z]+", f.read()):
                    w = w.lower()
                    if 4 <= len(w) <= 10 and w not in seen:
                        seen.add(w)
                        _WORDS.append(w)
    return _WORDS


def _key(rng: random.Random, taken: set) -> str:
    pool = word_pool()
    while True:
        key = f"{rng.choice(pool)}-{rng.choice(pool)}"
        if key not in taken:
            taken.add(key)
            return key


def _number(rng: random.Random, taken: set) -> str:
    while True:
        n = str(rng.randint(1000000, 9999999))
        if n not in taken:
            taken.add(n)
            return n


def _varname(rng: random.Random, taken: set) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def _haystack(encode: Encode, length: int, needles: Sequence[List[int]],
              depths: Sequence[float]) -> List[int]:
    """`length` tokens of noise with the needles inserted at unit boundaries near `depths`."""
    unit = encode(NOISE)
    n_noise = length - sum(len(n) for n in needles)
    if n_noise < len(unit):
        raise ValueError(f"context of {length} tokens is too short for the needles")
    noise = (unit * (n_noise // len(unit) + 1))[:n_noise]
    units = n_noise // len(unit)
    cuts = [min(units, max(0, round(d * units))) * len(unit) for d in depths]
    order = sorted(range(len(needles)), key=lambda i: (cuts[i], i))
    out: List[int] = []
    prev = 0
    for i in order:
        out += noise[prev:cuts[i]] + needles[i]
        prev = cuts[i]
    out += noise[prev:]
    assert len(out) == length
    return out


def _assemble(encode: Encode, template: Tuple[str, str], instruction: str, question: str,
              answer_prefix: str, context: int, body: Callable[[int], List[int]]) -> List[int]:
    head = encode(template[0] + instruction)
    tail = encode(question) + encode(template[1] + answer_prefix)
    n = context - len(head) - len(tail)
    if n <= 0:
        raise ValueError(f"context of {context} tokens leaves no room for the haystack")
    ids = head + body(n) + tail
    assert len(ids) == context
    return ids


def _niah(encode, template, context, rng, n_keys: int, n_values: int, ask_all: bool):
    keys: set = set()
    numbers: set = set()
    key_list = [_key(rng, keys) for _ in range(n_keys)]
    needles_text: List[str] = []
    for k in key_list:
        for _ in range(n_values if k == key_list[0] else 1):
            needles_text.append((k, _number(rng, numbers)))
    target = key_list[0]
    answers = [v for k, v in needles_text if k == target]
    rng.shuffle(needles_text)
    needles = [encode(f" One of the special magic numbers for {k} is: {v}.")
               for k, v in needles_text]
    depths = [rng.random() for _ in needles]
    instruction = ("Some special magic numbers are hidden within the following text. Make sure "
                   "to memorize them. I will quiz you about the numbers afterwards.\n")
    if ask_all:
        question = (f"\nWhat are all the special magic numbers for {target} mentioned in the "
                    "provided text?")
        prefix = f"The special magic numbers for {target} mentioned in the provided text are"
    else:
        question = (f"\nWhat is the special magic number for {target} mentioned in the provided "
                    "text?")
        prefix = f"The special magic number for {target} mentioned in the provided text is"
    ids = _assemble(encode, template, instruction, question, prefix, context,
                    lambda n: _haystack(encode, n, needles, depths))
    return ids, answers, {"key": target, "depths": [round(d, 3) for d in depths]}


def _vt(encode, template, context, rng, hops: int = 4):
    names: set = set()
    chain = [_varname(rng, names) for _ in range(hops + 1)]
    value = str(rng.randint(10000, 99999))
    statements = [f" VAR {chain[0]} = {value}."] + [
        f" VAR {chain[i]} = VAR {chain[i - 1]}." for i in range(1, hops + 1)]
    needles = [encode(s) for s in statements]
    depths = sorted(rng.random() for _ in needles)  # assignments in chain order
    instruction = ("Memorize and track the chain(s) of variable assignment hidden in the "
                   "following text.\n")
    question = f"\nFind all variables that are assigned the value {value} in the text above."
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, "
              f"{hops + 1} variables are assigned the value {value}, they are:")
    ids = _assemble(encode, template, instruction, question, prefix, context,
                    lambda n: _haystack(encode, n, needles, depths))
    return ids, [c.lower() for c in chain], {"value": value}


def _cwe(encode, template, context, rng, n_common: int = 5):
    pool = list(word_pool())
    rng.shuffle(pool)
    common, rare = pool[:n_common], pool[n_common:]
    instruction = ("Below is a numbered list of words. In these words, some appear more often "
                   "than others. Memorize the ones that appear most often.\n")
    question = (f"\nQuestion: What are the {n_common} most common words in the above list?")
    prefix = f"Answer: The top {n_common} words that appear most often in the list are:"

    def body(n: int) -> List[int]:
        # About 5 tokens an entry; half of the entries are the common words (each about
        # entries / (2 * n_common) times, at least 3), the rest distinct rare words.
        entries = max(2 * n_common, n // 5)
        reps = max(3, entries // (2 * n_common))
        words = common * reps
        words += rare[:max(0, entries - len(words))]
        rng.shuffle(words)
        out: List[int] = []
        for i, w in enumerate(words, 1):
            piece = encode(f" {i}. {w}")
            if len(out) + len(piece) > n:
                break
            out += piece
        # Pad the remainder with a rare word's tokens cut short (never a common one).
        filler = encode(" " + rare[-1])
        while len(out) < n:
            out += filler[:n - len(out)]
        return out

    ids = _assemble(encode, template, instruction, question, prefix, context, body)
    return ids, list(common), {}


def make_sample(task: str, context: int, index: int, seed: int, encode: Encode,
                template: Tuple[str, str]) -> Sample:
    """One sample: `template` is the chat template's text before and after the user message
    (the answer prefix follows the second part)."""
    rng = _rng(task, context, index, seed)
    if task == "niah_single":
        ids, answers, meta = _niah(encode, template, context, rng, 1, 1, False)
    elif task == "niah_multikey":
        ids, answers, meta = _niah(encode, template, context, rng, 4, 1, False)
    elif task == "niah_multivalue":
        ids, answers, meta = _niah(encode, template, context, rng, 1, 4, True)
    elif task == "vt":
        ids, answers, meta = _vt(encode, template, context, rng)
    elif task == "cwe":
        ids, answers, meta = _cwe(encode, template, context, rng)
    else:
        raise ValueError(f"unknown task {task!r}; one of {TASKS}")
    return Sample(task, context, index, ids, [a.lower() for a in answers],
                  MAX_NEW_TOKENS[task], meta)


def make_samples(task: str, context: int, n: int, seed: int, encode: Encode,
                 template: Tuple[str, str]) -> List[Sample]:
    return [make_sample(task, context, i, seed, encode, template) for i in range(n)]
