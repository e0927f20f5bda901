"""GRPO's config: every field a run reads (default_config) and the algorithm's knobs
(algo_section), with what each one means."""

from __future__ import annotations

import ml_collections

from jaxrl import config as config_lib
from jaxrl.data.prompts import prompt_section
from jaxrl.errors import ConfigError
from jaxrl.rewards import model as rm_lib
from jaxrl.sampler.scheduler import ADMISSIONS
from jaxrl.objectives import advantages as adv_lib
from jaxrl.objectives import losses
from jaxrl.train.optim import CHOICES as OPTIM_CHOICES

# The estimators that compare a completion with the others of its group: a group of one has no
# baseline (grpo's unbiased std and rloo's leave-one-out divide by G - 1; the others give 0).
GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


def check_rollout(config) -> None:
  """The rollout section's ranges, at config load."""
  r = config.rollout
  config_lib.check_at_least(config, 1, "rollout.prompts_per_step", "rollout.group_size",
                            "rollout.max_new_tokens", "rollout.slots", "rollout.steps_per_call",
                            "rollout.max_staleness", "rollout.page_size")
  config_lib.check_at_least(config, 0, "rollout.top_k", "rollout.prompt_len", "rollout.kv_pages",
                            "rollout.max_conversation_tokens", "rollout.env_workers")
  config_lib.check_at_least(config, 1, "rollout.max_turns")
  config_lib.check_positive(config, "rollout.temperature", example="1.0")
  config_lib.check_unit(config, "rollout.top_p", off="1.0 turns it off")
  advantage = config.get("algo", {}).get("advantage")
  if advantage in GROUP_RELATIVE and r.group_size < 2:
    raise ConfigError(f"rollout.group_size={r.group_size} is too small for "
                      f"algo.advantage={advantage!r}, which compares each completion with the "
                      "others of its group: set --config.rollout.group_size to 2 or more (or "
                      "use algo.advantage=reinforce_pp, which needs no group).")


def ref_dtype(config) -> str:
  """placement.ref_dtype, the frozen reference's dtype ("": the learner's own). With LoRA the
  reference is the policy's own frozen base, not a copy, so there is nothing to cast."""
  dtype = config.get("placement", {}).get("ref_dtype", "")
  if dtype and int(config.model.lora.rank):
    raise ConfigError(f"placement.ref_dtype={dtype!r} casts a full fine-tune's copy of the "
                      f"reference, but model.lora.rank={int(config.model.lora.rank)}: with LoRA "
                      "the reference is the policy's own frozen base (no copy); set "
                      "--config.placement.ref_dtype=''.")
  return dtype


def check_algo(config) -> None:
  """The algo section's ranges, at config load: at least one pass and one minibatch per step
  (each divides the rollouts); clip ranges, KL and entropy weights are not negative (0 = off)."""
  config_lib.check_at_least(config, 1, "algo.num_iterations", "algo.minibatches",
                            "algo.kl_horizon")
  config_lib.check_at_least(config, 0, "algo.eps_low", "algo.eps_high", "algo.beta",
                            "algo.kl_target", "algo.adv_clip", "algo.tis_cap",
                            "algo.max_refill_rounds")


# This trainer's keys with fixed choices, checked when a run starts (config.validate); sections
# mapped to a function have their ranges checked there.
CHOICES = {
    "rollout": check_rollout,
    "rollout.kv_cache": ("dense", "paged"),
    "rollout.kv_admission": ADMISSIONS,
    "algo": check_algo,
    **OPTIM_CHOICES,
    "algo.advantage": adv_lib.ESTIMATORS,
    "algo.aggregation": losses.AGGREGATIONS,
    "algo.kl_estimator": ("k1", "k2", "k3"),
    "algo.kl_in": ("loss", "reward"),
    "algo.ratio_level": ("token", "sequence"),
    "reward_model.ensemble": rm_lib.ENSEMBLES,
}


def algo_section(**overrides) -> ml_collections.ConfigDict:
  """The algorithm's knobs. Defaults are GRPO with DAPO's token-mean and no clip-higher."""
  c = ml_collections.ConfigDict(dict(
      advantage="grpo",          # grpo | dr_grpo | rloo | reinforce_pp | reinforce_pp_baseline
      adv_clip=5.0,
      eps_low=0.2,
      eps_high=0.2,              # > eps_low is DAPO's clip-higher
      dual_clip_c=0.0,           # > 1 enables dual-clip; 0 = off
      ratio_level="token",       # "sequence" = GSPO
      aggregation="token-mean",
      beta=0.04,                 # KL coefficient in the loss; 0 still measures KL (alarms)
      kl_estimator="k3",
      kl_clamp=10.0,
      kl_in="loss",              # or "reward"
      kl_target=0.0,             # > 0: adaptive KL controller toward this target
      kl_horizon=10_000,
      entropy_coef=0.0,
      num_iterations=1,          # passes over each step's rollouts (mu in the GRPO paper)
      minibatches=1,             # optimizer updates per pass
      filter_zero_std=False,     # dynamic sampling: drop all-equal groups, refill the batch
      max_refill_rounds=3,
      mask_truncated=False,      # completions cut at max_new_tokens carry no loss
      tis_cap=0.0,               # > 0: truncated IS correction of sampler/learner mismatch
      # With one update per step and KL in the loss, take the old log-probs from the update's
      # own forward (stop_gradient) instead of a separate forward; False always runs one.
      old_logp_from_update=True,
      # The learner's forwards run each group's prompt once and its G completions against it
      # (instead of G joined copies), when prompts_per_step divides by minibatches x replicas;
      # minibatches then hold whole groups.
      shared_prompt_forward=True,
      # With the shared-prompt forward, also pack the completions end to end into rows below
      # their prompts (packing.pack_completions): the learner's forwards skip the padding a
      # long tail of completion lengths leaves. Attention takes the XLA path then.
      pack_completions=False,
  ))
  c.update(overrides)
  return c


