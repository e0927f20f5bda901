"""The memory plan is each trainer's own: derived from its config, checked before step 1, and
within 15% of what XLA's memory_analysis() says the compiled programs need (CPU backend)."""

import dataclasses
import os

import jax
import pytest

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.parallel import compile as aot
from jaxrl.parallel import plan as plan_lib
from jaxrl.parallel.plan import estimate, plan_config
from jaxrl.algorithms import grpo, ppo
from jaxrl.algorithms import dpo, rm, sft
from jaxrl.train import programs as programs_lib
from jaxrl.train.run import check_plan

TRAINERS = {"sft": sft, "rm": rm, "dpo": dpo, "grpo": grpo, "ppo": ppo}


def _config(repo_root, name, *overrides):
  module = TRAINERS[name]
  return config_lib.load_config(os.path.join(repo_root, f"configs/{name}_tiny.py"),
                                list(overrides), module.CHOICES)


def test_the_plan_section_has_no_knob_a_trainer_does_not_read():
  # Rows, lengths, remat, the reference and the KV cache come from the trainer's sections;
  # topology is the slice `jaxrl plan` plans off TPU (the run itself has its devices).
  assert set(plan_config().keys()) == {"device", "device_gib", "check", "topology"}


@pytest.mark.parametrize("name", list(TRAINERS))
def test_plan_is_within_15_percent_of_xla_on_cpu(repo_root, devices, name):
  """Every program the tiny config's trainer compiles, on 8 CPU devices: the plan's peak per
  device (arguments + outputs - donated + temporaries, plus what stays resident) against the
  same sum from XLA's memory_analysis() of the compiled program; and the train step alone."""
  work, programs = TRAINERS[name].programs(_config(repo_root, name))
  estimates = [estimate(p) for p in programs]
  compiled = [aot.compile_program(p) for p in programs]
  plan, xla = aot.run_peaks(programs, estimates, compiled)
  assert abs(plan - xla) / xla < 0.15, (plan, xla)
  step = programs[0]
  assert step.kind == "train" and step.name == "train step"
  assert abs(estimates[0].program_peak - compiled[0].bytes) / compiled[0].bytes < 0.15, (
      estimates[0], compiled[0])
  # The workload is read from the trainer's own sections.
  if name == "grpo":
    c = _config(repo_root, name)
    assert work.reference and work.slots == c.rollout.slots
    assert [p.name for p in programs] == ["train step", "logprob forward", "prefill",
                                         "decode steps", "weight sync"]


def test_the_plan_follows_the_trainers_config(repo_root, devices):
  """Twice the rows per device: more temporaries; accumulation over 2 micro-batches: fewer."""
  base = estimate(sft.programs(_config(repo_root, "sft"))[1][0])
  more = estimate(sft.programs(_config(repo_root, "sft", "data.batch_size=128"))[1][0])
  accum = estimate(sft.programs(_config(repo_root, "sft", "data.batch_size=128",
                                        "optim.accum_steps=2"))[1][0])
  assert more.temp > 1.5 * base.temp - base.argument
  assert accum.temp < more.temp


def test_a_run_stops_before_step_1_when_the_plan_does_not_fit(repo_root, devices):
  config = _config(repo_root, "sft", "plan.device_gib=0.001")
  with pytest.raises(ConfigError, match=r"this sft run will not fit: its train step needs "
                                        r".* per device by the memory plan"):
    check_plan(config, sft.programs, what="this sft run")
  said = []
  check_plan(_config(repo_root, "sft", "plan.device_gib=0.001", "plan.check=False"),
             sft.programs, what="this sft run", say=said.append)
  assert said == []  # skipped
  # On CPU with no device named there is nothing to check against: the tiny configs start.
  check_plan(_config(repo_root, "grpo"), grpo.programs, what="this grpo run", say=said.append)
  check_plan(_config(repo_root, "grpo", "plan.device=tpu-v5e"), grpo.programs,
             what="this grpo run", say=said.append)
  assert len(said) == 1 and "of 16.000 GiB per device" in said[0]


def test_when_the_plan_refuses_on_accelerators_xla_decides(repo_root, devices):
  """The plan errs on the safe side (by up to ~25% on v6e), so where it refuses a run on
  accelerators, the start-up check compiles the run's programs and XLA's peaks decide. Here on
  CPU (compile_check=True stands for a TPU's devices) a plan made to over-count the SFT train
  step's logits 100-fold refuses a device that XLA's compile fits, and XLA's own figure refuses
  a device it does not."""
  def over(config):
    work, progs = sft.programs(config)
    return work, [dataclasses.replace(p, vocab=100 * p.vocab) if p.kind == "train" else p
                  for p in progs]
  config = _config(repo_root, "sft", "plan.device_gib=0.03")
  work, progs = over(config)
  estimates = [estimate(p) for p in progs]
  xla = max(c.bytes + e.resident for c, e in zip(map(aot.compile_program, progs), estimates))
  plan = max(e.peak for e in estimates)
  assert xla < 0.03 * plan_lib.GIB < plan  # the case: the plan says no, XLA says yes
  with pytest.raises(ConfigError, match=r"by the memory plan"):  # on CPU: the plan alone
    check_plan(config, over, what="this sft run")
  said = []
  check_plan(config, over, what="this sft run", say=said.append, compile_check=True)
  assert "compiling the run's 1 programs to ask XLA" in said[0]
  assert said[-1].startswith("memory: XLA's compile of the train step peaks at") and (
      said[-1].endswith("it fits"))
  small = _config(repo_root, "sft", f"plan.device_gib={0.5 * xla / plan_lib.GIB}")
  with pytest.raises(ConfigError, match=r"this sft run will not fit: XLA's compile of its train "
                                        r"step holds .* GiB per device"):
    check_plan(small, over, what="this sft run", say=said.append, compile_check=True)


