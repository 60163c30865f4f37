"""Reading documents from each kind of text source. Runs inside step workers."""

from __future__ import annotations

import json
from pathlib import Path

Document = str | list  # plain text, or a chat as a list of {"role", "content"} messages


def _from_records(records, column: str, where: str) -> list[Document]:
    docs: list[Document] = []
    for i, rec in enumerate(records):
        if "messages" in rec and column not in rec:
            docs.append(rec["messages"])
            continue
        if column not in rec:
            raise ValueError(f"{where}: record {i} has no column {column!r} (columns: {sorted(rec)})")
        value = rec[column]
        if isinstance(value, list):  # a chat stored under the text column
            docs.append(value)
        elif value:
            docs.append(str(value))
    return docs


def read_file(path: Path, fmt: str, column: str) -> list[Document]:
    fmt = fmt if fmt != "auto" else {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}.get(path.suffix, "")
    if fmt == "txt":
        text = path.read_text(encoding="utf-8")
        return [block.strip() for block in text.split("\n\n") if block.strip()]
    if fmt == "jsonl":
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        return _from_records(records, column, str(path))
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return _from_records(pq.read_table(path).to_pylist(), column, str(path))
    raise ValueError(f"{path}: unknown file format; use .txt, .jsonl or .parquet, or set format:")


def read_hf(source: dict, data_files) -> list[Document]:
    from datasets import load_dataset

    ds = load_dataset(
        source["name"], source.get("config"), split=source["split"], revision=source.get("revision"),
        data_files=data_files,
    )
    if source["column"] not in ds.column_names and "messages" not in ds.column_names:
        raise ValueError(f"dataset {source['name']} has no column {source['column']!r} (columns: {ds.column_names})")
    return _from_records(ds, source["column"], source["name"])


def read_source(source: dict, runtime: dict) -> list[Document]:
    """Documents of one source. `runtime` carries resolved absolute paths (not part of the key)."""
    kind = source["type"]
    if kind == "pydocs":
        from qbuild.calibration.corpus import pydocs_documents

        return pydocs_documents(source["split"])
    if kind == "file":
        return read_file(Path(runtime["path"]), source["format"], source["column"])
    if kind == "hf":
        return read_hf(source, runtime.get("data_files"))
    raise ValueError(f"unknown source type {kind!r}")
