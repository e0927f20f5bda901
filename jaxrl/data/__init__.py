"""Data: tokenizers (and, with [sft], grain pipelines and record readers)."""

from jaxrl.data.tokenizer import ByteTokenizer, Tokenizer

__all__ = ["ByteTokenizer", "Tokenizer"]
