"""Tokenizers behind one small interface. The byte-level tokenizer needs no download."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
  vocab_size: int
  pad_id: int
  bos_id: int
  eos_id: int

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...

  def decode(self, ids, *, skip_special: bool = True) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes shifted by 3 past pad=0, bos=1, eos=2 (ByT5's layout): 259 ids in all."""

  pad_id, bos_id, eos_id = 0, 1, 2
  offset = 3
  vocab_size = 256 + offset

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = [b + self.offset for b in text.encode("utf-8")]
    return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

  def decode(self, ids, *, skip_special: bool = True) -> str:
    out = bytearray()
    for i in ids:
      i = int(i)
      if self.offset <= i < self.vocab_size:
        out.append(i - self.offset)
      elif i >= self.vocab_size:  # a model vocabulary padded past 259 can still emit these
        out += "\ufffd".encode()
      elif not skip_special:
        out += {0: b"<pad>", 1: b"<bos>", 2: b"<eos>"}[i]
    return out.decode("utf-8", errors="replace")
