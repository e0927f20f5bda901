"""`jaxrl plan --compile`: the trainers' programs compile for a TPU topology on this CPU machine
(libtpu, a test dependency), and the memory plan is within 15% of XLA's figures there too."""

import json
import os
import sys

import jax
import pytest

from jaxrl import config as config_lib
from jaxrl.errors import ConfigError
from jaxrl.parallel import compile as aot
from jaxrl.parallel.plan import estimate
from jaxrl.algorithms import grpo, ppo
from jaxrl.algorithms import dpo, rm, sft

pytest.importorskip("libtpu", reason='libtpu is in the test extra: pip install -e ".[test]"')

TRAINERS = {"sft": sft, "rm": rm, "dpo": dpo, "grpo": grpo, "ppo": ppo}


@pytest.fixture(scope="module")
def v5e_2x2():
  return aot.topology_devices("v5e:2x2")


@pytest.mark.parametrize("name", list(TRAINERS))
def test_tiny_programs_compile_for_v5e_within_15_percent(repo_root, v5e_2x2, name):
  module = TRAINERS[name]
  config = config_lib.load_config(os.path.join(repo_root, f"configs/{name}_tiny.py"),
                                  choices=module.CHOICES)
  _, programs = module.programs(config, devices=v5e_2x2)
  estimates = [estimate(p) for p in programs]
  compiled = [aot.compile_program(p) for p in programs]
  plan, xla = aot.run_peaks(programs, estimates, compiled)
  assert abs(plan - xla) / xla < 0.15, (plan, xla)
  chip = aot.chip_of("v5e:2x2")
  for p, c in zip(programs, compiled):
    if p.kind != "sync":  # (a reshard without a cast does no arithmetic)
      assert c.flops > 0 and c.seconds(chip) > 0, p.name  # the cost model saw the program
  assert all(x.platform == "tpu" for x in v5e_2x2)


def test_the_compilers_estimate_counts_every_micro_batch(repo_root, v5e_2x2):
  """XLA's cost analysis counts a loop's body once: the tiny GRPO train step over 1 and over 4
  micro-batches of the same size (4x the rows) has the same flops by its count. libtpu's
  estimated cycles summed with each loop's body times its trip count (Compiled.cycles) grow
  with the work: 3.63x (1.91x at 2; the optimizer's update, outside the loop, runs once)."""
  figs = {}
  for accum in (1, 4):
    config = config_lib.load_config(os.path.join(repo_root, "configs/grpo_tiny.py"), [
        f"optim.accum_steps={accum}", f"rollout.prompts_per_step={4 * accum}",
        "algo.minibatches=1"], choices=grpo.CHOICES)
    _, programs = grpo.programs(config, devices=v5e_2x2)
    figs[accum] = aot.compile_program(programs[0])
  assert figs[1].loops == 0 and figs[4].loops >= 1
  assert figs[4].flops < 1.05 * figs[1].flops  # the loop's body once
  assert 3.0 < figs[4].cycles / figs[1].cycles < 4.0


def test_grpo_sync_compiles_where_the_two_meshes_order_the_chips_differently(repo_root):
  """On a 3-D slice (v5p:2x2x1) the learner's fsdp=4 mesh lists the chips 0, 2, 1, 3 and a
  colocated sampler's 2x2 mesh 0, 1, 2, 3; a program over both orders is refused by jit
  ("incompatible devices"), which stopped `qwen3.py:0.6b,grpo,v5p` at its weight sync."""
  devices = aot.topology_devices("v5p:2x2x1")
  config = config_lib.load_config(os.path.join(repo_root, "configs/grpo_tiny.py"), [
      "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=1", "placement.mode=colocated",
      "placement.sampler_mesh.data=2", "placement.sampler_mesh.tensor=2"],
      choices=grpo.CHOICES)
  _, programs = grpo.programs(config, devices=devices)
  sync = next(p for p in programs if p.kind == "sync")
  learner = [d.id for d in programs[0].args[0].params["embed"].sharding.mesh.devices.flat]
  sampler = [d.id for d in jax.tree.leaves(sync.fn.eval_shape(*sync.args))[0]
             .sharding.mesh.devices.flat]
  assert learner == [0, 2, 1, 3]  # the case this test is about (libtpu's order for the ring)
  c = aot.compile_program(sync)
  assert c.output > 0 and sampler == learner


