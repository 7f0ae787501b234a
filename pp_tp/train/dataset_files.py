"""What `data.path` / `data.paths` name for `data.source = "dataset"`, as parts `datasets` reads one by one.

An entry is a file, a glob, a folder or a `save_to_disk` directory. A folder holds the files `datasets` itself
takes from a directory (`load_dataset(DIR)`: its train split, found by `get_data_patterns`; hidden files,
README.md and the like left out), of the kinds read here. Kinds may mix, within an entry and across entries:
each run of consecutive files of one kind is one part (one `load_dataset` call, so one Arrow cache), and the
documents are the parts' rows end to end, in the order the entries give.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from pp_tp.errors import ConfigError

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
KINDS = ".jsonl / .json, .parquet or .arrow"
# What `save_to_disk` writes beside its Arrow shards (datasets.config's DATASET_STATE_JSON_FILENAME and
# DATASETDICT_JSON_FILENAME): a directory holding one is a saved dataset, read whole by `load_from_disk`.
SAVED_MARKERS = ("state.json", "dataset_dict.json")


@dataclass
class Part:
    """Files of one kind (`builder` a `datasets` packaged builder) or one saved directory (`builder` None); `what`
    names the entry it came from (`data.paths[1] = 'dir'`), for the one-line refusals."""

    builder: str | None
    what: str
    files: list[str] = field(default_factory=list)


def is_saved(path: str) -> bool:
    """Whether `path` is a directory `save_to_disk` wrote (a Dataset or a DatasetDict)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in SAVED_MARKERS)


def folder_files(folder: str, what: str) -> list[str]:
    """The files `datasets` reads from `folder` as its train split, of the kinds read here; one line when none."""
    from datasets.data_files import DataFilesList, EmptyDatasetError, get_data_patterns

    try:
        splits = {str(k): v for k, v in get_data_patterns(folder).items()}
    except EmptyDatasetError:
        splits = {}
    if splits and "train" not in splits:
        raise ConfigError(
            f"{what} is a folder whose file names give the splits {sorted(splits)} but no train split (as "
            "`datasets` reads a folder); name the training files with a glob or rename them"
        )
    train = splits.get("train", [])
    files = DataFilesList.from_patterns(train, base_path=folder, allowed_extensions=list(BUILDERS)) if train else []
    if not files:
        raise ConfigError(
            f"{what} is a folder with no {KINDS} file (nor a save_to_disk dataset); give a folder holding data "
            "files, or the files themselves"
        )
    return [str(f) for f in files]


def builder(path: str, what: str, named: bool) -> str:
    """The `datasets` builder of one file, by its extension; one line for a kind not read here (`named`: the entry
    is this file itself, so `what` already names it)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in BUILDERS:
        subject = what if named else f"{what} matches {path!r}, which"
        raise ConfigError(
            f'{subject} is a {ext or "extensionless"} file; data.source = "dataset" reads {KINDS} files, a folder '
            "of them or a save_to_disk directory; convert it or leave it out"
        )
    return BUILDERS[ext]


def parts(entries: list[tuple[str, str, list[str]]]) -> list[Part]:
    """Each entry (key, pattern, its paths: files, folders or saved directories) as parts, in order; empty files
    (no documents) are left out."""
    out: list[Part] = []
    for key, pattern, paths in entries:
        what, mine = f"{key} = {pattern!r}", []
        for path in paths:
            if is_saved(path):
                mine.append(Part(None, what, [path]))
                continue
            for f in folder_files(path, what) if os.path.isdir(path) else [path]:
                kind = builder(f, what, named=f == pattern)
                if os.path.getsize(f) == 0:
                    continue
                if not mine or mine[-1].builder != kind:
                    mine.append(Part(kind, what))
                mine[-1].files.append(f)
        out += mine
    return out
