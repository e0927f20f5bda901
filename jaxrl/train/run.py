"""The skeleton every trainer shares: a Run owns the run dir, the mesh, the starting policy, the
checkpointer, resume and the loop (eval, interrupts, summary.json); a trainer adds its data,
its loss and step, and its eval.

    r = Run(config, workdir, out=out, choices=CHOICES)  # validate, DIR/config.json, mesh, ...
    batches = r.batches(sft_batches, train)        # the data shards this process reads
    graphdef, state, shardings = r.init_state(tx)  # born sharded, from HF / init.checkpoint
    state = r.resume(state, shardings, batches)    # DIR's latest checkpoint, if any
    summary = r.train(state, step_fn, batches, put=..., eval_fn=..., banner="sft: ...")

Only process 0 reports (`r.say`) and writes files; every process runs the same calls.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import jax
import numpy as np

from jaxrl import backends
from jaxrl import config as config_lib
from jaxrl.data.hf_tokenizer import tokenizer_for
from jaxrl.data.prompts import Prompts
from jaxrl.errors import ConfigError
from jaxrl.io.params import restore_params
from jaxrl.parallel import mesh_from_config
from jaxrl.parallel import plan as plan_lib
from jaxrl.parallel.sync import make_placement
from jaxrl.train.checkpoint import Checkpointer
from jaxrl.train.data import ShardedBatches, check_batch_size, data_shards
from jaxrl.train.evaluation import ExactMatch
from jaxrl.train.loop import resume, train_loop
from jaxrl.train import rundir
from jaxrl.train.rundir import RunDir
from jaxrl.train.state import init_train_state, start_from_checkpoint, start_from_hf


def count_tokens(batch) -> int:
  """The real (non-padding) tokens of a process-local batch: the loop's tokens_fn."""
  return int(np.count_nonzero(batch["segment_ids"]))


def starting_state(config, cfg, mesh, tx, *, layout: str, model=None, into: str | None = None):
  """(graphdef, state, shardings): the starting policy, born sharded. The preset's init, then
  model.hf_path's weights when given, then init.checkpoint's params (a run dir, e.g. an SFT
  run) over them when the config has that section. `into` names the sub-tree both load into (a
  reward model's "backbone"; its head keeps the init). The optimizer state is fresh. A
  checkpoint that replaces every parameter (no LoRA, no `into`, no hf_path) is read in place of
  the random init, which then never runs: the same state, without compiling the init's program
  or holding two copies of the params at start-up."""
  path = config.init.checkpoint if "init" in config else ""
  whole = bool(path) and into is None and not cfg.lora_rank and not (
      config.model.get("hf_path") or "")
  graphdef, state, shardings = init_train_state(
      cfg, mesh, tx, seed=config.seed, layout=layout, model=model,
      params_from=(lambda abstract: restore_params(path, abstract)) if whole else None)
  state = start_from_hf(config, state, mesh, layout, into=into)
  if path and not whole:  # (with LoRA: into the frozen base, a LoRA checkpoint's adapters merged)
    state = start_from_checkpoint(cfg, state, path, into=into, layout=layout)
  return graphdef, state, shardings


def recorded_hf_path(run_dir: str) -> str:
  """The model.hf_path a jaxrl run directory (or its checkpoints/) started from, as its
  config.json records it; "" for a run of a preset, or a directory that is no run."""
  path = run_dir.rstrip("/")
  if os.path.basename(path) == "checkpoints":
    path = os.path.dirname(path)
  config = rundir.read_config(path) if os.path.isdir(path) else None
  model = config.get("model") if isinstance(config, dict) else None
  return (model.get("hf_path") or "") if isinstance(model, dict) else ""


def adopt_hf_path(config, run_dir: str, *, key: str, say=print) -> None:
  """A run that continues another (init.checkpoint, `sample --checkpoint`) without naming
  model.hf_path takes the one that run started from: the checkpoint's tokenizer, chat template,
  stop ids and shapes, never the byte tokenizer's and a preset's."""
  if not run_dir or (config.model.get("hf_path") or ""):
    return
  path = recorded_hf_path(run_dir)
  if path:
    config.model.hf_path = path
    say(f"note: {key}={run_dir!r} started from model.hf_path={path!r}: using its tokenizer "
        "and model shapes")