def test_grpo_decode_loop_copies_no_kv_cache_on_tpu(repo_root, v5e_2x2, monkeypatch):
  """The sampler's decode loop compiled for TPU holds no copy of a cache-sized array. With each
  slot's new keys and values written as one [K, H] window, XLA:TPU kept the cache S-major for
  the scatter and copied every layer's keys and values for attention on each step, wherever a
  chip holds more than one KV head (jaxrl.backends.writes_cache_per_head: Qwen3-0.6B on v5e-8,
  one step 22.8 -> 5.1 GB by XLA's count). Here 2 KV heads per chip: 12 copies that way."""
  import jax
  import jaxrl.sampler.engine as engine

  def copies():
    config = config_lib.load_config(os.path.join(repo_root, "configs/grpo_tiny.py"),
                                    choices=grpo.CHOICES)
    _, programs = grpo.programs(config, devices=v5e_2x2)
    p = next(p for p in programs if p.name == "decode steps")
    shapes = {",".join(map(str, x.sharding.shard_shape(x.shape)))
              for x in jax.tree.leaves(p.args[1]) if x.ndim == 4}
    assert {s.split(",")[1] for s in shapes} == {"2"}  # the case: 2 KV heads on a chip
    text = p.fn.lower(*p.args).compile().as_text()
    return sum(" copy(" in line and any(f"[{s}]" in line for s in shapes)
               for line in text.splitlines())

  assert copies() == 0
  monkeypatch.setattr(engine, "writes_cache_per_head", lambda devices: False)
  assert copies() > 0  # the window form, as before: the check can see a copy

def _recorded():
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "benchmarks", "results", "scale.jsonl")
  with open(path) as f:
    return {r["row"]: r for r in map(json.loads, filter(str.strip, f))}