def test_jaxrl_plan_prints_the_trainers_programs(repo_root, devices, capsys):
  from jaxrl import cli
  cli.main(["plan", "--config", os.path.join(repo_root, "configs/dpo_tiny.py")])
  out = capsys.readouterr().out
  assert "memory plan by program" in out and "train step" in out
  assert "reference forward" in out  # dpo_tiny's ref.mode=auto resolves to live here
  with pytest.raises(SystemExit):
    cli.main(["plan", "--config", os.path.join(repo_root, "configs/sync_tiny.py")])
  assert "jaxrl plan reads a trainer's config" in capsys.readouterr().err


@pytest.mark.parametrize("overrides", [["optim.accum_steps=2"],
                                       ["algo.minibatches=2", "optim.accum_steps=2"]])
def test_grpo_logprob_forward_is_planned_per_micro_batch(repo_root, devices, overrides):
  """The reference / old-policy forward runs in the update's micro-batches (minibatches x
  accum_steps): the plan counts one micro-batch's rows, stays within 15% of XLA, and XLA's
  own temporaries shrink against the forward over the whole step in one call."""
  from jaxrl.models import abstract_model
  from jaxrl.algorithms.grpo.update import make_batch_logprobs_fn, old_logp_from_update
  config = _config(repo_root, "grpo", *overrides)
  _, programs = grpo.programs(config)
  fwd = programs[1]
  assert fwd.name.startswith("logprob forward")
  N = config.rollout.prompts_per_step * config.rollout.group_size
  assert fwd.rows == N // (8 * config.algo.minibatches * config.optim.accum_steps)
  e, x = estimate(fwd), aot.compile_program(fwd)
  assert abs(e.program_peak - x.bytes) / x.bytes < 0.15, (e, x)
  # The same forward in one call over the step (as before): more temporaries by XLA's count.
  graphdef = abstract_model(config_lib.model_config(config))[0]
  mesh = jax.tree.leaves(fwd.args[1])[0].sharding.mesh
  whole = dataclasses.replace(fwd, fn=make_batch_logprobs_fn(
      graphdef, config.rollout.temperature, mesh=mesh,
      entropy=not old_logp_from_update(config.algo)))
  assert aot.compile_program(whole).temp > x.temp


def test_grpo_reward_forward_is_a_program(repo_root, devices, tmp_path):
  """With reward models configured, their forward is one of GRPO's programs (the jit
  RewardModels.score runs; an RM not trained yet is planned with the policy's shapes), its
  estimate within 15% of XLA on CPU, with the policy, the reference and (colocated) the
  sampler's weights resident beside it."""
  rms = f"{tmp_path}/rm_a,{tmp_path}/rm_b"
  config = _config(repo_root, "grpo", f"reward_model.checkpoints={rms}")
  _, programs = grpo.programs(config)
  assert [p.name for p in programs] == ["train step", "logprob forward", "reward forward",
                                       "prefill", "decode steps", "weight sync"]
  rm = programs[2]
  assert len(rm.args[0]) == 2 and rm.kind == "forward"
  assert set(rm.resident) == {"actor params + optimizer state", "reference params",
                              "sampler weights"}
  e, x = estimate(rm), aot.compile_program(rm)
  assert abs(e.program_peak - x.bytes) / x.bytes < 0.15, (e, x)
  # The RMs' params are the program's arguments, not resident beside it (as they are beside
  # the update).
  assert not any(k.startswith("reward model") for k in rm.resident)
  assert any(k.startswith("reward model") for k in programs[0].resident)


@pytest.mark.parametrize("name,overrides", [
    ("sft", ["model.remat=full"]), ("grpo", ["model.remat=full", "model.dtype=bfloat16"]),
    ("dpo", []), ("ppo", [])])
def test_residuals_traced_over_two_blocks_equal_the_whole_models(repo_root, devices,
                                                                 monkeypatch, name, overrides):
  """The plan traces a model's backward residuals over its first one and two blocks and
  extrapolates to its depth (plan.residual_bytes with depth): every program's per-block
  bytes and peak equal the whole model's trace, at 5 blocks, with and without remat, in
  float32 and bfloat16. (benchmarks/results/scale.jsonl's 58 real-size rows were checked
  equal the same way when it came in.)"""
  config = _config(repo_root, name, "model.num_layers=5", *overrides)
  cut = [(p.layer_bytes, estimate(p).peak) for p in TRAINERS[name].programs(config)[1]]
  whole = plan_lib.residual_bytes
  def untruncated(*args, depth=0, **kw):
    return whole(*args, **kw)
  monkeypatch.setattr(plan_lib, "residual_bytes", untruncated)
  monkeypatch.setattr(programs_lib, "residual_bytes", untruncated)
  full = [(p.layer_bytes, estimate(p).peak) for p in TRAINERS[name].programs(config)[1]]
  assert cut == full
  assert any(b for b, _ in cut)  # a program with per-block bytes was compared


def test_planning_a_program_leaves_what_it_compiles_whole(repo_root, devices):
  """The plan traces some programs' pieces through their first blocks (llama.first_layers, a
  context variable that jit's trace cache does not key on): a program it then compiles, as
  `jaxrl plan --compile` and benchmarks/scale.py do, must still run every block. Before, the
  train step's outputs were traced through one block by the jitted step itself, and a deeper
  model's compile after its plan was a one-block train step."""
  config = _config(repo_root, "grpo", "model.num_layers=3", "model.remat=full")
  def dots(programs):
    return [p.fn.lower(*p.args).as_text().count("dot_general") for p in programs]
  planned = grpo.programs(config)[1]
  for p in planned:
    estimate(p)
  assert dots(planned) == dots(grpo.programs(config)[1])
