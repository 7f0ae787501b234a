"""Trains the demo's small byte-level BPE tokenizer on the shipped text and writes an HF tokenizer directory.

    python tools/train_tokenizer.py pp_tp/data/patterns.txt toml_configs/hf_tiny --vocab-size 512

Writes tokenizer.json (the `tokenizers` package's format) and tokenizer_config.json (so transformers'
AutoTokenizer loads it too). Deterministic: the same text and vocab size give the same file.
"""

from __future__ import annotations

import argparse
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"


def train(text_path: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer with one special token, EOS, trained on the lines of `text_path`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with open(text_path, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("text")
    parser.add_argument("out_dir")
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    train(args.text, args.vocab_size).save(os.path.join(args.out_dir, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS, "unk_token": EOS}
    with open(os.path.join(args.out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