# Rows where the plan misses XLA by more than 15%, measured and open (strict: a fix shows).
KNOWN_MISSES = {
    # (qwen3:4b,grpo,v5e left this list when re-compiled with the collective matmul off: its
    # train step 17.2 -> 14.6 GiB against the plan's 13.1; the run's peak 18.1 against 18.7.)
    # The plan is 32% over XLA's train step (8.18 GiB against 6.18) and 23% over
    # the run's peak (9.35 against 7.57), compiled with the collective matmul off, which took
    # the early buffer allocations the plan's terms had been calibrated against out of the
    # program (scale.md). Conservative, so it never passes a run that does not fit; recalibrating
    # the train step's terms on compiles without the collective matmul is open.
    "llama3:3.1-8b,grpo,v5e,qlora",
    # The v6e rows, compiled with both windowed einsums off (jaxrl.backends.tpu: with the
    # reduce-scatter's on, which libtpu enables on v6e, the SFT step held 22.98 GiB and the
    # GRPO step ran out of the 32 GiB). Now the plan is over XLA, the safe direction: SFT 7.92
    # GiB against 6.16 (+29%), GRPO's run peak 11.87 against 9.53 (+25%), where the same
    # programs on v5e-8 compile to 7.23 and 10.54: v6e's compiler holds less than v5e's, which
    # the plan's terms (calibrated on v5e) do not model. The other v6e SFT rows alike, train step
    # planned against compiled: Qwen3-1.7B 12.73 against 9.74 GiB (+31%), Qwen2.5-1.5B 10.80
    # against 8.39 (+29%), Llama-3.2-1B 13.62 against 11.39 (+20%) at one micro-batch;
    # Qwen2.5-7B 28.66 against 23.86 (+20%), Llama-3.1-8B 29.71 against 25.46 (+17%), Qwen3-8B
    # 30.77 against 26.60 (+16%) at eight; the rows at four micro-batches are within the bar
    # (Qwen3-4B +2.5%, Llama-3.2-3B +4.8%). Not one term: Qwen3-1.7B's SFT step cut to 4 and 8
    # layers compiles to 5.27 / 5.60 GiB of temporaries on v5e and 4.80 / 5.12 on v6e, the same
    # 0.08 GiB per layer on both chips, where the 28-layer step holds 9.93 on v5e and 7.33 on v6e:
    # v5e's compile holds ~2.7 GiB beyond its per-layer slope at full depth, v6e's ~0.6. The
    # plan's terms follow v5e's (scale.md).
    "qwen3:0.6b,sft,v6e",
    "qwen3:0.6b,grpo,v6e",
    "qwen3:1.7b,sft,v6e",
    "qwen2p5:1.5b,sft,v6e",
    "llama3:3.2-1b,sft,v6e",
    "qwen2p5:7b,sft,v6e",
    "llama3:3.1-8b,sft,v6e",
    "qwen3:8b,sft,v6e",
    # The v6e GRPO rows alike, train step / run's peak planned against compiled: Qwen3-1.7B
    # 17.16 / 17.96 against 12.63 / 13.43 GiB (+36% / +34%), Qwen2.5-1.5B 14.57 / 15.29 against
    # 11.65 / 12.37 (+25% / +24%), Llama-3.2-1B 19.00 / 19.58 against 15.78 / 16.35 (+20% /
    # +20%) at one micro-batch (at four, Qwen3-4B and Llama-3.2-3B are within the bar, 5-6%
    # under); at eight Qwen3-8B 32.53 / 38.14 against
    # 27.25 / 31.06 (+19% / +23%), Llama-3.1-8B 31.38 / 37.40 against 25.78 / 29.52 (+22% /
    # +27%), Qwen2.5-7B 30.18 / 35.47 against 24.60 / 28.14 (+23% / +26%). The 7-8B rows' plan
    # peak is the weight sync's (e.g. 26.70 GiB of program against XLA's 15.74 for Qwen3-8B: the
    # plan stages every leaf's whole gather at once for a sampler replicated over its data
    # axis, XLA ~0.6 of the sampler's copy at these sizes), and their train step over the
    # chip's 32 GiB: the start-up check refuses these three runs though the compiler fits them
    # (scale.md).
    "qwen3:1.7b,grpo,v6e",
    "qwen2p5:1.5b,grpo,v6e",
    "llama3:3.2-1b,grpo,v6e",
    "qwen3:8b,grpo,v6e",
    "llama3:3.1-8b,grpo,v6e",
    "qwen2p5:7b,grpo,v6e",
    # Over XLA by a hair past the bar, the safe direction: the train step 20.38 GiB against
    # 17.69 (+15.2%; temporaries 16.07 against 13.37). The v5p SFT rows (16 rows of 2,048 per
    # chip) are over by more where the plan's remat term (one block recomputed whole) is a larger
    # share: here 6.83 of 16.07 GiB, Llama-3.2-1B 14.40 of 22.35 (+14.6%), Qwen3-1.7B 8.29 of
    # 19.12 (+6%). Which part of a block XLA does not hold is not found yet.
    "qwen2p5:1.5b,sft,v5p",
    # UNDER XLA, the unsafe direction (fits either way: 44.44 of 95 GiB): the train step 34.15
    # GiB planned against 40.69 compiled (-16%), the run's peak 37.90 against 44.44 (-14.7%).
    # The other v5p GRPO rows are within the bar (Llama-3.2-3B, also at 4 micro-batches: the
    # run's peak 30.96 planned against 33.13, -6.5%); what XLA holds here that the plan does not
    # count is not found yet.
    "qwen3:4b,grpo,v5p",
}


@pytest.mark.parametrize("row", [pytest.param(r, marks=pytest.mark.xfail(
    strict=True, reason="the plan misses this compile by more than 15% (KNOWN_MISSES)"))
    if r in KNOWN_MISSES else r for r in sorted(_recorded())])
