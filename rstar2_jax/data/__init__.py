"""Problem sets: JSONL and parquet problem files (`datasets.py`)."""
