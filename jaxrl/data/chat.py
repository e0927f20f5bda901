"""Tool calls in the model's own chat format: parsing them out of a completion, and rendering
an environment's answer back through the checkpoint's chat template. On the data side, below
both the data pipeline (SFT demonstrations of multi-turn conversations) and the environments'
multi-turn driver (jaxrl.envs.rollout), so neither imports the other.

Two formats, picked from the chat template (tool_format):
  hermes  Qwen 2/2.5/3 and Hermes: each call is <tool_call>{"name": ..., "arguments": {...}}
          </tool_call> in the assistant's text; results come back as role "tool" turns (the
          template wraps them in <tool_response>).
  llama3  Llama 3.1-3.3 JSON tool calling: the whole turn is {"name": ..., "parameters": {...}}
          (optionally after <|python_tag|>; several calls separated by ";"); results come back
          as role "ipython" turns.
A call that cannot be parsed (bad JSON, no name, arguments that are not an object, a
<tool_call> never closed) is not raised: it becomes one sentence in the turn's
"tool_call_errors", which the environment answers like any other result, and it is counted.

Rendering keeps the model's own tokens: a conversation is the prompt, the model's sampled
tokens, then the template tokens that follow a turn (what the template writes after the
turn's end-of-turn token, e.g. Qwen's "\\n") and the observation's own turn with the next
generation prompt. Those come from rendering the chat with and without the observation and
taking the difference, so they are the template's bytes exactly; a template that rewrites
earlier turns once later ones follow is refused (as jaxrl.data.hf_tokenizer's masks do).
Without a chat template (the byte tokenizer) the conversation is plain text: a tool result
is "<tool_response>\\n...\\n</tool_response>\\n" after the model's turn, any other
observation its content and a newline; the tool schemas then do not reach the prompt.
"""

from __future__ import annotations

import json
import re

from jaxrl.data import prompts as prompts_lib
from jaxrl.errors import ConfigError

FORMATS = ("hermes", "llama3")
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def tool_format(tokenizer) -> str:
  """The tool-call format of the tokenizer's chat template: llama3 when it speaks of
  ipython or <|python_tag|>, else hermes (Qwen's, and the plain-text convention)."""
  template = getattr(tokenizer, "chat_template", None) or ""
  if "<tool_call>" not in template and ("ipython" in template or _PYTHON_TAG in template):
    return "llama3"
  return "hermes"


def _one_call(body: str, arg_keys: tuple[str, ...]) -> tuple[dict | None, str | None]:
  """({"name", "arguments"}, None) of one call's JSON text, or (None, why it is malformed)."""
  try:
    obj = json.loads(body)
  except json.JSONDecodeError as e:
    return None, f"the tool call {body.strip()[:60]!r} is not valid JSON ({e.msg})"
  if not isinstance(obj, dict):
    return None, f"the tool call {body.strip()[:60]!r} is not a JSON object"
  name = obj.get("name")
  if not isinstance(name, str) or not name:
    return None, f"the tool call {body.strip()[:60]!r} has no \"name\""
  key = next((k for k in arg_keys if k in obj), None)
  args = obj.get(key, {}) if key else {}
  if isinstance(args, str):  # OpenAI's wire form: arguments as a JSON string
    try:
      args = json.loads(args)
    except json.JSONDecodeError:
      pass
  if not isinstance(args, dict):
    return None, f"the arguments of tool call {name!r} are not a JSON object"
  return {"name": name, "arguments": args}, None


def parse_tool_calls(text: str, fmt: str) -> tuple[list[dict], list[str]]:
  """(calls, errors) in a completion's text: calls as {"name", "arguments": dict}, errors as
  one sentence per call that could not be parsed. A turn with neither is a plain answer."""
  calls, errors = [], []
  if fmt == "hermes":
    for m in _HERMES.finditer(text):
      if not m.group(2):
        errors.append("a <tool_call> is not closed by </tool_call>")
        continue
      call, err = _one_call(m.group(1), ("arguments", "parameters"))
      calls += [call] if call else []
      errors += [err] if err else []
    return calls, errors
  if fmt != "llama3":
    raise ConfigError(f"tool format {fmt!r} is not valid: choose one of {', '.join(FORMATS)}.")
  s = text.strip()
  if s.startswith(_PYTHON_TAG):
    s = s[len(_PYTHON_TAG):].strip()
  if not s.startswith("{"):
    return calls, errors  # a plain answer
  call, err = _one_call(s, ("parameters", "arguments"))
  if call:
    return [call], errors
  parts = [x for x in s.split(";") if x.strip()]
  if len(parts) > 1:  # several calls, ";"-separated
    for part in parts:
      call, e = _one_call(part, ("parameters", "arguments"))
      calls += [call] if call else []
      errors += [e] if e else []
    return calls, errors
  return calls, [err]


