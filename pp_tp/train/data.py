"""Byte-level training data: token windows of a text file or of a generated corpus (`loader.ShardedBatches`
shares them out over DP ranks).

Tokens are the bytes of UTF-8 text (ids 0..255), so nothing is downloaded and any `model.vocab_size >= 256`
works.

`synthetic` generates structured English (counting, sums, weekdays, months, facts, little scenes) from
(seed, sample index): a clear pattern a small model learns visibly, with no file at all. The shipped text
`pp_tp/data/patterns.txt` is that generator's first paragraphs for seed 0 (`python -m pp_tp.train.data PATH`).
"""

from __future__ import annotations

import random
import sys

import torch

from pp_tp.errors import ConfigError

VOCAB = 256  # byte-level tokens

_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty"
).split()
_DAYS = "monday tuesday wednesday thursday friday saturday sunday".split()
_MONTHS = "january february march april may june july august september october november december".split()
_ANIMALS = "cat dog fox owl hen cow horse mouse bird frog".split()
_ADJECTIVES = "red small big old young quick lazy happy sleepy brown".split()
_VERBS = "sat slept ran hid waited played jumped rested".split()
_PREPOSITIONS = "on under near behind beside in".split()
_PLACES = "mat tree hill barn river house fence bridge garden field".split()
_FACTS = (
    "grass is green",
    "the sky is blue",
    "snow is white",
    "coal is black",
    "the sun is yellow",
    "milk is white",
    "a lemon is sour",
    "sugar is sweet",
    "ice is cold",
    "fire is hot",
)
_OPPOSITES = (
    ("hot", "cold"),
    ("up", "down"),
    ("big", "small"),
    ("day", "night"),
    ("fast", "slow"),
    ("old", "new"),
    ("open", "shut"),
    ("wet", "dry"),
    ("left", "right"),
    ("near", "far"),
)


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        start = rng.randrange(0, 15)
        return "I count " + ", ".join(_NUMBERS[start : start + rng.randrange(3, 7)])
    if kind == 1:
        a, b = rng.randrange(10), rng.randrange(10)
        return f"{_NUMBERS[a]} plus {_NUMBERS[b]} makes {_NUMBERS[a + b]}"
    if kind == 2:
        d = rng.randrange(7)
        return f"after {_DAYS[d]} comes {_DAYS[(d + 1) % 7]}"
    if kind == 3:
        m = rng.randrange(11)
        return f"{_MONTHS[m]} comes before {_MONTHS[m + 1]}"
    if kind == 4:
        return rng.choice(_FACTS)
    if kind == 5:
        a, b = rng.choice(_OPPOSITES)
        return f"the opposite of {a} is {b}"
    if kind == 6:
        animal = rng.choice(_ANIMALS)
        plural = "mice" if animal == "mouse" else animal + "s"
        return f"one {animal}, two {plural}, three {plural}"
    return (
        f"the {rng.choice(_ADJECTIVES)} {rng.choice(_ANIMALS)} {rng.choice(_VERBS)} "
        f"{rng.choice(_PREPOSITIONS)} the {rng.choice(_PLACES)}"
    )


def paragraph(seed: int, index: int) -> str:
    """Paragraph `index` of the generated corpus: 4 to 8 sentences and a newline, a function of (seed, index)."""
    rng = random.Random(f"{seed}:{index}")
    return " ".join(s[0].upper() + s[1:] + "." for s in (_sentence(rng) for _ in range(rng.randrange(4, 9)))) + "\n"


def corpus_text(seed: int, n_bytes: int) -> str:
    """The first whole paragraphs of the generated corpus, at most `n_bytes` long."""
    out, size, i = [], 0, 0
    while size + len(p := paragraph(seed, i)) <= n_bytes:
        out.append(p)
        size += len(p)
        i += 1
    return "".join(out)


class TextSource:
    """Non-overlapping windows of a file's bytes (each overlaps the next by the one label byte)."""

    def __init__(self, path: str, seq_len: int):
        with open(path, "rb") as f:
            self.tokens = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        self.seq_len = seq_len
        self.num_samples = (len(self.tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ConfigError(
                f"data.path = {path!r} has {len(self.tokens)} bytes, fewer than training.seq_len + 1 = "
                f"{seq_len + 1}; use a longer file or lower training.seq_len"
            )

    def sample(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1].long()


class SyntheticSource:
    """Endless generated English: sample i is the start of paragraphs (seed, i), (seed, i)+1, ..."""

    num_samples = None

    def __init__(self, seed: int, seq_len: int):
        self.seed, self.seq_len = seed, seq_len

    def sample(self, index: int) -> torch.Tensor:
        text, k = "", 0
        while len(text) <= self.seq_len:
            text += paragraph(self.seed, index * 1_000_003 + k)
            k += 1
        return torch.tensor(list(text.encode()[: self.seq_len + 1]), dtype=torch.long)


if __name__ == "__main__":  # writes the shipped corpus: python -m pp_tp.train.data pp_tp/data/patterns.txt
    with open(sys.argv[1], "w") as f:
        f.write(corpus_text(0, 200_000))
