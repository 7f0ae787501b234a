"""`data.source = "dataset"`: documents of local jsonl / parquet / arrow files, folders of them and saved `datasets`
directories, kinds mixed (`dataset_files.parts`), tokenized one at a time when a stream reaches them.

The files open through the `datasets` package as memory-mapped Arrow tables, one per part (jsonl and parquet are
converted once into its cache, which the first opener writes and every later one reuses: `pp-tp check` before the
ranks start), so a rank pages in only the documents its rows read and holds none of the corpus itself.
"""

from __future__ import annotations

import bisect
import logging

from pp_tp.errors import ConfigError
from pp_tp.train.dataset_files import Part, parts
from pp_tp.train.text_tokens import eos_id, fitting_tokenizer


def _empty(what: str) -> ConfigError:
    return ConfigError(f"{what} holds no documents; give files with at least one row")


def _open_part(part: Part):  # -> datasets.Dataset
    """One part as a memory-mapped table: a saved directory through `load_from_disk` (its train split), files of one
    kind through `load_dataset`."""
    import datasets

    datasets.disable_progress_bars()
    logging.getLogger("datasets").setLevel(logging.ERROR)
    try:
        if part.builder is None:
            table = datasets.load_from_disk(part.files[0])
        else:
            table = datasets.load_dataset(part.builder, data_files=part.files, split="train")
    except Exception as e:  # noqa: BLE001 - datasets and pyarrow raise many types for an unreadable file
        first = (str(e).splitlines() or [""])[0]
        raise ConfigError(
            f"{part.what}: the data does not read as a dataset ({type(e).__name__}: {first}); fix it"
        ) from None
    if isinstance(table, datasets.DatasetDict):
        if "train" not in table:
            raise ConfigError(f"{part.what} holds splits {list(table)} but no 'train'; save the train split")
        table = table["train"]
    return table


class DatasetDocuments:
    """The parts' `text_field`, end to end, tokenized per document with EOS after each (a `packing.Documents`)."""

    def __init__(
        self, entries: list[tuple[str, str, list[str]]], text_field: str, tokenizer: str, vocab_size: int, what: str
    ):
        self.tok = fitting_tokenizer(tokenizer, vocab_size)
        self.eos = eos_id(tokenizer, self.tok)
        self.text_field = text_field
        self.columns = [self._column(part) for part in parts(entries)]
        self.starts = [0]  # the first document index of each part, and the total at the end
        for column in self.columns:
            self.starts.append(self.starts[-1] + len(column))
        self.num_docs = self.starts[-1]
        if self.num_docs == 0:
            raise _empty(what)

    def _column(self, part: Part):  # -> datasets.Dataset
        table = _open_part(part)
        if self.text_field not in table.column_names:
            raise ConfigError(
                f"data.text_field = {self.text_field!r} is not a column of {part.what} (columns: "
                f"{table.column_names}); set data.text_field to the column holding the text"
            )
        return table.select_columns([self.text_field])

    def tokens(self, index: int) -> list[int]:
        p = bisect.bisect_right(self.starts, index) - 1
        text = self.columns[p][index - self.starts[p]][self.text_field] or ""
        return self.tok.encode(text, add_special_tokens=False).ids + ([self.eos] if self.eos is not None else [])