def default_config():
  """Every field a GRPO run reads, with the defaults configs/grpo_tiny.py starts from."""
  from jaxrl.parallel.distributed import distributed_section
  from jaxrl.parallel.plan import plan_config
  from jaxrl.parallel.sync import placement_config
  from jaxrl.train.optim import optim_section
  c = config_lib.base_config()
  c.model.preset = "tiny"
  c.init = ml_collections.ConfigDict(dict(checkpoint=""))  # an SFT run dir to start from
  # train_file / eval_file: {"prompt", "answer"} or {"messages", "answer"} rows.
  c.data = ml_collections.ConfigDict(dict(
      task="addition", train_file="", eval_file="", train_examples=20_000, on_bad_row="error",
      # source column -> record field, e.g. {"question": "prompt"} for GSM8K; files may be
      # .jsonl, .parquet, .arrow or a save_to_disk directory (jaxrl/data/files.py)
      fields=None,
      # A built-in environment for multi-turn / tool-use rollouts (jaxrl.envs: calculator,
      # guess_number; docs/guides/agentic.md); "" is single-turn. The records (data.task or
      # train_file) are what its reset() reads. Needs rewards="env".
      env="",
      **prompt_section()))  # chat, chat_template_kwargs, system_prompt: jaxrl.data.prompts
  # Your own environment instead: a Python file defining make_env() (docs/guides/agentic.md).
  c.env_module = ""
  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=16, group_size=8, max_new_tokens=8, temperature=1.0, top_k=0,
      top_p=1.0, slots=64, steps_per_call=8,
      # Prompt tokens every prompt is padded to (rounded up to a power of two); a longer
      # prompt stops the run. 0: the data's longest prompt, rounded up the same way.
      prompt_len=0,
      ignore_eos=False,  # True: every completion runs to max_new_tokens (benchmarks)
      # True: the KV cache's window grows with the longest live sequence (fewer reads per
      # decode step, up to two decode compiles per doubling); False: allocated whole, one
      # compile (where compiles are slow, e.g. large models on TPU, or tiny models on CPU).
      # The held-out eval's sampling and conversations take it too.
      grow_cache=True,
      # "dense": one [slots, window] KV cache; "paged": a pool of kv_pages pages of page_size
      # positions, a group's prompt pages shared by its samples (docs/design.md, "The paged KV
      # cache"; the same samples). kv_pages 0: enough for every slot at max_len.
      kv_cache="dense", kv_pages=0, page_size=16,
      # With kv_cache="paged", when a sample is admitted to a slot: "optimistic" while the free
      # pages hold its prompt and its first decode call, preempting (and later regenerating,
      # the same tokens) the newest samples when the live ones outgrow the pool; "reserve" only
      # while the pages no live sample may still need hold its worst case (prompt +
      # max_new_tokens): never a preemption, fewer live samples. The same with kv_pages 0.
      kv_admission="optimistic",
      # True: a producer thread keeps generating on the sampler devices into a bounded queue
      # while the learner updates on its own (off-policy by up to max_staleness versions,
      # corrected by algo.tis_cap when > 0). Needs placement.mode="disaggregated".
      async_generation=False,
      # With async_generation: how many policy versions a group may lag the step that trains
      # on it (k). Step n's groups are sampled with version n - k's weights (reproducible, not
      # "the newest at hand"); 1 is one-step overlap. Up to k + 1 sampler copies are alive.
      max_staleness=1,
      # With async_generation: a sequence in flight when newer weights are published continues
      # under them from the next decode call (its KV cache as written; each token keeps its
      # own sampler log-prob and version, and algo.tis_cap corrects per token). Fresher, but
      # the switch points follow thread timing: reproducible only with frozen weights.
      partial_rollouts=False,
      # With partial_rollouts: one streaming driver keeps the sampler's slots busy across
      # units, the next unit's groups taking the slots the current one's short completions
      # free (jaxrl/algorithms/grpo/producer.py, "Streaming"); a group's tokens are the same as
      # without it for the same weights. Dense KV cache, one process.
      streaming=False,
      # With an environment (data.env or env_module): model turns per conversation, and the
      # tokens a conversation may hold after its prompt, model and tool tokens together (the
      # learner batch's completion width; 0: 2 x max_turns x max_new_tokens). max_new_tokens
      # is then per turn. env_workers: threads stepping environments while the other slots
      # keep decoding (0: between decode calls, in the sampler's own loop).
      max_turns=1, max_conversation_tokens=0, env_workers=8))
  c.algo = algo_section()
  c.rewards = "task"  # "task" = the task's checker; else e.g. "exact_match:1.0,format:0.1";
                      # "none" (or "task:0", which still logs `accuracy`) with a reward model
  c.reward_model = rm_lib.reward_model_section()
  c.reward_kwargs = {}  # per reward, e.g. {"format": {"pattern": r"^\d+$"}}
  c.normalize_rewards = False
  # lr 5e-5 on the tiny preset: one draw from a 600-step SFT policy rose 0.711 -> 0.781 in 80
  # steps at KL <= 0.04, and 2e-4 and above drifted (KL > 0.1) and lost accuracy; over GRPO seeds
  # 0-4 from the stronger sft_tiny policy (0.87-0.97) it holds accuracy within 0.043 and does
  # not raise it (docs/guides/recipes.md).
  c.optim = optim_section(lr=5e-5, schedule="constant", warmup_steps=0, weight_decay=0.0,
                          clip_norm=1.0)
  c.train = ml_collections.ConfigDict(dict(
      steps=80, log_every=5, save_every=20, keep_checkpoints=2, async_checkpoints=True))
  # Held-out eval every `every` steps on data.eval_file (else data.task's test split,
  # `examples` prompts): greedy accuracy, and with n > 0 pass@k / mean@k / maj@k from n samples
  # (jaxrl.evals; the keys are jaxrl.config.eval_keys'). max_new_tokens 0: rollout's.
  c.eval = ml_collections.ConfigDict(dict(every=20, examples=256, batch_size=128,
                                          max_new_tokens=0, **config_lib.eval_keys()))
  # Alarms: KL above kl_threshold; reward (mean over the last `window` steps; the raw reward-model
  # score when there is one) rising between an eval and the latest one at least `window` steps
  # before it, while held-out accuracy falls by more than min_accuracy_drop.
  c.alarm = ml_collections.ConfigDict(dict(kl_threshold=0.1, window=20, min_accuracy_drop=0.03))
  c.placement = placement_config()
  c.distributed = distributed_section()
  c.plan = plan_config()  # the device the trainer's memory plan is checked against
  return c


