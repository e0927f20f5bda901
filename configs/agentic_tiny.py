"""Multi-turn GRPO with a tool: the calculator environment on 2-3 digit products, tiny model.

    jaxrl grpo --config configs/agentic_tiny.py:runlocal --workdir /tmp/agentic   # a pulse
    jaxrl sft --config configs/agentic_tiny.py:sft --workdir runs/calc_sft          # warm start
    jaxrl grpo --config configs/agentic_tiny.py --config.init.checkpoint=runs/calc_sft \
        --workdir runs/calc_grpo

Each conversation is the product ("123*45="), up to max_turns model turns, each of which may
call the calculator in the Hermes format (<tool_call>{"name": "calculator", "arguments":
{"expression": "123*45"}}</tool_call>); the environment answers every call, and a turn without
one is the final answer, rewarded 1 when right (docs/guides/agentic.md). The held-out eval is
the same conversation, greedy, on the task's test split (eval/accuracy, eval/tool_calls/mean).

The recipe: the tiny byte-level model never writes a well-formed call by chance, so `:sft`
warm-starts it on calculator conversations, 15% of them calling the tool; greedy it then
answers in its head (held-out accuracy about 0.02), and 30 GRPO steps teach it to call the
tool (seed 0 on an AVX2 CPU: eval/accuracy 0.016 -> 0.492, eval/tool_calls/mean 0 -> 0.94; 12
cells of ISA x dot kernel x seed, +0.344 to +0.742, are in docs/guides/agentic.md).

arg: "" (calculator), "sft" (the warm start, an SFT config), "runlocal" (2 steps), "guess" (the
guess_number game, no tools).
"""

from jaxrl.algorithms.grpo import default_config


def sft_config():
  """The warm start: SFT of the tiny model on calculator conversations, 15% of them calling
  the tool (jaxrl.envs.calculator.demonstrations), so the policy calls it on few turns. 800
  steps of 16 packed rows: fewer (400 of 8) left the calls' operands miscopied."""
  from jaxrl.algorithms.sft import default_config as sft_default
  c = sft_default()
  c.model.preset = "tiny"
  c.data.update(task="multiply", tool_rate=0.15, train_on="all_assistant", seq_len=256,
                packing=True, batch_size=16, train_examples=20_000)
  c.optim.update(lr=3e-3, warmup_steps=30, schedule="cosine", clip_norm=1.0)
  c.train.update(steps=800, log_every=100, save_every=800)
  c.eval.update(every=0, examples=128)
  return c


def get_config(arg=None):
  if arg == "sft":
    return sft_config()
  c = default_config()  # every field, with what it means: jaxrl/algorithms/grpo/config.py
  c.data.update(task="multiply", env="calculator")
  c.rewards = "env"
  # A turn holds a whole call (about 80 bytes); a call, its result and the answer fit in 160.
  # grow_cache=False: the KV cache allocated whole (433 positions), for the rollouts and the
  # held-out eval alike. The tiny model's rollouts are compile-bound: a growing window compiled
  # decode, grow and extend again at every size it reached (24 to 192 positions). The same
  # tokens and figures, in less time (tests/test_agentic.py's learning test).
  c.rollout.update(prompts_per_step=8, group_size=4, max_new_tokens=96, max_turns=2,
                   max_conversation_tokens=160, slots=32, grow_cache=False)
  c.optim.lr = 2e-4
  # 30 steps and 128 held-out conversations, not 20 and 64: how well the warm start copies
  # numbers (the call's operands, the result into the answer) changes with its float rounding,
  # and 20 steps left an Intel Xeon's run at +0.219 (tests/test_agentic.py's cells).
  c.train.update(steps=30, log_every=5, save_every=30)
  c.eval.update(every=15, examples=128)
  if arg == "runlocal":
    c.rollout.update(prompts_per_step=2, group_size=4, slots=8, max_new_tokens=16, max_turns=3,
                     max_conversation_tokens=64)
    c.train.update(steps=2, log_every=1, save_every=2)
    c.eval.examples = 8
  elif arg == "guess":
    c.data.update(task="guess", env="guess_number")
    c.rollout.update(max_new_tokens=4, max_turns=6, max_conversation_tokens=96)
  elif arg not in (None, ""):
    raise ValueError(f"unknown arg {arg!r}: use '', sft, runlocal or guess")
  return c
