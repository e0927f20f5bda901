"""Hugging Face tokenizers (tokenizer.json + tokenizer_config.json) and their chat templates.

`HFTokenizer` loads with the `tokenizers` library (no transformers) and sits behind the same
`Tokenizer` interface as the byte-level tokenizer. Chat templates are rendered with jinja2 in
the environment transformers' `apply_chat_template` uses (sandboxed, trim_blocks and
lstrip_blocks, loop controls, its `tojson`, `raise_exception`, `strftime_now`, `namespace`,
and the special tokens as variables), so the strings match transformers' byte for byte;
tests/test_hf.py checks that against renderings recorded from transformers.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from functools import lru_cache

from jaxrl import config as config_lib
from jaxrl.data.tokenizer import ByteTokenizer
from jaxrl.errors import ConfigError
from jaxrl.models.hf_config import CORRUPT, read_json

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
# transformers passes a message's reasoning to templates under these names (first is standard).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _token_text(value) -> str | None:
  if isinstance(value, dict):  # {"content": "<|im_end|>", "lstrip": false, ...}
    return value.get("content")
  return value


@lru_cache(maxsize=16)
def _compile(template: str):
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers uses the tag to
    track assistant spans; the text is the same)."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; transformers' does not, so neither do we.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  env.globals["namespace"] = jinja2.utils.Namespace
  return env.from_string(template)


def _normalize(messages: Sequence[dict]) -> list[dict]:
  """Drops None-valued keys and aliases reasoning fields, as transformers does before rendering."""
  out = []
  for m in messages:
    if not isinstance(m, dict):
      raise ConfigError(f"chat messages must be dicts with 'role' and 'content', got {m!r}.")
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
      m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
    out.append(m)
  return out


class HFTokenizer:
  """A tokenizer.json (and tokenizer_config.json) behind jaxrl's Tokenizer interface.

  eos is tokenizer_config's eos_token; pad is its pad_token, else eos (Llama 3 ships none);
  bos_id is None when the tokenizer has no bos token (Qwen), and then encode(bos=True) adds
  nothing, as transformers does.
  """

  def __init__(self, path: str):
    from tokenizers import Tokenizer as _Tok
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
      raise ConfigError(f"{path!r} holds no tokenizer.json: jaxrl reads Hugging Face fast "
                        "tokenizers (tokenizer.json plus tokenizer_config.json).")
    self.path = path
    try:
      self._tok = _Tok.from_file(file)
    except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
      reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise ConfigError(f"{file} could not be read as a Hugging Face tokenizer ({reason}): "
                        f"{CORRUPT}.") from None
    cfg_file = os.path.join(path, "tokenizer_config.json")
    self.config = read_json(cfg_file) if os.path.isfile(cfg_file) else {}
    if not isinstance(self.config, dict):
      raise ConfigError(f"{cfg_file} holds a JSON {type(self.config).__name__}, not an object: "
                        f"{CORRUPT}.")
    self.special_tokens = {k: _token_text(self.config.get(k)) for k in _SPECIAL_KEYS
                           if _token_text(self.config.get(k)) is not None}
    template = self.config.get("chat_template")
    jinja_file = os.path.join(path, "chat_template.jinja")  # transformers >= 4.5x saves it here
    if template is None and os.path.isfile(jinja_file):
      try:
        with open(jinja_file, encoding="utf-8") as f:
          template = f.read()
      except UnicodeDecodeError:
        raise ConfigError(f"{jinja_file} is not UTF-8 text: {CORRUPT}.") from None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      template = {t["name"]: t["template"] for t in template}.get("default")
    self.chat_template: str | None = template
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.bos_id = self._id("bos_token")
    self.eos_id = self._id("eos_token")
    if self.eos_id is None:
      raise ConfigError(f"{cfg_file}: no eos_token: set it to the token that ends a turn.")
    pad = self._id("pad_token")
    self.pad_id = self.eos_id if pad is None else pad
    # Every id that ends a completion: eos, and generation_config.json's eos_token_id (an int
    # or a list; Llama 3 instruct lists <|end_of_text|>, <|eom_id|> and <|eot_id|>), which is
    # what transformers' generate() stops on.
    more = generation_eos_ids(path, self.vocab_size)
    self.eos_ids = tuple(dict.fromkeys((self.eos_id, *more)))

  def _id(self, key: str) -> int | None:
    text = self.special_tokens.get(key)
    if text is None:
      return None
    i = self._tok.token_to_id(text)
    if i is None:
      raise ConfigError(f"{self.path}/tokenizer_config.json: {key}={text!r} is not in "
                        "tokenizer.json's vocabulary.")
    return i

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    # add_special_tokens=False: bos/eos are explicit here, never a post-processor's choice.
    ids = self._tok.encode(text, add_special_tokens=False).ids
    head = [self.bos_id] if bos and self.bos_id is not None else []
    return head + ids + ([self.eos_id] if eos else [])

  def decode(self, ids, *, skip_special: bool = True) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

  def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = False,
                          tools: list[dict] | None = None, **kwargs) -> str:
    """The chat as text, as transformers' apply_chat_template(tokenize=False) renders it.
    Extra keyword arguments reach the template (e.g. enable_thinking=False for Qwen3)."""
    if not self.chat_template:
      raise ConfigError(f"{self.path}/tokenizer_config.json has no chat_template: use a chat "
                        "(instruct) checkpoint's tokenizer, or prompt/completion records.")
    import jinja2
    variables = {**self.special_tokens, **kwargs}
    try:
      return _compile(self.chat_template).render(
          messages=_normalize(messages), tools=tools, documents=None,
          add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.SecurityError as e:
      reason = str(e).rstrip(".")
      raise ConfigError(f"the chat template of {self.path} was refused by the sandbox "
                        f"({reason}): templates may not reach Python internals; use the "
                        "checkpoint's own chat template.") from None
    except jinja2.exceptions.TemplateError as e:  # a syntax error, or the template's own
      raise ConfigError(f"the chat template of {self.path} failed ({type(e).__name__}: {e}): "
                        "fix the template, or the messages it rejects.") from None

  def encode_chat(self, messages: Sequence[dict], *, add_generation_prompt: bool = False,
                  **kwargs) -> list[int]:
    """Token ids of the rendered chat (the template writes any bos itself)."""
    return self.encode(self.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, **kwargs))

  def encode_chat_sft(self, messages: Sequence[dict], **kwargs) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) of a chat whose last turn is the assistant's, the split an
    SFT record {"prompt", "completion"} trains on: the prompt is the template's rendering of the
    earlier turns with the generation prompt, the completion the rest of the full rendering (the
    final answer and its end-of-turn tokens, e.g. "...<|im_end|>\n")."""
    if not messages or messages[-1].get("role") != "assistant":
      raise ConfigError("a chat trained as prompt/completion must end with an assistant turn.")
    prompt = self.apply_chat_template(messages[:-1], add_generation_prompt=True, **kwargs)
    full = self.apply_chat_template(messages, **kwargs)
    if not full.startswith(prompt):
      raise ConfigError("the chat template renders the final assistant turn's prompt "
                        "differently from its generation prompt, so it cannot be split into "
                        "prompt and completion.")
    return self.encode(prompt), self.encode(full[len(prompt):])

  def encode_chat_with_mask(self, messages: Sequence[dict], **kwargs
                            ) -> tuple[list[int], list[bool]]:
    """(ids, mask) for SFT on `{"messages": [...]}`: mask is True on each assistant turn's
    tokens, from the end of its generation prompt to the end of its turn.

    Found by rendering prefixes: the prompt up to turn i with add_generation_prompt, then the
    chat through turn i. A template that rewrites earlier turns (Qwen3 drops past reasoning)
    breaks that prefix property; it is an error here rather than a silently wrong mask.
    """
    text = self.apply_chat_template(messages, **kwargs)
    spans = []
    for i, m in enumerate(messages):
      if m.get("role") != "assistant":
        continue
      start = self.apply_chat_template(messages[:i], add_generation_prompt=True, **kwargs)
      end = self.apply_chat_template(messages[:i + 1], **kwargs)
      if not (text.startswith(end) and end.startswith(start)):
        raise ConfigError(f"the chat template renders turn {i} differently once later turns "
                          "follow, so assistant tokens cannot be masked by prefix; train on "
                          "one assistant turn per record.")
      spans.append((len(start), len(end)))
    enc = self._tok.encode(text, add_special_tokens=False)
    mask = [any(s <= a and b <= e for s, e in spans) and a < b for a, b in enc.offsets]
    return enc.ids, mask


