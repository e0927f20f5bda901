"""Environments for multi-turn and tool-use rollouts: a small protocol and a registry.

An environment is host Python, one instance per conversation:

    env = make_env()                       # a fresh one for each of a prompt's G conversations
    messages = env.reset(record)           # the chat turns the model is prompted with
    obs, reward, done, info = env.step(messages, assistant_turn)

`assistant_turn` is the model's turn as a chat message, {"role": "assistant", "content": text,
"tool_calls": [...]} with the tool calls parsed in the checkpoint's own format
(jaxrl.envs.tool_calls), and "tool_call_errors": one sentence per call that could not be
parsed. `obs` is the list of messages the environment answers with (role "tool" for tool
results, rendered through the chat template), or None when it has nothing to say; `reward` a
float (a conversation's reward is the sum over its steps); `done` ends the conversation;
`info` a dict whose "tool_calls" and "bad_tool_calls" counts are logged (env/tool_calls/mean,
env/bad_tool_calls). An environment may list its tools' JSON schemas in `tools`: they reach
the prompt through the chat template's `tools=` argument.

Built-ins are named by `data.env` (ENVS: calculator, guess_number); a user's own by
`--config.env_module=path.py`, a file that defines `make_env()`. Importing a module registers
nothing: the table below is the whole registry, and a user module is loaded, not merged in.
An environment that raises is named, with the method and the exception, in one sentence
(EnvError), and its wall time is measured (timing_s/env).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, Protocol

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError, check_choice


class Env(Protocol):
  """One conversation's environment (see the module doc)."""
  tools: list[dict] | None

  def reset(self, record: dict) -> list[dict]: ...

  def step(self, messages: list[dict], assistant_turn: dict
           ) -> tuple[list[dict] | None, float, bool, dict]: ...


class EnvError(RuntimeError):
  """An environment raised or returned something malformed; the message names it."""


def builtin_envs() -> dict[str, Callable[[], Env]]:
  """The built-in environments by name (imported here, so importing jaxrl.envs stays light)."""
  from jaxrl.envs.calculator import CalculatorEnv
  from jaxrl.envs.games import GuessNumberEnv
  return {"calculator": CalculatorEnv, "guess_number": GuessNumberEnv}


def env_factory(config) -> tuple[str, Callable[[], Env]] | None:
  """(name, factory) of the configured environment: data.env's built-in, or the make_env() of
  the file env_module names; None when neither is set (single-turn rollouts)."""
  name = config.data.get("env") or ""
  path = config.get("env_module") or ""
  if name and path:
    raise ConfigError(f"data.env={name!r} and env_module={path!r} are both set: name a "
                      "built-in environment or your own file, not both.")
  if path:
    return os.path.basename(path), load_env_module(path)
  if name:
    return name, builtin_envs()[check_choice("data.env", name, sorted(builtin_envs()))]
  return None


def load_env_module(path: str) -> Callable[[], Env]:
  """The make_env of a user's environment file, loaded under its own module name."""
  module = config_lib.load_python_file(
      path, prefix="jaxrl_env_", what="env_module",
      missing="pass the path of a Python file that defines make_env().")
  make = getattr(module, "make_env", None)
  if not callable(make):
    raise ConfigError(f"env_module {path} defines no make_env(): add one that returns a fresh "
                      "environment (reset/step) for each conversation.")
  return make


class Timed:
  """Calls into one conversation's environment: each call timed (into `seconds`, its own, so
  conversations stepped in different threads never share a counter), anything it raises
  turned into an EnvError naming the environment and the method, and its step's return
  checked."""

  def __init__(self, name: str, factory: Callable[[], Env]):
    self.name, self.seconds = name, 0.0
    self.env = self._call("make_env", factory)

  def _call(self, method: str, fn, *args):
    t0 = time.perf_counter()
    try:
      return fn(*args)
    except (ConfigError, EnvError):
      raise
    except Exception as e:
      raise EnvError(f"environment {self.name!r} raised {type(e).__name__} in {method}(): "
                     f"{e}") from e
    finally:
      self.seconds += time.perf_counter() - t0

  @property
  def tools(self) -> list[dict] | None:
    return getattr(self.env, "tools", None) or None

  def reset(self, record: dict) -> list[dict]:
    messages = self._call("reset", self.env.reset, record)
    if not isinstance(messages, list) or not messages or not all(
        isinstance(m, dict) and "role" in m for m in messages):
      raise EnvError(f"environment {self.name!r}: reset() returned {messages!r:.80}, not a "
                     "non-empty list of chat messages ({'role': ..., 'content': ...}).")
    return messages

  def step(self, messages: list[dict], turn: dict) -> tuple[list[dict] | None, float, bool,
                                                            dict[str, Any]]:
    out = self._call("step", self.env.step, messages, turn)
    if not (isinstance(out, tuple) and len(out) == 4):
      raise EnvError(f"environment {self.name!r}: step() returned {out!r:.80}, not "
                     "(observation messages or None, reward, done, info).")
    obs, reward, done, info = out
    if obs is not None and not (isinstance(obs, list) and all(
        isinstance(m, dict) and "role" in m for m in obs)):
      raise EnvError(f"environment {self.name!r}: step() returned the observation "
                     f"{obs!r:.80}, not None or a list of chat messages.")
    try:
      reward = float(reward)
    except (TypeError, ValueError):
      raise EnvError(f"environment {self.name!r}: step() returned the reward {reward!r:.40}, "
                     "not a number.") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
      raise EnvError(f"environment {self.name!r}: step() returned the reward {reward}.")
    return obs, reward, bool(done), dict(info or {})


__all__ = ["Env", "EnvError", "Timed", "builtin_envs", "env_factory", "load_env_module"]