def conversation_tokens(config) -> int:
  """The tokens a multi-turn conversation may hold after its prompt (model and tool tokens):
  rollout.max_conversation_tokens, or 2 x max_turns x max_new_tokens when it is 0."""
  r = config.rollout
  return int(r.get("max_conversation_tokens", 0) or 2 * r.get("max_turns", 1)
             * r.max_new_tokens)


def prompt_length(config, longest: int) -> int:
  """The prompt width of the sampler and the learner batch: rollout.prompt_len (or, when 0, the
  data's `longest` prompt) rounded up to a power of two; one sentence when a prompt is longer."""
  from jaxrl.sampler import bucket
  want = int(config.rollout.get("prompt_len") or 0)
  if want and longest > want:
    raise ConfigError(f"a prompt has {longest} tokens, more than rollout.prompt_len={want}: "
                      "raise it (or set 0 to follow the data), or shorten the prompts.")
  return bucket(want or longest)


def grouped_forward(config, replicas: int, out) -> bool:
  """Whether the learner runs each group's prompt once (algo.shared_prompt_forward): its
  micro-batches must hold whole groups (make_train_step's units). Checks the split first."""
  a, r, accum = config.algo, config.rollout, config.optim.accum_steps
  N = r.prompts_per_step * r.group_size
  split = a.minibatches * replicas * accum  # rows of one micro-batch on one device: N / split
  if accum < 1 or N % split:
    raise ConfigError(
        f"rollout.prompts_per_step x rollout.group_size = {N} is not divisible by "
        f"algo.minibatches x replicas x optim.accum_steps = {a.minibatches} x {replicas} x "
        f"{accum}: adjust them.")
  grouped = bool(a.shared_prompt_forward) and r.prompts_per_step % split == 0
  pack = bool(a.pack_completions)
  if pack and not a.shared_prompt_forward:
    raise ConfigError(
        "algo.pack_completions packs each group's completions below its shared prompt, but "
        "algo.shared_prompt_forward=False: set it True or pack_completions=False.")
  if a.shared_prompt_forward and not grouped:
    out(f"shared-prompt forward off: rollout.prompts_per_step={r.prompts_per_step} is not "
        f"divisible by algo.minibatches x replicas x optim.accum_steps = {split}, so each "
        f"completion runs with its own copy of its prompt" +
        (" and algo.pack_completions is off with it" if pack else ""))
  return grouped
