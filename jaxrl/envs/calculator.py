"""The calculator tool environment, and its safe arithmetic.

`calculate` reads an arithmetic expression by walking Python's own parse tree (ast) over a
whitelist: int and float literals, + - * / // % ** and unary +/-, parentheses. Anything else
(names, calls, attributes, subscripts, lambdas, strings, comparisons) is refused by node type
before any value is computed, and nothing is ever passed to eval or exec. Sizes are bounded
before they are computed: at most 200 characters, 40 levels of nesting, exponents of at most
64 and no power or result beyond 1e50 in magnitude, so `9**9**9` or a long product cannot tie
up the host. The ast module is Python's own parser (kept rather than a hand-written grammar);
the whitelist is what makes it safe.
"""

from __future__ import annotations

import ast
import json
import math
import operator

import numpy as np

from jaxrl.errors import ConfigError
from jaxrl.rewards import extract_answer, normalize_answer

MAX_CHARS = 200
MAX_DEPTH = 40
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10 ** 50
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
  """An expression the calculator refuses; the message says why, for the model to read."""


def calculate(expression) -> int | float:
  """The value of an arithmetic expression, or CalcError (see the module doc)."""
  if not isinstance(expression, str):
    raise CalcError(f"the expression must be a string, not {type(expression).__name__}")
  if len(expression) > MAX_CHARS:
    raise CalcError(f"the expression is longer than {MAX_CHARS} characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    raise CalcError(f"{expression.strip()[:60]!r} is not an arithmetic expression") from None
  return _value(tree.body, 0)


def _bounded(x):
  if isinstance(x, complex) or (isinstance(x, float) and not math.isfinite(x)):
    raise CalcError("the result is not a finite real number")
  if abs(x) > MAX_MAGNITUDE:
    raise CalcError("the result is too large (more than 1e50)")
  return x


def _value(node, depth: int):
  if depth > MAX_DEPTH:
    raise CalcError(f"the expression nests deeper than {MAX_DEPTH} levels")
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return _bounded(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_value(node.operand, depth + 1))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    a, b = _value(node.left, depth + 1), _value(node.right, depth + 1)
    if isinstance(node.op, ast.Pow):
      if abs(b) > MAX_EXPONENT or (abs(a) > 1 and abs(b) * math.log10(abs(a)) > 50):
        raise CalcError("the power is too large (exponents up to 64, results up to 1e50)")
      if a == 0 and b < 0:
        raise CalcError("zero cannot be raised to a negative power")
    if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
      raise CalcError("division by zero")
    return _bounded(_BINARY[type(node.op)](a, b))
  what = type(node).__name__
  raise CalcError(f"{what} is not allowed: use numbers, + - * / // % ** and parentheses")


def show(x) -> str:
  """A result as the tool returns it: integers exactly, floats to 12 significant digits."""
  if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
    x = int(x)
  return str(x) if isinstance(x, int) else f"{x:.12g}"


CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluates an arithmetic expression: numbers, + - * / // % ** and "
                   "parentheses.",
    "parameters": {"type": "object", "properties": {
        "expression": {"type": "string", "description": "e.g. \"123 * 45\""}},
        "required": ["expression"]}}}


class CalculatorEnv:
  """A question with a numeric answer and a calculator tool. Each turn with tool calls gets
  their results (role "tool"); a turn without any is the final answer, rewarded 1.0 when its
  answer (jaxrl.rewards.extract_answer: after "####" or "answer:", else the first line)
  equals the record's "answer", else 0. Malformed calls, calls to another tool and calls
  without a string "expression" are answered with an error and counted as bad."""

  tools = [CALCULATOR_TOOL]

  def reset(self, record: dict) -> list[dict]:
    self.answer = normalize_answer(record["answer"])
    if record.get("messages"):
      return [dict(m) for m in record["messages"]]
    return [{"role": "user", "content": record["prompt"]}]

  def step(self, messages, turn):
    calls, errors = turn.get("tool_calls") or [], list(turn.get("tool_call_errors") or [])
    if not calls and not errors:
      correct = extract_answer(turn["content"]) == self.answer
      return None, float(correct), True, {"correct": correct}
    obs, bad = [], len(errors)
    for call in calls:
      fn = call.get("function", call)
      expression = (fn.get("arguments") or {}).get("expression")
      if fn.get("name") != "calculator" or not isinstance(expression, str):
        bad += 1
        obs.append({"role": "tool", "content": "error: call calculator with a string "
                    "\"expression\", e.g. {\"name\": \"calculator\", \"arguments\": "
                    "{\"expression\": \"12 * 34\"}}"})
        continue
      try:
        obs.append({"role": "tool", "content": show(calculate(expression))})
      except CalcError as e:
        obs.append({"role": "tool", "content": f"error: {e}"})
    obs += [{"role": "tool", "content": f"error: {e}"} for e in errors]
    return obs, 0.0, False, {"tool_calls": len(calls) + len(errors), "bad_tool_calls": bad}


def tool_call_text(expression: str) -> str:
  """A calculator call as a model writes it in the Hermes format, in compact JSON (the fewest
  tokens for a byte-level model to learn)."""
  call = {"name": "calculator", "arguments": {"expression": expression}}
  return f"<tool_call>{json.dumps(call, separators=(',', ':'))}</tool_call>"


def demonstrations(task, split: str, n: int, seed: int, tool_rate: float) -> list[dict]:
  """SFT conversations {"messages"} on `n` of the task's records: a `tool_rate` share of them
  (drawn at random, seeded) call the calculator on the prompt's expression, read its result
  and answer with it; the rest answer at once, in the head, with the right answer (which a
  tiny model imitates only as well as it can multiply). A warm start for GRPO with the
  calculator environment, whose rollouts these are token for token (data.train_on=
  all_assistant renders them as the multi-turn driver does): the policy starts calling the
  tool on about tool_rate of its turns, and RL has the rest to learn."""
  if not 0.0 <= tool_rate <= 1.0:
    raise ConfigError(f"data.tool_rate={tool_rate!r} is not valid: give the share of "
                      "demonstrations that call the calculator, in [0, 1].")
  out = []
  rng = np.random.default_rng([int(seed), 104729, int(split == "test")])
  for r, u in zip(task.records(split, n, seed), rng.random(n)):
    user = {"role": "user", "content": r["prompt"]}
    answer = {"role": "assistant", "content": r["answer"]}
    if u < tool_rate:
      expression = r["prompt"].strip().removesuffix("=")
      out.append({"messages": [user, {"role": "assistant", "content": tool_call_text(expression)},
                               {"role": "tool", "content": show(calculate(expression))}, answer]})
    else:
      out.append({"messages": [user, answer]})
  return out