def test_real_size_plan_matches_the_recorded_compile(repo_root, row, monkeypatch):
  """A real-size program takes 10-15 min to compile on the 2-core CI machine, so XLA's figures
  come from benchmarks/scale.py's runs (benchmarks/results/scale.jsonl, every row there); the
  plan is recomputed here from today's code (seconds) and must stay within 15% of them, per
  program for the train step and for the run's peak. The plan is made with the learner
  attention the row was compiled with (rows before splash attention: XLA's).

  Its programs are traced with the layers scanned (model.scan_layers), which the plan counts
  as the unrolled model's (tests/test_scan.py: every program of two GRPO rows; all 58 rows
  of scale.jsonl gave identical estimates both ways, 2026-12-06), in a third less time: 115
  against 65 s for the 58 rows here (AMD EPYC, 2 cores)."""
  record = _recorded()[row]
  monkeypatch.setenv("JAXRL_TPU_ATTENTION", record.get("attention", "xla"))
  monkeypatch.setenv("JAXRL_TPU_COLLECTIVE_MATMUL", record.get("collective_matmul", "on"))
  if any(p.get("oom") for p in record["programs"]):  # the compiler refused it: so must the plan
    sys.path.insert(0, os.path.join(repo_root, "benchmarks"))
    import scale
    config, module, chip = scale.load(row)
    config.model.scan_layers = True
    _, programs = module.programs(config, devices=aot.topology_devices(scale.TOPOLOGY[chip]))
    assert not record["fits"] and estimate(programs[0]).peak > record["hbm"]
    return
  sys.path.insert(0, os.path.join(repo_root, "benchmarks"))
  import scale
  config, module, chip = scale.load(row)
  assert int(config.optim.accum_steps) == record["accum_steps"]  # the config compiled
  assert not config.model.get("scan_layers", False)  # as compiled: unrolled, traced scanned
  config.model.scan_layers = True
  if "placement" in config and record["row"].split(",")[1] == "grpo":
    sm = config.placement.sampler_mesh
    assert config.placement.get("ref_dtype", "") == record.get("ref_dtype", "")
    if "sampler_mesh" in record:
      assert [int(sm.data), int(sm.tensor)] == record["sampler_mesh"]
    elif "lora" not in record["row"]:  # recorded before the field: the family default
      assert (int(sm.data), int(sm.tensor)) == (-1, 2)
  work, programs = module.programs(config, devices=aot.topology_devices(scale.TOPOLOGY[chip]))
  assert (work.remat, work.logits_chunk) == (record["remat"], record["logits_chunk"])
  recorded = {p["name"]: p for p in record["programs"]}
  estimates = [estimate(p) for p in programs if p.name in recorded]
  train = estimates[0]
  xla = recorded[train.name]["xla_bytes"]
  assert abs(train.program_peak - xla) / xla < 0.15, (train, xla)
  plan = max(e.peak for e in estimates)
  assert abs(plan - record["xla_peak"]) / record["xla_peak"] < 0.15, (plan, record["xla_peak"])
  assert record["fits"] == (record["xla_peak"] <= record["hbm"])



def test_no_recorded_estimate_is_below_its_physical_floor(repo_root):
  """Every figure the scale table shows as XLA's (train steps counted whole, decode steps) is
  at least its floor (benchmarks/scale.py: model FLOPs at peak, or the bytes the step must read
  once at the HBM bandwidth), for every recorded row, with no list of known misses; and a row
  doctored below its floor is caught."""
  import copy
  sys.path.insert(0, os.path.join(repo_root, "benchmarks"))
  import scale
  results, counts = scale.read_results(), scale.read_decode_counts()
  assert len(results) == 58 and counts
  assert scale.below_floor(results, counts) == []
  row = "qwen3:0.6b,grpo,v5e"
  d = copy.deepcopy(counts[row])
  body = d["compiled"][f"loop {d['steps_per_call']}"]
  body.update(flops=0, bytes_accessed=0.1 * (d["weight_bytes"] + d["kv_bytes"]))
  r = copy.deepcopy(results[row])
  train = next(p for p in r["programs"] if p["kind"] == "train")
  train["loops"] = 0  # as if counted whole, at a tenth of its floor
  floor = scale.train_figures(r)["floor"]
  train.update(flops_xla=0.1 * floor * aot.chip_of(r["topology"]).bf16_flops, bytes_accessed=0)
  bad = scale.below_floor({row: r}, {row: d})
  assert [b.split(":")[2].split()[0] for b in bad] == ["train", "decode"], bad

def test_without_libtpu_one_sentence_says_how_to_install_it(monkeypatch):
  monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu now fails
  with pytest.raises(ConfigError, match=r'pip install "jax\[tpu\]'):
    aot.topology_devices("v5e:2x4")
  with pytest.raises(ConfigError, match="unknown chip 'v9x'"):
    aot.topology_devices("v9x:2x2")


def test_jaxrl_plan_compile_prints_xla_beside_the_plan(repo_root, capsys):
  from jaxrl import cli
  cli.main(["plan", "--config", os.path.join(repo_root, "configs/sft_tiny.py"),
            "--compile", "v5e:2x2"])
  out = capsys.readouterr().out
  assert "learner: Mesh(data=1 x fsdp=4 x tensor=1) over 4 tpu devices" in out
  assert "compiled per chip" in out and "plan/XLA" in out
  assert "v5e HBM 16 GiB per chip: the largest peak" in out and "fits" in out


