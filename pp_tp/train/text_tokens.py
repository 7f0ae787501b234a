"""Text -> token ids for `data.source = "text"`: byte-level (the default) or an HF tokenizer's tokenizer.json.

With `data.tokenizer = "DIR"`, DIR/tokenizer.json encodes the text through the `tokenizers` package, one
document at a time, with the tokenizer's EOS between documents when it has one. Documents are the file's
blank-line-separated paragraphs, or its lines when it has no blank line (the shipped corpus). The same
encoding serves the held-out text of `[validation]`: its own file, or the tail of the training text.
"""

from __future__ import annotations

import json
import os
import re

import torch

from pp_tp.config import JobConfig
from pp_tp.errors import ConfigError

_EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>")


def load_tokenizer(path: str):  # -> tokenizers.Tokenizer
    """DIR/tokenizer.json; one line when it is missing or unreadable."""
    from tokenizers import Tokenizer

    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        raise ConfigError(f"data.tokenizer = {path!r} has no tokenizer.json; give a Hugging Face tokenizer directory")
    try:
        return Tokenizer.from_file(file)
    except Exception as e:  # noqa: BLE001 - the tokenizers package raises its own Exception type
        raise ConfigError(f"data.tokenizer = {path!r}: tokenizer.json does not load ({e}); fix or replace it") from None


def fitting_tokenizer(path: str, vocab_size: int):  # -> tokenizers.Tokenizer
    """DIR/tokenizer.json, refused in one line when its vocabulary is larger than the model's."""
    tok = load_tokenizer(path)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > vocab_size:
        raise ConfigError(
            f"data.tokenizer = {path!r} has {n} tokens, more than model.vocab_size = {vocab_size}; "
            f"use a model with vocab_size >= {n} or a smaller tokenizer"
        )
    return tok


def eos_id(path: str, tok) -> int | None:
    """The EOS token: tokenizer_config.json's `eos_token` when present, else a usual EOS name in the vocab."""
    cfg_file = os.path.join(path, "tokenizer_config.json")
    names: list[str] = []
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            eos = json.load(f).get("eos_token")
        names.append(eos.get("content") if isinstance(eos, dict) else eos)
    for name in [n for n in names if n] + list(_EOS_NAMES):
        if (i := tok.token_to_id(name)) is not None:
            return i
    return None


def documents(text: str) -> list[str]:
    """Blank-line-separated paragraphs, or lines when there is no blank line."""
    parts = re.split(r"\n\s*\n", text) if re.search(r"\n\s*\n", text) else text.splitlines()
    return [p.strip() for p in parts if p.strip()]


def encode_file(path: str, tokenizer_dir: str, vocab_size: int) -> torch.Tensor:
    """The file's token ids (int64): bytes, or the tokenizer's ids with EOS after every document."""
    if not tokenizer_dir:
        with open(path, "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    tok = fitting_tokenizer(tokenizer_dir, vocab_size)
    with open(path, encoding="utf-8") as f:
        docs = documents(f.read())
    eos = eos_id(tokenizer_dir, tok)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids + ([eos] if eos is not None else [])
    return torch.tensor(ids, dtype=torch.long)


class TokenWindows:
    """Non-overlapping windows of `seq_len + 1` tokens (each shares its last token with the next)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, what: str):
        self.tokens, self.seq_len = tokens, seq_len
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ConfigError(
                f"{what} has {len(tokens)} tokens, fewer than training.seq_len + 1 = {seq_len + 1}; "
                "use a longer text or lower training.seq_len"
            )

    def sample(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


def _split(cfg: JobConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(training tokens, held-out tokens or None) of the training text under `validation.split`."""
    tokens = encode_file(cfg.data.path, cfg.data.tokenizer, cfg.model.vocab_size)
    split = cfg.validation.split if cfg.validation.every and not cfg.validation.path else 0.0
    if not split:
        return tokens, None
    cut = int(len(tokens) * (1 - split))
    return tokens[:cut], tokens[cut:]


def train_windows(cfg: JobConfig) -> TokenWindows:
    """The training text's windows (without the held-out tail when validation splits it off)."""
    return TokenWindows(_split(cfg)[0], cfg.training.seq_len, f"data.path = {cfg.data.path!r}")


def validation_windows(cfg: JobConfig) -> TokenWindows:
    """The held-out windows: validation.path encoded like the training text, or the training text's tail."""
    v = cfg.validation
    if v.path:
        tokens = encode_file(v.path, cfg.data.tokenizer, cfg.model.vocab_size)
        return TokenWindows(tokens, cfg.training.seq_len, f"validation.path = {v.path!r}")
    return TokenWindows(_split(cfg)[1], cfg.training.seq_len, f"validation.split = {v.split} of {cfg.data.path!r}")
