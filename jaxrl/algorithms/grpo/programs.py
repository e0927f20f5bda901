"""GRPO's programs, abstract: what `jaxrl plan` estimates and `jaxrl plan --compile` compiles
(jaxrl.train.programs). Each is the one setup() builds, over the shapes its config implies:

  train step        the policy's update over one minibatch (make_train_step + grpo_loss), in
                    the shared-prompt form when the run uses it; resident beside it: the
                    reference (and reward models)
  logprob forward   the reference's (and, without old_logp_from_update, the old policy's)
                    log-probs of the whole step's batch, in a scan over the update's
                    micro-batches (algo.minibatches x optim.accum_steps of them)
  reward forward    the reward models' scores of the step's rows (only when
                    reward_model.checkpoints names any): every RM in one jit, over the whole
                    step at once, as RewardModels.score runs it; resident beside it: the
                    policy's state, the reference and (colocated) the sampler's weights
  prefill           the sampler's prefill of one call's prompts
  decode steps      rollout.steps_per_call decode steps over rollout.slots x the longest
                    sequence (prompt + max_new_tokens: the cache window's largest width)
  weight sync       learner params -> sampler layout (and placement.sync_dtype), as one jit
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl import backends, config as config_lib
from jaxrl.data.hf_tokenizer import tokenizer_for
from jaxrl.models import RewardModel, abstract_model, lora, reward_apply
from jaxrl.models.llama import unstack_layers
from jaxrl.models.flops import forward_flops, train_flops
from jaxrl.parallel import batch_sharding, get_rules
from jaxrl.parallel.plan import (Program, Workload, abstract_bytes, attention_score_bytes,
                                 kernel_takes)
from jaxrl.parallel.sync import make_placement
from jaxrl.algorithms.grpo.batch import batch_shapes
from jaxrl.algorithms.grpo.config import (conversation_tokens, grouped_forward, prompt_length,
                                          ref_dtype)
from jaxrl.algorithms.grpo.update import (batch_logprobs, grpo_loss, logprob_micro_batches,
                                          make_batch_logprobs_fn, old_logp_from_update)
from jaxrl.rewards import model as rm_lib
from jaxrl.sampler import Engine, SamplingParams, bucket
from jaxrl.train import programs as pg
from jaxrl.train.data import load_task, records
from jaxrl.train.optim import make_optimizer


def data_prompt_len(config) -> int:
  """The prompt width setup() would use: rollout.prompt_len, else the data's longest prompt
  (read with the run's tokenizer)."""
  if config.rollout.get("prompt_len"):
    return prompt_length(config, 1)
  task = load_task(config)
  train, held_out, _ = records(config, task, "rl",
                               build=lambda split, n, seed: task.records(split, n, seed),
                               what="{prompt, answer}")
  tok = tokenizer_for(config)
  return prompt_length(config, max(len(tok.encode(x["prompt"], bos=True))
                                   for x in train + held_out))


def _floats_in(tree, dtype):
  """Abstract `tree` (shardings kept) with its floating leaves in `dtype` ("" / None: as is)."""
  if not dtype:
    return tree
  return jax.tree.map(lambda x: pg.spec(x.shape, dtype, x.sharding)
                      if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def programs(config, *, devices=None, prompt_len: int | None = None, unroll_decode=False):
  """(Workload, [Program]) of this GRPO config (see the module docstring). unroll_decode: the
  decode steps written out without a loop, so that XLA's cost analysis counts every step."""
  cfg = config_lib.model_config(config)
  a, r = config.algo, config.rollout
  placement = make_placement(config.mesh, config.placement, devices=devices)
  mesh, smesh = placement.learner.mesh, placement.sampler.mesh
  replicas = mesh.shape["data"] * mesh.shape["fsdp"]
  Tp = data_prompt_len(config) if prompt_len is None else bucket(prompt_len)
  G, N, Tc = r.group_size, r.prompts_per_step * r.group_size, r.max_new_tokens
  if config.data.get("env") or config.get("env_module"):  # a conversation after its prompt
    Tc = conversation_tokens(config)
  updates = a.num_iterations * a.minibatches
  tx, schedule = make_optimizer(config.optim, config.train.steps * updates)
  graphdef, state, shardings = pg.abstract_state(cfg, mesh, tx, layout="learner")
  grouped = grouped_forward(config, replicas, lambda *_: None)
  shd = batch_sharding(mesh, 2, "learner")
  old_from_update = old_logp_from_update(a)
  knobs = pg.model_knobs(config)

  width = Tc if grouped else Tp + Tc

  def rows(n, update):  # the learner batch of n completions (n / G groups), abstract
    return {k: pg.spec(shape, dtype, shd) for k, (shape, dtype) in batch_shapes(
        n, group=G, prompt_len=Tp, width=width, grouped=grouped, update=update,
        old_logp=not old_from_update).items()}

  def flops(n):  # one forward over n completions (their prompts once per group when grouped)
    prompts = n // G if grouped else n
    tokens = prompts * Tp + n * Tc
    pairs = prompts * Tp * (Tp + 1) / 2 + n * (Tc * Tp + Tc * (Tc + 1) / 2)
    return forward_flops(cfg, tokens=tokens, pairs=pairs)

  reference, base_bytes, ref_bytes, resident = _resident_roles(config, cfg, mesh, state)
  kernel = backends.attention_kernel(mesh, batch=get_rules("learner")["batch"],
                                    kv_heads=get_rules("learner")["kv_heads"])

  # Packed completions (algo.pack_completions) take the XLA attention path: their scores are
  # materialised whatever the kernel; the padded batch's rows bound the packed ones'.
  packed = grouped and bool(a.pack_completions)

  def scores(n_rows, queries, keys):  # float32 attention scores per device (plan.Program)
    fused = not packed and kernel_takes(kernel, cfg, mesh, queries=queries, keys=keys)
    return attention_score_bytes(cfg, mesh, rows=n_rows, queries=queries, keys=keys,
                                 fused=fused)

  n_mb = N // a.minibatches
  batch = rows(n_mb, True)
  loss_fn = grpo_loss(graphdef, a, temperature=r.temperature, norm_len=r.max_new_tokens)
  plain = pg.plain_graphdef(cfg)  # without remat: one block's activations
  train = pg.train_program(
      loss_fn, tx, schedule, state, shardings, batch, mesh=mesh,
      accum_steps=config.optim.accum_steps, resident=resident, flops=train_flops(cfg, flops(n_mb)),
      tokens=n_mb * Tc, seq_len=width, vocab=cfg.vocab_size, logits_chunk=knobs["logits_chunk"],
      cfg=cfg, plain_loss=grpo_loss(plain, a, temperature=r.temperature,
                                    norm_len=r.max_new_tokens))

  fwd_batch = rows(N, False)
  # The forward runs in the update's micro-batches (a scan over them, as setup() builds it):
  # its rows, the activations of one block and the logits are one micro-batch's.
  micro = logprob_micro_batches(config)
  fwd_fn = make_batch_logprobs_fn(graphdef, r.temperature, mesh=mesh,
                                  entropy=not old_from_update, micro_batches=micro)
  # The policy's own state stays resident beside the reference's forward (and vice versa).
  # With the old log-probs from the update, the reference alone runs this forward: its params
  # (in placement.ref_dtype) are the argument; otherwise the policy's, the larger.
  fwd_params = reference if old_from_update else state.params
  fwd = Program(
      "logprob forward" + ("" if old_from_update else " (x2: old policy, reference)"), fwd_fn,
      (fwd_params, fwd_batch), "forward",
      resident={"actor params + optimizer state": abstract_bytes(state) - base_bytes},
      flops=flops(N), tokens=N * Tc, rows=N // (replicas * micro), seq_len=width,
      vocab=cfg.vocab_size, logits_chunk=knobs["logits_chunk"],
      layer_bytes=pg.layer_bytes(lambda p, b: batch_logprobs(plain, p, b, r.temperature)[0],
                                 fwd_params, pg.micro_batch(fwd_batch, micro),
                                 layers=cfg.num_layers, mesh=mesh),
      # the largest attention call: the completions' against prompt + completion
      attention_bytes=scores(N // (replicas * micro), Tc if grouped else Tp + Tc, Tp + Tc))

  rm = _reward_forward(config, cfg, mesh, state, shd, N=N, L=Tp + Tc, replicas=replicas,
                       ref_bytes=ref_bytes, knobs=knobs, scores=scores)
  progs = [train, fwd] + ([rm] if rm is not None else [])
  sync, prefill, decode, held = _sampler_programs(config, cfg, placement, state, resident,
                                                  Tp=Tp, Tc=Tc, unroll=unroll_decode)
  if placement.mode == "colocated":
    _colocated(placement, train, rm, held)
  work = Workload(rows=max(1, n_mb // (replicas * config.optim.accum_steps)), seq_len=width,
                  reference=True, slots=r.slots, max_len=Tp + Tc, **knobs)
  return work, [*progs, prefill, decode, sync]


def _resident_roles(config, cfg, mesh, state):
  """(reference, base_bytes, ref_bytes, resident): what stays resident beside the learner's
  programs, the reference and the reward models' params. Without LoRA the reference is a copy
  of the params, in placement.ref_dtype when set; with LoRA it is the actor's own frozen base
  (base_bytes) with zero adapters: only those count, and a forward over either holds the base
  once, as its argument."""
  base_bytes = abstract_bytes(lora.split_lora(state.params)[0]) if cfg.lora_rank else 0
  reference = _floats_in(state.params, ref_dtype(config))
  ref_bytes = abstract_bytes(reference) - base_bytes
  resident = {"reference params": ref_bytes}
  for label, rm_cfg, feature in rm_lib.plan_roles(config):
    model = functools.partial(RewardModel, logprob_feature=feature)
    resident[f"{label} params"] = abstract_bytes(
        pg.params_of(abstract_model(rm_cfg, model), mesh, "learner"))
  return reference, base_bytes, ref_bytes, resident


def _colocated(placement, train: Program, rm: Program | None, held: dict) -> None:
  """The sampler on the learner's chips: what of its memory (`held`) the reward forward and
  the update still hold."""
  if rm is not None:  # the sampler copy is released after scoring, before the update
    rm.resident.update({"sampler weights": held["sampler weights"], **held["base"]})
  if placement.keep_sampler_copy:
    train.resident.update({"sampler weights": held["sampler weights"],
                           "kv cache": held["kv cache"]})
  train.resident.update(held["base"])  # LoRA: the sampler's base copy stays over the update


def _reward_forward(config, cfg, mesh, state, shd, *, N: int, L: int, replicas: int,
                    ref_bytes: int, knobs: dict, scores) -> Program | None:
  """The reward models' forward (rm_lib.RewardModels.score, as setup() loads it): every RM over
  the step's N rows of L tokens (prompt + completion) in one jit, after generation; None
  without reward models."""
  roles = rm_lib.plan_roles(config)
  if not roles:
    return None
  rm_graphdefs, rm_plain, rm_params, layers, vocab = [], [], [], 0, 0
  for _, rm_cfg, feature in roles:
    model = functools.partial(RewardModel, logprob_feature=feature)
    abstract = abstract_model(rm_cfg, model)
    rm_graphdefs.append(abstract[0])
    rm_plain.append(pg.plain_graphdef(rm_cfg, model))
    rm_params.append(pg.params_of(abstract, mesh, "learner"))
    layers += rm_cfg.num_layers
    vocab = max(vocab, rm_cfg.vocab_size if feature else 0)  # the log-prob feature's head
  depths = {rm_cfg.num_layers for _, rm_cfg, _ in roles}  # one: two blocks traced
  rms = rm_lib.RewardModels(rm_graphdefs, rm_params, [label for label, *_ in roles], mesh)
  rm_batch = {"tokens": pg.spec((N, L), "int32", shd), "positions": pg.spec((N, L), "int32", shd),
              "last": pg.spec((N,), "int32", batch_sharding(mesh, 1, "learner")),
              "logp_mask": pg.spec((N, L), "float32", shd)}

  def plain_score(params_m, b):  # without remat: one block's activations
    return jnp.stack([reward_apply(g, q, b["tokens"], b["positions"], b["last"],
                                   logp_mask_bt=b["logp_mask"])
                      for g, q in zip(rm_plain, params_m)])
  return Program(
      "reward forward", rms._score, (rm_params, *rm_batch.values()), "forward",
      resident={"actor params + optimizer state": abstract_bytes(state),
                "reference params": ref_bytes},
      flops=len(roles) * forward_flops(cfg, tokens=N * L, pairs=N * L * (L + 1) / 2),
      tokens=N * L, rows=N // replicas, seq_len=L, vocab=vocab,
      logits_chunk=knobs["logits_chunk"],
      layer_bytes=pg.layer_bytes(plain_score, rm_params, rm_batch, layers=layers, mesh=mesh,
                                 depth=min(depths) if len(depths) == 1 else 0),
      attention_bytes=scores(N // replicas, L, L))


def _sampler_programs(config, cfg, placement, state, resident: dict, *, Tp: int, Tc: int,
                      unroll: bool = False):
  """(weight sync, prefill, decode steps, held): the sampler's programs, its weights in its
  layout (cast by the sync), and `held`, the bytes it keeps on its chips ("sampler weights",
  "kv cache", and "base": the LoRA base copy's, {} without LoRA)."""
  r, G = config.rollout, config.rollout.group_size
  mesh, smesh = placement.learner.mesh, placement.sampler.mesh
  sync_dtype = config.placement.sync_dtype or None

  def sampler_params(c):
    return _floats_in(pg.params_of(abstract_model(c), smesh, "sampler"), sync_dtype)
  # A scanned learner's sampler runs the layers one by one (jaxrl.parallel.sync.WeightSync),
  # the sync unstacking them.
  plain = cfg.replace(scan_layers=False)
  sparams = sampler_params(plain)
  target = jax.tree.map(lambda x: x.sharding, sparams)
  learner_order = mesh.devices.reshape(-1)
  if (set(learner_order) == set(smesh.devices.flat)
      and list(learner_order) != list(smesh.devices.flat)):
    # Colocated on a 3-D slice (v5p), the sampler's mesh lists the chips in another order
    # than the learner's, and jit takes no program over both. The run casts on the learner's
    # layout and device_puts into the sampler's (jaxrl.parallel.sync); the stand-in compiled
    # here writes the sampler's shards over the learner's order: the same bytes per chip.
    same_order = jax.sharding.Mesh(learner_order.reshape(smesh.devices.shape),
                                   smesh.axis_names, axis_types=smesh.axis_types)
    target = jax.tree.map(lambda s: NamedSharding(same_order, s.spec), target)
  dtype = jnp.dtype(sync_dtype) if sync_dtype else None

  def cast(params):
    if cfg.scan_layers:
      params = unstack_layers(params, cfg.num_layers)
    return jax.tree.map(lambda x: x.astype(dtype) if dtype is not None and
                        jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  # Colocated, the learner's state, the reference and the reward models stay on the chips
  # while the sampler runs; disaggregated, the sampler's chips hold only its own.
  colocated = placement.mode == "colocated"
  learner_resident = {"actor params + optimizer state": abstract_bytes(state), **resident}
  gen_resident = learner_resident if colocated else {}
  sync = pg.forward_program(
      "weight sync", jax.jit(cast, out_shardings=target), (state.params,), kind="sync",
      resident={"optimizer state": abstract_bytes(state.opt_state), **resident}
      if colocated else {})

  sampling = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                            max_new_tokens=r.max_new_tokens, eos_id=None)
  # LoRA: the sampler runs the plain model on weights merged from its own copy of the frozen
  # base, which stays on its chips the whole step (jaxrl.parallel.sync.WeightSync).
  scfg, sbase = plain, {}
  if cfg.lora_rank:
    scfg, sbase_tree = lora.base_config(plain), lora.split_lora(sparams)[0]
    if cfg.lora_quantize:
      # QLoRA: that copy is the int8 base, synced uncast (jaxrl.parallel.sync.WeightSync), and
      # the merged weights are the plain model's.
      sbase_tree = lora.split_lora(pg.params_of(abstract_model(plain), smesh, "sampler"))[0]
      sparams = sampler_params(scfg)
    else:
      sparams = sbase_tree
    sbase = {"sampler base (LoRA)": abstract_bytes(sbase_tree)}
  engine = Engine(abstract_model(scfg)[0], scfg, smesh, sampling=sampling)
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                             sharding=NamedSharding(smesh, P()))
  n_prefill = bucket(max(1, min(r.prompts_per_step, -(-r.slots // G))), minimum=1)
  rep = NamedSharding(smesh, P())
  prefill = pg.forward_program(
      "prefill", engine._prefill,
      (sparams, pg.spec((n_prefill, Tp), "int32", rep), pg.spec((n_prefill,), "int32", rep),
       pg.spec((n_prefill,), "int32", rep), key), kind="prefill",
      resident={**gen_resident, **sbase}, flops=forward_flops(cfg, tokens=n_prefill * Tp,
                                                     pairs=n_prefill * Tp * (Tp + 1) / 2),
      tokens=n_prefill * Tp, rows=n_prefill, seq_len=1, vocab=cfg.vocab_size)
  max_len = Tp + Tc
  shardings_s = engine._state_shardings(r.slots, max_len)
  kv = jax.eval_shape(lambda: engine._init_fn(r.slots, max_len)(jnp.int32(max_len)))
  dstate = jax.tree.map(lambda x, s: pg.spec(x.shape, x.dtype, s), kv, shardings_s)
  slots_dev = r.slots // (smesh.shape["data"] * smesh.shape["fsdp"])
  steps = r.steps_per_call
  decode = pg.forward_program(
      "decode steps", jax.jit(lambda p, s, k: engine._steps_fn(p, s, k, steps=steps,
                                                               unroll=unroll),
                              donate_argnums=1), (sparams, dstate, key),
      kind="decode", resident={**gen_resident, **sbase}, donated=(1,),
      flops=steps * forward_flops(cfg, tokens=r.slots, pairs=r.slots * max_len),
      tokens=steps * r.slots, rows=slots_dev, seq_len=1, vocab=cfg.vocab_size)
  prefill.resident["kv cache"] = abstract_bytes(dstate)  # allocated before the first prefill
  held = {"sampler weights": abstract_bytes(sparams), "kv cache": abstract_bytes(dstate),
          "base": sbase}
  return sync, prefill, decode, held
