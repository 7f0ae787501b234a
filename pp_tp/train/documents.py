"""`data.source = "dataset"`: documents of local jsonl / parquet / arrow files or a saved `datasets` directory,
tokenized one at a time when a stream reaches them.

The files open through the `datasets` package as a memory-mapped Arrow table (jsonl and parquet are converted
once into its cache, which the first opener writes and every later one reuses: `pp-tp check` before the ranks
start), so a rank pages in only the documents its rows read and holds none of the corpus itself.
"""

from __future__ import annotations

import logging
import os

from pp_tp.errors import ConfigError
from pp_tp.train.text_tokens import eos_id, fitting_tokenizer

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def _empty(what: str) -> ConfigError:
    return ConfigError(f"{what} holds no documents; give files with at least one row")


def _open_table(files: list[str], what: str):  # -> datasets.Dataset
    import datasets

    datasets.disable_progress_bars()
    logging.getLogger("datasets").setLevel(logging.ERROR)
    if len(files) == 1 and os.path.isdir(files[0]):
        try:
            table = datasets.load_from_disk(files[0])
        except FileNotFoundError:
            raise ConfigError(
                f"{what} = {files[0]!r} is a directory but not a saved `datasets` dataset; point data.path at its "
                "files (a glob such as DIR/*.parquet) or at a directory written by save_to_disk"
            ) from None
        if isinstance(table, datasets.DatasetDict):
            if "train" not in table:
                raise ConfigError(
                    f"{what} = {files[0]!r} holds splits {list(table)} but no 'train'; save the train split"
                )
            table = table["train"]
        return table
    if all(os.path.getsize(f) == 0 for f in files):
        raise _empty(what)
    kinds = {_BUILDERS.get(os.path.splitext(f)[1]) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ConfigError(
            f'{what} matches {files[:3]}: data.source = "dataset" reads files of one kind, .jsonl / .json, '
            ".parquet or .arrow; select one kind"
        )
    try:
        return datasets.load_dataset(kinds.pop(), data_files=files, split="train")
    except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many types for an unreadable file
        raise ConfigError(f"{what}: the files do not read as a dataset ({type(e).__name__}: {e}); fix them") from None


class DatasetDocuments:
    """The table's `text_field`, tokenized per document with EOS after each (a `packing.Documents`)."""

    def __init__(self, files: list[str], text_field: str, tokenizer: str, vocab_size: int, what: str):
        self.tok = fitting_tokenizer(tokenizer, vocab_size)
        self.eos = eos_id(tokenizer, self.tok)
        table = _open_table(files, what)
        if text_field not in table.column_names:
            raise ConfigError(
                f"data.text_field = {text_field!r} is not a column of {what} (columns: {table.column_names}); "
                "set data.text_field to the column holding the text"
            )
        self.column = table.select_columns([text_field])
        self.text_field = text_field
        self.num_docs = len(self.column)
        if self.num_docs == 0:
            raise _empty(what)

    def tokens(self, index: int) -> list[int]:
        text = self.column[index][self.text_field] or ""
        return self.tok.encode(text, add_special_tokens=False).ids + ([self.eos] if self.eos is not None else [])