def test_jaxrl_plan_plans_a_slice_config_for_its_slice_off_tpu(repo_root, capsys):
  """A real-size config names its slice (plan.topology): off TPU, `jaxrl plan` plans that
  slice's abstract chips as written, instead of refusing a mesh this machine cannot hold (on
  one CPU device, qwen3.py's sampler mesh asked for 8 devices)."""
  from jaxrl import cli
  cli.main(["plan", "--config", os.path.join(repo_root, "configs/qwen3.py:0.6b,grpo,v5p")])
  out = capsys.readouterr().out
  assert out.startswith("planned for v5p:2x2x1 (plan.topology): 4 abstract TPU chips")
  assert "learner: Mesh(data=1 x fsdp=4 x tensor=1) over 4 tpu devices" in out
  assert "device memory 95.000 GiB" in out
  cli.main(["plan", "--config", os.path.join(repo_root, "configs/qwen3.py:0.6b,grpo,v5p"),
            "--config.plan.topology="])
  assert "over 8 cpu devices" in capsys.readouterr().out  # the suite's fake devices


def test_a_program_the_tpu_compiler_cannot_fit_is_reported_not_raised():
  """libtpu refuses a program whose temporaries exceed the chip's HBM (CompileTimeHbmOom); the
  compile reports it, with the compiler's figure, instead of a traceback."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from jaxrl.parallel.plan import Program
  mesh = Mesh(np.array(aot.topology_devices("v5e:2x2")[:1]), ("x",))
  x = jax.ShapeDtypeStruct((1 << 20,), jnp.float32, sharding=NamedSharding(mesh, P()))
  big = jax.jit(lambda x: jnp.cumsum(jnp.outer(x, x[:5000]), axis=0).astype(jnp.bfloat16)
                @ jnp.ones((5000, 8), jnp.bfloat16))  # ~20 GB of float32 temporaries
  c = aot.compile_program(Program("big", big, (x,), "forward"))
  assert c.oom and c.temp > 16 * aot.GIB


# XLA's figures for GRPO's reward-model forward at real size: qwen3.py:0.6b,grpo,v5e with one
# reward model of the policy's shapes (reward_model.checkpoints naming a run not trained yet),
# compiled for v5e:2x4 on 2026-12-03 (175 s on the shared 2-core machine): 16 rows x 2,048
# tokens per chip, XLA's attention (no fused kernel on TPU), no log-prob feature.
RM_FORWARD_XLA = {"bytes": 11_135_153_664, "temp": 10_836_635_648}


def test_real_size_reward_forward_plan_matches_its_compile(repo_root, tmp_path, monkeypatch):
  monkeypatch.setenv("JAXRL_TPU_ATTENTION", "xla")  # as RM_FORWARD_XLA was compiled
  sys.path.insert(0, os.path.join(repo_root, "benchmarks"))
  import scale
  config, module, chip = scale.load("qwen3:0.6b,grpo,v5e")
  config_lib.apply_overrides(config, [f"reward_model.checkpoints={tmp_path}/rm"])
  _, programs = module.programs(config, devices=aot.topology_devices(scale.TOPOLOGY[chip]))
  rm = next(p for p in programs if p.name == "reward forward")
  e = estimate(rm)
  assert abs(e.program_peak - RM_FORWARD_XLA["bytes"]) / RM_FORWARD_XLA["bytes"] < 0.15, e


# XLA's bytes per chip for Qwen3-8B QLoRA GRPO's weight sync program (learner fsdp=8 -> the
# sampler mesh), compiled for v5e:2x4 on 2026-12-03 (a reshard compiles in about a minute, but
# building the 8B programs and compiling both is too slow for the suite). Before the plan
# counted the reshard's staging buffers it said 2.35 and 5.66 GiB.
SYNC_XLA_GIB = {(1, 8): 3.7311, (-1, 2): 13.4175}


@pytest.mark.parametrize("data,tensor", list(SYNC_XLA_GIB))
def test_real_size_weight_sync_plan_matches_its_compile(data, tensor):
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "benchmarks"))
  import scale
  config, module, chip = scale.load("qwen3:8b,grpo,v5e,qlora")
  config.placement.sampler_mesh.data, config.placement.sampler_mesh.tensor = data, tensor
  _, programs = module.programs(config, devices=aot.topology_devices(scale.TOPOLOGY[chip]))
  e = estimate(next(p for p in programs if p.name == "weight sync"))
  xla = SYNC_XLA_GIB[(data, tensor)] * (1 << 30)
  assert e.temp > 0 and abs(e.program_peak - xla) / xla < 0.15, (e, xla)