def recorded_lora(run_dir: str) -> dict | None:
  """The model.lora section a jaxrl run directory (or its checkpoints/) trained with, as its
  config.json records it; None for a run without adapters (rank 0) or a directory that is no
  run."""
  path = run_dir.rstrip("/")
  if os.path.basename(path) == "checkpoints":
    path = os.path.dirname(path)
  config = rundir.read_config(path) if os.path.isdir(path) else None
  model = config.get("model") if isinstance(config, dict) else None
  lora = model.get("lora") if isinstance(model, dict) else None
  return lora if isinstance(lora, dict) and int(lora.get("rank") or 0) > 0 else None


def adopt_lora(config, run_dir: str, *, key: str, say=print) -> None:
  """Inference on a LoRA run (`sample` / `eval --checkpoint RUN`) without naming its adapters
  takes the run's own model.lora (rank, alpha, targets, quantize), as PEFT's
  `PeftModel.from_pretrained` reads adapter_config.json: the checkpoint holds base and
  adapters, and the model must have the same leaves to read it. A config that names a LoRA
  section of its own keeps it (a mismatch is then check_structure's one sentence)."""
  if not run_dir or int(config.model.lora.get("rank") or 0) > 0:
    return
  lora = recorded_lora(run_dir)
  if lora:
    config.model.lora.update({k: v for k, v in lora.items() if k in config.model.lora})
    say(f"note: {key}={run_dir!r} trained LoRA adapters (rank {lora['rank']}"
        + (f", {lora['quantize']} base" if lora.get("quantize") not in (None, "", "none") else "")
        + "): using its model.lora")


def claim(workdir: str, command: str, cfg, *, steps: int | None = None,
          write: bool = True) -> None:
  """Checks that DIR is this run's to write (rundir.check_owner: the command, the model
  signature, no checkpoint past `steps`), then records DIR/run.json. Nothing in DIR is written
  before the checks pass, so a refused resume leaves DIR as it was."""
  model, params = rundir.model_signature(cfg)
  rundir.check_owner(workdir, command=command, model=model, params=params, steps=steps)
  if write:
    os.makedirs(workdir, exist_ok=True)
    rundir.write_run(workdir, {"command": command, "model": model, "params": params})


def check_plan(config, programs: Callable, *, what: str, say=print,
               compile_check: bool | None = None) -> None:
  """Stops with one sentence when the run will not fit a device (plan.device / plan.device_gib,
  else what the runtime reports: TPU, GPU). The trainer's memory plan (programs(config): its
  Workload and Programs, jaxrl.parallel.plan) answers first; when it says no and the programs
  are for accelerators (compile_check, default: the run's devices are not CPU), XLA decides:
  the programs are compiled for the run's own devices and their memory_analysis() peaks, plus
  what stays resident beside each, are checked instead (jaxrl.parallel.compile). The plan errs
  on the safe side, by up to ~25% on v6e, so it alone would refuse runs that fit. Nothing to
  check against (CPU without plan.device) or plan.check=False: no check."""
  section = config.get("plan")
  if section is not None and not section.get("check", True):
    return
  device = plan_lib.device_bytes_of(section) or plan_lib.runtime_device_bytes(jax.devices())
  if device is None:
    return
  _, progs = programs(config)
  plan = plan_lib.plan_programs(progs, section)
  worst = max(plan.estimates, key=lambda e: e.peak)
  if compile_check is None:  # programs(config) builds them over jax.devices()
    compile_check = jax.devices()[0].platform != "cpu"
  if plan.peak > device and compile_check:
    from jaxrl.parallel import compile as compile_lib
    say(f"memory plan: the {worst.name} peaks at {worst.peak / plan_lib.GIB:.3f} GiB, over the "
        f"{device / plan_lib.GIB:.3f} GiB per device; compiling the run's {len(progs)} programs "
        "to ask XLA (the plan errs on the safe side)")
    compiled = [compile_lib.compile_program(p) for p in progs]
    name, peak = compile_lib.xla_peak(plan.estimates, compiled)
    oom = [c.name for c in compiled if c.oom]
    if oom or peak > device:
      raise ConfigError(
          f"{what} will not fit: XLA's compile of its {oom[0] if oom else name} "
          + ("ran out of device memory" if oom else
             f"holds {peak / plan_lib.GIB:.2f} GiB per device with what stays beside it")
          + f" (the memory plan said {worst.peak / plan_lib.GIB:.2f}) and the device has "
          f"{device / plan_lib.GIB:.2f}; see `jaxrl plan --config ...` for what to change "
          "(model.remat, fewer rows per device via optim.accum_steps, more devices), or pass "
          "--config.plan.check=False to start anyway.")
    say(f"memory: XLA's compile of the {name} peaks at {peak / plan_lib.GIB:.3f} GiB of "
        f"{device / plan_lib.GIB:.3f} GiB per device (the plan said {worst.peak / plan_lib.GIB:.3f}"
        "): it fits")
    return
  plan_lib.check_fits(plan, device, what=what)
  say(f"memory plan: the largest program ({worst.name}) peaks at {worst.peak / plan_lib.GIB:.3f}"
      f" GiB of {device / plan_lib.GIB:.3f} GiB per device")


