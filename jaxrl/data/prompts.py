"""The one prompt path: how a record becomes the token ids a model is prompted with.

GRPO's rollouts, the held-out eval and `jaxrl sample` all call `render_prompt`, so a prompt
reads the same wherever it is used:

    ids = render_prompt(record, tokenizer, config.data)          # list[int]
    text = render_prompt_text(record, tokenizer, config.data)    # what those ids spell

A record gives its prompt as "prompt" text, as "messages" (the turns before the answer, ending
in the user's), or (prompt files only) as "prompt_ids", fed as they are.

With chat on, the turns are rendered by the tokenizer's chat template with the generation
prompt (transformers' `apply_chat_template(add_generation_prompt=True)`), a plain prompt
becoming one user turn; `data.system_prompt` is put first as a system turn unless the record
has its own, and `data.chat_template_kwargs` reach the template (e.g. Qwen3's
`{"enable_thinking": False}`). The template writes any bos itself.

With chat off (the byte tokenizer, or data.chat=False), the prompt is bos + its text, where a
chat record's text is its turns' text form (`jaxrl.data.records.context_text`) and a system
prompt comes first, joined by a blank line.

`data.chat` is None by default: on when the tokenizer has a chat template (instruct
checkpoints), off otherwise. The data section may be a ConfigDict, a dict or None; missing
keys take the defaults, so any command's config works.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl.data.records import context_text, where
from jaxrl.errors import ConfigError

def prompt_section() -> dict:
  """The prompt keys of a config's data section, with what they mean (a trainer's
  default_config adds them to its data section)."""
  return dict(
      chat=None,                # None: chat-template prompts when the tokenizer has a template
                                # (instruct checkpoints), plain text otherwise; True / False
      # passed to the chat template, e.g. {"enable_thinking": False} (None: none); from the
      # command line: --config.data.chat_template_kwargs="{'enable_thinking': False}"
      chat_template_kwargs=None,
      system_prompt="",         # a system turn put first (unless a record has its own)
  )


# What a data section without these keys (or None) means.
DEFAULTS = prompt_section()


def _get(data_cfg, key: str):
  if data_cfg is None:
    return DEFAULTS[key]
  value = data_cfg.get(key, DEFAULTS[key]) if hasattr(data_cfg, "get") else DEFAULTS[key]
  return DEFAULTS[key] if value is None else value


def template_kwargs(data_cfg) -> dict:
  """data.chat_template_kwargs as a plain dict."""
  kwargs = _get(data_cfg, "chat_template_kwargs") or {}
  if hasattr(kwargs, "to_dict"):
    kwargs = kwargs.to_dict()
  if not isinstance(kwargs, Mapping):
    raise ConfigError(f"data.chat_template_kwargs={kwargs!r} is not a dict: give one like "
                      "--config.data.chat_template_kwargs=\"{'enable_thinking': False}\".")
  return dict(kwargs)


def chat_on(tokenizer, data_cfg) -> bool:
  """Whether prompts are rendered with the tokenizer's chat template (see the module doc).
  Options that would be ignored are errors: data.chat=True without a template, and template
  kwargs with chat off."""
  chat = _get(data_cfg, "chat")
  has_template = bool(getattr(tokenizer, "chat_template", None))
  if chat is None:
    chat = has_template
  if not isinstance(chat, bool):
    raise ConfigError(f"data.chat={chat!r} is not valid: give True, False, or leave it None "
                      "(on when the tokenizer has a chat template).")
  if chat and not has_template:
    raise ConfigError("data.chat=True but the tokenizer has no chat template (the byte "
                      "tokenizer, or a checkpoint without one): set data.chat=False, or use an "
                      "instruct checkpoint's tokenizer (model.hf_path).")
  if not chat and template_kwargs(data_cfg):
    raise ConfigError("data.chat_template_kwargs is set but prompts are not chat-templated "
                      "(data.chat is off, or the tokenizer has no chat template): drop the "
                      "kwargs, or turn data.chat on.")
  return chat


def chat_turns(record: Mapping, data_cfg) -> list[dict]:
  """The record's prompt as chat turns, with data.system_prompt first unless it has one."""
  messages = record.get("messages")
  turns = ([dict(m) for m in messages] if messages  # any extra keys reach the template
           else [{"role": "user", "content": record["prompt"]}])
  system = _get(data_cfg, "system_prompt")
  if system and turns[0]["role"] != "system":
    turns = [{"role": "system", "content": system}, *turns]
  return turns


def render_prompt_text(record: Mapping, tokenizer, data_cfg=None) -> str:
  """The prompt text the model is given (chat template applied when chat is on); for a
  "prompt_ids" record, their decoding with special tokens."""
  if record.get("prompt_ids") is not None:
    return tokenizer.decode(record["prompt_ids"], skip_special=False)
  if chat_on(tokenizer, data_cfg):
    return tokenizer.apply_chat_template(chat_turns(record, data_cfg), add_generation_prompt=True,
                                         **template_kwargs(data_cfg))
  return plain_text(record, data_cfg)


def plain_text(record: Mapping, data_cfg) -> str:
  """A prompt's text with chat off: "prompt" (a chat record's text form, else its turns'),
  after data.system_prompt and a blank line unless the record has a system turn."""
  messages = record.get("messages")
  text = record.get("prompt") or context_text(messages)
  system = _get(data_cfg, "system_prompt")
  has_system = bool(messages) and messages[0]["role"] == "system"
  return system + "\n\n" + text if system and not has_system else text


