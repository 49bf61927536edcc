"""Convert public preference data (HH-RLHF, UltraFeedback) into our Parquet layout.

    python tools/convert_preference_data.py --layout hh-rlhf --input train.jsonl --output prefs.parquet
    python tools/convert_preference_data.py --layout ultrafeedback --input train.parquet --output prefs.parquet

Input: .parquet, .jsonl or .json (a list). Rows that cannot be converted are counted and the first
few reasons printed; the run fails if none converts.
"""

import argparse
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rlhf.data.parquet import write_table_atomic  # noqa: E402
from megatron_rlhf.data.public_formats import convert_rows  # noqa: E402


def read_rows(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return json.loads(path.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", required=True, choices=["hh-rlhf", "ultrafeedback"])
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    args = parser.parse_args(argv)
    rows, skipped = convert_rows(read_rows(args.input), args.layout)
    for index, reason in skipped[:5]:
        print(f"skipped row {index}: {reason}", file=sys.stderr)
    if not rows:
        print(f"error: no row of {args.input} could be converted", file=sys.stderr)
        return 2
    if any("margin" in row for row in rows):  # one schema for all rows, not the first row's
        rows = [{**row, "margin": row.get("margin")} for row in rows]
    write_table_atomic(pa.Table.from_pylist(rows), args.output)
    print(f"wrote {len(rows)} pairs to {args.output} ({len(skipped)} skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
