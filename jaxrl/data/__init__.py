"""Data: tokenizers, record readers (JSONL, array_record/TFDS), grain SFT and preference
pipelines."""

from jaxrl.data.prefs import (clean_prefs, fingerprint, kto_batches, prefs_batches,
                               read_kto, read_prefs, task_prefs)
from jaxrl.data.pipeline import FEATURES, prepare_sft, sft_batches, sft_dataset, tokenize_sft
from jaxrl.data.records import (KINDS, ON_BAD_ROW, Record, messages_to_sft, parse_example,
                                read_array_record, read_jsonl, read_records, write_jsonl)
from jaxrl.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "clean_prefs", "fingerprint", "kto_batches", "prefs_batches", "read_kto", "read_prefs",
    "task_prefs",
    "ByteTokenizer", "FEATURES", "KINDS", "ON_BAD_ROW", "Record", "Tokenizer",
    "messages_to_sft", "parse_example", "prepare_sft", "read_array_record", "read_jsonl",
    "read_records", "sft_batches", "sft_dataset", "tokenize_sft", "write_jsonl",
]