def render_prompt(record: Mapping, tokenizer, data_cfg=None) -> list[int]:
  """The prompt's token ids: the chat template's rendering when chat is on (the template writes
  any bos), else bos + the text (see the module doc); "prompt_ids" as they are."""
  if record.get("prompt_ids") is not None:
    return [int(i) for i in record["prompt_ids"]]
  text = render_prompt_text(record, tokenizer, data_cfg)
  if chat_on(tokenizer, data_cfg):
    return tokenizer.encode(text)
  return tokenizer.encode(text, bos=True)


def render_prompts(records: Sequence[Mapping], tokenizer, data_cfg=None) -> list[list[int]]:
  """render_prompt of each record; a record the template rejects is named (file and line)."""
  chat_on(tokenizer, data_cfg)  # option errors once, before any record is named
  out = []
  for i, r in enumerate(records):
    try:
      out.append(render_prompt(r, tokenizer, data_cfg))
    except ConfigError as e:
      raise ConfigError(f"{where(r, i)}: {e}") from None
  return out


class Prompts:
  """A run's prompt renderer: render_prompt with the run's tokenizer and data options, each
  record's ids computed once (GRPO samples the same prompts every epoch)."""

  def __init__(self, tokenizer, data_cfg=None):
    self.tokenizer, self.data_cfg = tokenizer, data_cfg
    self.chat = chat_on(tokenizer, data_cfg)  # bad options fail when the run starts
    self._ids: dict[int, tuple[Mapping, list[int]]] = {}

  def ids(self, record: Mapping) -> list[int]:
    hit = self._ids.get(id(record))
    if hit is None or hit[0] is not record:  # the record is kept, so its id is not reused
      try:
        hit = (record, render_prompt(record, self.tokenizer, self.data_cfg))
      except ConfigError as e:  # a record read from a file is named by its file and line
        source = getattr(record, "source", None)
        raise (ConfigError(f"{source}: {e}") if source else e) from None
      self._ids[id(record)] = hit
    return hit[1]

  def text(self, record: Mapping) -> str:
    return render_prompt_text(record, self.tokenizer, self.data_cfg)


# ----------------------------------------------------------------------------- the RL prompt stream


# What a checkpoint of async generation adds to the stream's state (producer.py's resume rule).
RESUME_KEYS = ("unit", "skip", "unit_step", "nominal", "round")


class PromptStream:
  """B prompt records per step from a list, reshuffled each epoch from (seed, epoch); its
  position is checkpointed beside the train state, so a resumed run sees the same prompts."""

  def __init__(self, records: list[dict], batch: int, seed: int, extras: dict | None = None,
               learner_state: dict | None = None):
    if not records:
      raise ConfigError("the RL prompt set is empty: set data.task or data.train_file.")
    self.records, self.batch, self.seed = records, batch, seed
    self.epoch, self.pos = 0, 0
    # Host-side state that must resume with the prompts: objects with get_state()/set_state(),
    # checkpointed under their names. `extras` are what scoring updates (the reward models'
    # running normaliser), which async generation does in the background: saved as of the last
    # mark(). `learner_state` is what only the learner's own step changes (the KL coefficient,
    # the alarms' history): saved as it is when the checkpoint is written.
    self.extras = dict(extras or {})
    self.learner_state = dict(learner_state or {})
    self._marked: dict | None = None  # the extras' state at the last mark()
    # Async generation (producer.py): where the producer starts (the position this stream was
    # created or restored at, and the queue's unit/skip from a checkpoint), and the queue's
    # resume point, which get_state() then saves instead of this stream's own position.
    self.origin = (0, 0)
    self.resume_queue: dict = {}
    self.queue_state: dict | None = None

  def _order(self):
    return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.records))

  def __iter__(self):
    return self

  def __next__(self) -> list[dict]:
    out = []
    while len(out) < self.batch:
      order = self._order()
      take = order[self.pos:self.pos + self.batch - len(out)]
      out += [self.records[i] for i in take]
      self.pos += len(take)
      if self.pos >= len(self.records):
        self.epoch, self.pos = self.epoch + 1, 0
    return out

  def peek(self) -> list[dict]:
    """The batch the next `next()` returns, without advancing (async generation starts on it
    one step early). Only the position is rewound; the extras are not touched."""
    epoch, pos = self.epoch, self.pos
    try:
      return next(self)
    finally:
      self.epoch, self.pos = epoch, pos

  def mark(self) -> None:
    """Records the extras' state now (a copy); get_state() returns it until the next mark, so
    a checkpoint holds what steps <= k put in (e.g. the RM normaliser after step k's scoring),
    and a save never reads a half-updated state. (Async generation checkpoints the rollout
    queue's own resume point instead: queue_state, producer.py.)"""
    self._marked = self.snapshot()

  def clone(self) -> "PromptStream":
    """A stream of the same records and order at the position this one started or resumed
    at (the producer's own cursor), without the host state."""
    other = PromptStream(self.records, self.batch, self.seed)
    other.epoch, other.pos = self.origin
    return other

  def snapshot(self) -> dict:
    """The extras' state now, copied (what scoring changes: a resume restores it)."""
    return {k: copy.deepcopy(v.get_state()) for k, v in self.extras.items()}

  def get_state(self) -> dict:
    if self.queue_state:
      return {**self.queue_state,
              **{k: v.get_state() for k, v in self.learner_state.items()}}
    extras = (self._marked if self._marked is not None
              else {k: v.get_state() for k, v in self.extras.items()})
    return {"epoch": self.epoch, "pos": self.pos, **extras,
            **{k: v.get_state() for k, v in self.learner_state.items()}}

  def set_state(self, state: dict) -> None:
    self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
    self.origin = (self.epoch, self.pos)
    self.resume_queue = {k: int(state[k]) for k in RESUME_KEYS if k in state}
    # A key missing from an older checkpoint leaves that state as configured.
    for k, v in {**self.extras, **self.learner_state}.items():
      if k in state:
        v.set_state(state[k])
    self.mark()