class Run:
  """One training run's shared parts. Built first: it validates the config, opens the run dir
  (process 0 writes config.json and says which keys changed on a resume), builds the mesh and
  the tokenizer. The mesh is the learner's: config.mesh over all devices, or, for a trainer that
  samples (placement=True: GRPO), the learner part of config.placement. Not inferred from the
  config's sections: a real-model config file carries a placement section for its GRPO variant
  and `jaxrl plan`, and its SFT run must still take config.mesh."""

  def __init__(self, config, workdir: str, *, out=print, choices: dict | None = None,
               placement: bool = False, command: str | None = None,
               sections: Iterable[str] | None = None, programs: Callable | None = None):
    config_lib.validate(config, choices)  # the shared sections, and the trainer's CHOICES
    if command and sections is not None:  # the CLI checked this; a notebook may not have
      config_lib.check_sections(config, command, lambda _: sections, [command])
    self.config, self.out = config, out
    self.main = jax.process_index() == 0
    self.say = out if self.main else (lambda *_: None)
    if "init" in config:
      adopt_hf_path(config, config.init.checkpoint, key="init.checkpoint", say=self.say)
    self.cfg = config_lib.model_config(config)  # the ModelConfig
    self.command = command or rundir.infer_command(config.to_dict()) or "train"
    if programs is not None:  # the trainer's own plan, before anything is written or built
      check_plan(config, programs, what=f"this {self.command} run", say=self.say)
    claim(workdir, self.command, self.cfg, steps=config.train.steps, write=self.main)
    self.run_dir = RunDir(workdir, write=self.main)
    if self.main and rundir.backup_config(workdir, config):
      out(f"note: the previous config.json is kept as {workdir}/config.prev.json")
    self.run_dir.write_config(config, out=out if self.main else None)
    if self.main:  # what config.json records under "backend"
      backend = backends.describe()
      out(f"memory allocator: {backend['allocator']}")
      out(f"backend: {backend['platform']}; attention {backend['attention']}; dots "
          f"{backend['dots']}")
    self.tokenizer = tokenizer_for(config)
    # How every prompt this run samples or evaluates is rendered (jaxrl.data.prompts).
    self.prompts = Prompts(self.tokenizer, config.get("data"))
    self.placement = None
    if placement:
      self.placement = make_placement(config.mesh, config.placement)
      self.mesh = self.placement.learner.mesh
    else:
      self.mesh = mesh_from_config(config.mesh)
    self.replicas = self.mesh.shape["data"] * self.mesh.shape["fsdp"]  # the batch shards
    self.ckpt: Checkpointer | None = None
    self.start = 0
    self.closers: list[Callable[[], None]] = []  # closed first, in order (GRPO's rollout)

  def record_data(self, fingerprint: str) -> None:
    """Records the training data's fingerprint in DIR/run.json; a resume on other data is
    allowed (e.g. a cleaned file) but said."""
    was = (rundir.read_run(self.run_dir.workdir) or {}).get("data")
    if was and was != fingerprint:
      self.say(f"note: the data differs from the one this run started on (fingerprint "
               f"{was[:19]}... -> {fingerprint[:19]}...)")
    if self.main:
      rundir.write_run(self.run_dir.workdir, {"data": fingerprint})

  def batches(self, make: Callable, records, **kwargs) -> ShardedBatches:
    """The global batch is the concatenation of `data.shards` shard batches, and each process
    reads only its own shards, so the batches do not depend on the process count.
    make(records, tokenizer, seq_len=, batch_size=, seed=, shard_index=, shard_count=,
    on_bad_row=, data_cfg=, **kwargs) is one shard's iterator (sft_batches, prefs_batches, ...);
    data_cfg (data.chat and the other prompt keys) says how prompts are rendered."""
    c, d = self.config, self.config.data
    shards, mine = data_shards(d.shards)
    check_batch_size(d.batch_size, shards, self.replicas, c.optim.accum_steps)
    return ShardedBatches([
        make(records, self.tokenizer, seq_len=d.seq_len, batch_size=d.batch_size // shards,
             seed=c.seed, shard_index=i, shard_count=shards, on_bad_row=d.on_bad_row,
             **{"data_cfg": d, **kwargs}) for i in mine])

  def init_state(self, tx, *, layout: str | None = None, model=None, into: str | None = None):
    """(graphdef, state, shardings): the starting policy (see starting_state), in config.layout
    unless `layout` is given."""
    layout = self.config.layout if layout is None else layout
    return starting_state(self.config, self.cfg, self.mesh, tx, layout=layout, model=model,
                          into=into)

  def exact_match(self, graphdef, answers, check, *, max_new: int) -> ExactMatch | None:
    """Greedy exact match on held-out {prompt, answer} records (eval/accuracy, and the samples
    it keeps), or None without records or a checker."""
    if not answers or check is None:
      return None
    return ExactMatch(graphdef, self.cfg, self.mesh, self.tokenizer, answers, check,
                      data_cfg=self.config.get("data"),
                      batch=self.config.eval.batch_size, max_new=max_new)

  def checkpointer(self) -> Checkpointer:
    """DIR/checkpoints, opened on first use."""
    if self.ckpt is None:
      t = self.config.train
      self.ckpt = Checkpointer(self.run_dir.checkpoints, keep=t.keep_checkpoints,
                               async_save=t.async_checkpoints)
    return self.ckpt

  def resume(self, state, shardings, batches, *, updates_per_step: int = 1):
    """The state (and the batches' position) of DIR's latest checkpoint, else the given one;
    sets `start`, the step the loop starts from."""
    state, self.start = resume(self.checkpointer(), state, shardings, batches, self.run_dir,
                               out=self.out, updates_per_step=updates_per_step)
    return state

  def train(self, state, step_fn: Callable, batches, *, put: Callable, banner: str = "",
            **loop) -> dict:
    """Runs the loop (jaxrl/train/loop.py) from `start` to train.steps:
    interrupts save and stop, a non-finite loss stops, DIR/summary.json is written however it
    ends; then the checkpointer and the run dir are closed. `banner` is said on a fresh start.
    `loop` passes eval_fn, tokens_fn, flops_fn, updates_per_step, summary_extra through."""
    c = self.config
    if banner and self.start == 0:
      self.say(banner)
    try:
      return train_loop(
          state=state, step_fn=step_fn, batches=batches, put=put,
          total_steps=c.train.steps, run=self.run_dir, ckpt=self.checkpointer(),
          log_every=c.train.log_every, save_every=c.train.save_every, eval_every=c.eval.every,
          out=self.out, **loop)
    finally:
      self.close()

  def close(self) -> None:
    """Closes what the trainer added (`closers`), waits for the checkpoint being written and
    closes the run dir."""
    for close in self.closers:
      close()
    if self.ckpt is not None:
      self.ckpt.close()
    self.run_dir.close()
