"""Training data: byte-level token windows from a text file or a generated corpus, shared out across DP ranks.

Tokens are the bytes of UTF-8 text (ids 0..255), so nothing is downloaded and any `model.vocab_size >= 256`
works. The global batch of step k is samples [k*B, (k+1)*B) of a per-epoch shuffled order (a function of
the seed and the epoch only); DP rank r takes its contiguous share. So no sample repeats within an epoch,
and the order does not depend on the layout: a run resumed at another DP degree sees the same global batches.
The only state is the number of samples consumed (`position`).

`synthetic` generates structured English (counting, sums, weekdays, months, facts, little scenes) from
(seed, sample index): a clear pattern a small model learns visibly, with no file at all. The shipped text
`pp_tp/data/patterns.txt` is that generator's first paragraphs for seed 0 (`python -m pp_tp.train.data PATH`).
"""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Protocol

import torch

from pp_tp.config import JobConfig
from pp_tp.errors import ConfigError
from pp_tp.train.fields import SyntheticFields
from pp_tp.train.text_tokens import train_windows

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


class Source(Protocol):
    """Samples of `seq_len + 1` tokens (or (input, target) pairs: train/fields.py) by index; `num_samples` None
    means endless (no epochs, no shuffle)."""

    num_samples: int | None

    def sample(self, index: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


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


def make_source(cfg: JobConfig) -> Source:
    """The job's data source; checks run here, before any process group exists."""
    if cfg.data.source == "fields":
        return SyntheticFields(cfg.training.seed, cfg.model.channels, cfg.model.image_size)
    if cfg.model.vocab_size < VOCAB and not cfg.data.tokenizer:
        raise ConfigError(
            f"model.vocab_size = {cfg.model.vocab_size}: data.source = {cfg.data.source!r} uses byte "
            f"tokens 0..255; set model.vocab_size >= {VOCAB}"
        )
    if cfg.data.tokenizer or (cfg.validation.every and cfg.validation.split):
        if cfg.data.source != "text":
            raise ConfigError(f'data.tokenizer encodes text: set data.source = "text" (it is {cfg.data.source!r})')
        return train_windows(cfg)  # tokenizer.json, or a held-out tail of the text
    if cfg.data.source == "text":
        return TextSource(cfg.data.path, cfg.training.seq_len)
    return SyntheticSource(cfg.training.seed, cfg.training.seq_len)


class ShardedBatches:
    """This DP rank's share of each global batch, in a deterministic, resumable order."""

    def __init__(self, source: Source, global_batch: int, dp_rank: int, dp_size: int, seed: int):
        if global_batch % dp_size:
            raise ConfigError(
                f"training.batch_size = {global_batch} does not split over {dp_size} DP ranks; "
                f"use a multiple of {dp_size}"
            )
        self.source, self.global_batch, self.seed = source, global_batch, seed
        self.local = global_batch // dp_size
        self.offset = dp_rank * self.local
        self.position = 0
        self._order: tuple[int, torch.Tensor] | None = None

    def _index(self, g: int) -> int:
        n = self.source.num_samples
        if n is None:
            return g
        epoch = g // n
        if self._order is None or self._order[0] != epoch:
            digest = hashlib.sha256(f"{self.seed}:{epoch}".encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
            self._order = (epoch, torch.randperm(n, generator=gen))
        return int(self._order[1][g % n])

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each [local_batch, seq_len]; labels are the next tokens. A source of (input, target)
        pairs gives them stacked."""
        start = self.position + self.offset
        samples = [self.source.sample(self._index(g)) for g in range(start, start + self.local)]
        self.position += self.global_batch
        if isinstance(samples[0], tuple):
            return torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])
        rows = torch.stack(samples)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


if __name__ == "__main__":  # writes the shipped corpus: python -m pp_tp.train.data pp_tp/data/patterns.txt
    with open(sys.argv[1], "w") as f:
        f.write(corpus_text(0, 200_000))
