"""Loads this folder's jsonl files with the `json` builder of `datasets`, wherever the caller's cwd is.

The YAMLs name `dataset_path: json` and `dataset_kwargs.data_files` relative to this folder; lm-eval calls
`custom_dataset(**metadata, **dataset_kwargs)`, so the relative paths are resolved here, not against the cwd
(`datasets` alone would resolve them against the cwd). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load_local_json(data_files: dict[str, str], **_: Any):
    import datasets

    files = {split: str((HERE / path).resolve()) for split, path in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
