"""Reading Parquet tables with errors that name the file, the column and the first bad row."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_rlhf.errors import UserError


def read_table(path: str | os.PathLike, required: tuple[str, ...]) -> pa.Table:
    """Read ``path`` and check that every ``required`` column exists with no null or empty value."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: is a folder; data files are Parquet files, listed one by one")
    if not path.is_file():
        raise UserError(f"{path}: file not found")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"{path}: not a readable Parquet file ({str(err).splitlines()[0]})") from None
    for column in required:
        if column not in table.column_names:
            raise UserError(f"{path}: missing column {column!r} (has {', '.join(table.column_names)})")
        values = table.column(column).to_pylist()
        for row, value in enumerate(values):
            if value is None or (hasattr(value, "__len__") and len(value) == 0) or (
                    isinstance(value, str) and not value.strip()):
                raise UserError(f"{path}: column {column!r} row {row} is null or empty")
            if not isinstance(value, (str, list)):
                raise UserError(f"{path}: column {column!r} row {row} has type "
                                f"{type(value).__name__}, expected a string or a list of messages")
    return table


def write_table_atomic(table: pa.Table, path: str | os.PathLike) -> None:
    """Write ``table`` to ``path`` via a temporary file, so a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