def assistant_turn(text: str, fmt: str) -> dict:
  """The model's turn as the chat message an environment's step() receives."""
  calls, errors = parse_tool_calls(text, fmt)
  return {"role": "assistant", "content": text,
          "tool_calls": [{"type": "function", "function": c} for c in calls],
          "tool_call_errors": errors}


class ChatRenderer:
  """Token ids of a conversation's prompt and of what follows each model turn, in the
  checkpoint's chat format (see the module doc)."""

  def __init__(self, tokenizer, data_cfg=None):
    self.tokenizer, self.data_cfg = tokenizer, data_cfg
    self.chat = prompts_lib.chat_on(tokenizer, data_cfg)
    self.kwargs = prompts_lib.template_kwargs(data_cfg)
    self.format = tool_format(tokenizer)
    self.tool_role = "ipython" if self.format == "llama3" else "tool"
    eos = getattr(tokenizer, "special_tokens", {}).get("eos_token")
    self.eos_text = eos or ""

  def _render(self, messages, tools, generation: bool) -> str:
    return self.tokenizer.apply_chat_template(
        [self._template_message(m) for m in messages], add_generation_prompt=generation,
        tools=tools, **self.kwargs)

  def _template_message(self, m: dict) -> dict:
    """A message as the template takes it: tool results under the format's role; a model turn
    without its parse errors (a template does not know them)."""
    m = {k: v for k, v in m.items() if k != "tool_call_errors"}
    if m.get("role") == "tool":
      m["role"] = self.tool_role
    if m.get("role") == "assistant" and not m.get("tool_calls"):
      m.pop("tool_calls", None)
    return m

  def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The first turn's prompt: the environment's messages (data.system_prompt first unless
    they have one) with the generation prompt, tools in the template's tools= argument."""
    turns = prompts_lib.chat_turns({"messages": messages}, self.data_cfg)
    if self.chat:
      return self.tokenizer.encode(self._render(turns, tools, True))
    return self.tokenizer.encode(prompts_lib.plain_text({"messages": turns}, self.data_cfg),
                                 bos=True)

  def observation_ids(self, messages: list[dict], turn: dict, obs: list[dict],
                      tools: list[dict] | None, *, closed: bool = True) -> list[int]:
    """The tokens after a model turn: the template's tokens after its end-of-turn token, the
    observation's turn(s) and the next generation prompt. `messages` are the turns before the
    model's `turn`; closed=False (a turn cut at max_new_tokens): the end-of-turn token is
    written first, as a template token."""
    if not self.chat:
      text = "\n" + "".join(
          f"<tool_response>\n{m.get('content', '')}\n</tool_response>\n"
          if m.get("role") == "tool" else f"{m.get('content', '')}\n" for m in obs)
      return ([] if closed else [self.tokenizer.eos_id]) + self.tokenizer.encode(text)
    turns = prompts_lib.chat_turns({"messages": messages}, self.data_cfg)
    before = self._render(turns, tools, True)
    through = self._render(turns + [turn], tools, False)
    after = self._render(turns + [turn] + list(obs), tools, True)
    if not (after.startswith(through) and through.startswith(before)):
      raise ConfigError("the chat template renders earlier turns differently once later turns "
                        "follow, so a conversation cannot be continued token by token; use a "
                        "checkpoint whose template keeps past turns as they were.")
    own = through[len(before):]  # the model turn as the template writes it
    glue = own.rsplit(self.eos_text, 1)[1] if self.eos_text and self.eos_text in own else ""
    return self.tokenizer.encode(("" if closed else self.eos_text) + glue + after[len(through):])

  def conversation_ids(self, messages: list[dict], tools: list[dict] | None
                       ) -> tuple[list[int], list[int]]:
    """(ids, mask) of a whole conversation as the multi-turn driver writes it (prompt, each
    model turn's text and end-of-turn token, each observation by observation_ids), mask 1 on
    the model's tokens: an SFT demonstration of the rollouts GRPO then samples (data.train_on=
    all_assistant without a chat template). Plain text only: a chat template's conversations
    are rendered by its own tokenizer (encode_chat_with_mask)."""
    if self.chat:
      raise ConfigError("conversation_ids renders plain-text conversations; a chat-templated "
                        "tokenizer renders its own (encode_chat_with_mask).")
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    ids = self.prompt_ids(messages[:first], tools)
    mask = [0] * len(ids)
    i = first
    while i < len(messages):
      turn = assistant_turn(messages[i]["content"], self.format)
      own = self.tokenizer.encode(turn["content"]) + [self.tokenizer.eos_id]
      ids, mask = ids + own, mask + [1] * len(own)
      j = i + 1
      while j < len(messages) and messages[j]["role"] != "assistant":
        j += 1
      if j > i + 1:
        more = self.observation_ids(messages[:i], turn, messages[i + 1:j], tools)
        ids, mask = ids + more, mask + [0] * len(more)
      i = j
    return ids, mask


__all__ = ["FORMATS", "ChatRenderer", "assistant_turn", "parse_tool_calls", "tool_format"]
