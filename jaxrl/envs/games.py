"""A verifiable multi-turn game: guess the number.

The record's "answer" is the secret (the `guess` task draws them: jaxrl.tasks). Each turn the
model names a number; the environment answers "higher" or "lower" as a user turn, and the
conversation ends with reward 1.0 on the secret (0 when rollout.max_turns runs out first). A
turn without a number is told so and costs the turn.
"""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


class GuessNumberEnv:
  tools = None

  def reset(self, record: dict) -> list[dict]:
    self.secret = int(record["answer"])
    return [{"role": "user", "content": record["prompt"]}]

  def step(self, messages, turn):
    m = _INT.search(turn["content"])
    if m is None:
      return [{"role": "user", "content": "say a number"}], 0.0, False, {}
    guess = int(m.group())
    if guess == self.secret:
      return None, 1.0, True, {"correct": True}
    return ([{"role": "user", "content": "higher" if guess < self.secret else "lower"}],
            0.0, False, {})