def generation_eos_ids(path: str, vocab_size: int | None = None) -> tuple[int, ...]:
  """The eos ids of `path`/generation_config.json (its eos_token_id: an int or a list of ints),
  or () when there is no such file or key. A damaged file is named, never skipped."""
  file = os.path.join(path, "generation_config.json")
  if not os.path.isfile(file):
    return ()
  cfg = read_json(file)
  if not isinstance(cfg, dict):
    raise ConfigError(f"{file} holds a JSON {type(cfg).__name__}, not an object: {CORRUPT}.")
  eos = cfg.get("eos_token_id")
  if eos is None:
    return ()
  ids = eos if isinstance(eos, list) else [eos]
  for i in ids:
    if not isinstance(i, int) or isinstance(i, bool) or i < 0 or (
        vocab_size is not None and i >= vocab_size):
      raise ConfigError(f"{file}: eos_token_id={eos!r} is not a token id or a list of them "
                        f"(ids run from 0 to {vocab_size - 1 if vocab_size else 'the vocab'}): "
                        "fix it, or delete the key to stop on the tokenizer's eos only.")
  return tuple(ids)


def eos_ids(tokenizer) -> tuple[int, ...]:
  """Every id that ends a completion as eos: the tokenizer's eos, plus generation_config.json's
  for a checkpoint's tokenizer (the byte tokenizer has only its own)."""
  return tuple(getattr(tokenizer, "eos_ids", (tokenizer.eos_id,)))


def tokenizer_for(config):
  """The tokenizer a command uses: the checkpoint's own (HFTokenizer) when the config names
  model.hf_path, else the byte-level tokenizer, which serves the built-in presets only. Its
  ids must fit the model's vocabulary."""
  path = config.model.get("hf_path") or ""
  if path and not os.path.isfile(os.path.join(path, "tokenizer.json")):
    raise ConfigError(f"model.hf_path={path!r} holds no tokenizer.json: copy the checkpoint's "
                      "tokenizer files (tokenizer.json, tokenizer_config.json) beside its "
                      "weights; jaxrl never pairs a checkpoint with the byte tokenizer.")
  tok = HFTokenizer(path) if path else ByteTokenizer()
  vocab = config_lib.model_config(config).vocab_size
  if tok.vocab_size > vocab:
    raise ConfigError(f"the tokenizer has {tok.vocab_size} ids but model.vocab_size is {vocab}: "
                      "use a model whose vocabulary covers the tokenizer (the byte tokenizer "
                      "needs at least 259).")
  return tok
