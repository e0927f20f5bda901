"""What DPO's losses are fed besides the policy's rows: KTO's rows (pairs unpaired, and the
mismatched rows of its KL baseline) and the reference's log-probs, either from a live frozen
copy or from a cache on disk filled by one pass, chosen by the memory plan (ref.mode=auto).
The trainer is jaxrl/algorithms/dpo.py."""

from __future__ import annotations

import hashlib
import os

import jax
import numpy as np

from jaxrl.data import prefs
from jaxrl.data.pipeline import FEATURES
from jaxrl.errors import ConfigError
from jaxrl.objectives import preference_losses as pl
from jaxrl.parallel.plan import GIB, Workload, memory_plan
from jaxrl.parallel.sync import make_placement

ROW_KEYS = FEATURES  # a row of a pair: the SFT pipeline's features


# ----------------------------------------------------------------------------- KTO rows


def unpair(batch: dict) -> dict:
  """[B, 2, S] pairs -> [2B, S] rows labelled 1 (chosen) and 0 (rejected), TRL's
  unpairing of preference data for KTO."""
  B = batch["inputs"].shape[0]
  out = {k: batch[k].reshape(2 * B, -1) for k in ROW_KEYS}
  out["label"] = np.tile(np.array([1.0, 0.0], np.float32), B)
  return out


def mismatched_rows(rows: dict, shift: int) -> dict:
  """KTO's KL rows: row i is prompt i followed by the completion (and eos) of row i + shift
  (mod N), as TRL builds its KL dataset. Over-long rows are cut at the sequence length."""
  N, S = rows["inputs"].shape
  out = {k: np.zeros_like(rows[k]) for k in ROW_KEYS}
  for i in range(N):
    j = (i + shift) % N
    first_i = int(np.argmax(rows["loss_mask"][i] > 0))  # = len(bos + prompt) - 1
    prompt = rows["inputs"][i, :first_i + 1]
    completion = rows["targets"][j][rows["loss_mask"][j] > 0]
    seq = np.concatenate([prompt, completion])[:S + 1]
    L = len(seq) - 1
    out["inputs"][i, :L], out["targets"][i, :L] = seq[:-1], seq[1:]
    out["loss_mask"][i, first_i:L] = 1.0
    out["positions"][i, :L] = np.arange(L)
    out["segment_ids"][i, :L] = 1
  return out


# ----------------------------------------------------------------------------- the cache


def row_keys(rows: dict) -> list[bytes]:
  """A content key per row ([..., S] arrays flattened to rows): equal tokens and mask give
  equal reference log-probs, so a cache keyed by content serves any shuffle of the data."""
  S = rows["inputs"].shape[-1]
  parts = [np.ascontiguousarray(rows[k].reshape(-1, S)) for k in ("inputs", "targets",
                                                                  "loss_mask")]
  return [hashlib.blake2b(b"".join(p[i].tobytes() for p in parts), digest_size=16).digest()
          for i in range(parts[0].shape[0])]


class RefCache:
  """Reference log-probs per row, filled by one pass of the reference, stored in DIR."""

  def __init__(self, path: str, key: str):
    self.path, self.key = path, key
    self.table: dict[bytes, float] = {}

  def load(self) -> bool:
    """True when DIR holds a cache made for this key (data, seq_len, reference)."""
    if not os.path.exists(self.path):
      return False
    with np.load(self.path) as f:
      if str(f["key"]) != self.key:
        return False
      keys, logps = f["row_keys"], f["logps"]
    self.table = {bytes(k): float(v) for k, v in zip(keys, logps)}
    return True

  def fill(self, score, batches) -> None:
    """score(rows) -> log-prob sums, one per row, for each batch of rows."""
    for rows in batches:
      for k, v in zip(row_keys(rows), np.asarray(score(rows)).reshape(-1)):
        self.table[k] = float(v)

  def save(self) -> None:
    keys = np.frombuffer(b"".join(self.table), np.uint8).reshape(len(self.table), 16)
    tmp = self.path + ".tmp.npz"
    np.savez(tmp, key=np.array(self.key), row_keys=keys,
             logps=np.array(list(self.table.values()), np.float32))
    os.replace(tmp, self.path)

  def lookup(self, rows: dict) -> np.ndarray:
    """The cached log-probs of rows [..., S], shaped [...]."""
    try:
      vals = [self.table[k] for k in row_keys(rows)]
    except KeyError:
      raise ConfigError(f"a batch row is missing from the reference cache {self.path}: the "
                        "data changed under the run; delete the file to rebuild it.") from None
    return np.asarray(vals, np.float32).reshape(rows["inputs"].shape[:-1])


def to_rows(batch: dict, a, *, paired: bool) -> dict:
  """The process-local numpy batch as the loss sees it (KTO: unpaired, with KL rows)."""
  kto = a.loss == "kto"
  if kto and paired:
    batch = unpair(batch)
  batch = {k: v for k, v in batch.items() if k in ROW_KEYS or k == "label"}
  if kto and a.kto_z0 == "mismatched":
    # Shift 2 when unpaired pairs: rows i and i+1 share a prompt, so i+2 is another pair's.
    kl = mismatched_rows(batch, 2 if paired else 1)
    batch.update({"kl_" + k: v for k, v in kl.items()})
  return batch



# ----------------------------------------------------------------------------- the reference


def plan_ref_mode(config, cfg, mesh, *, rows_per_step: int) -> tuple[str, str]:
  """(live | cached, why): what ref.mode=auto resolves to, from the memory plan."""
  replicas = mesh.shape["data"] * mesh.shape["fsdp"]
  work = Workload(reference=True, seq_len=config.data.seq_len,
                  rows=max(1, rows_per_step // (config.optim.accum_steps * replicas)))
  plan = memory_plan(cfg, make_placement(config.mesh), config.plan, workload=work)
  need = sum(plan.learner.values())  # actor, gradients, optimizer, reference, activations
  device = plan.device_bytes
  if device is None:
    stats = jax.local_devices()[0].memory_stats() or {}
    device = stats.get("bytes_limit")
  if device is None:
    return "live", "the device does not report its memory and plan.device is unset"
  verdict = "fit" if need <= device else "do not fit"
  why = (f"the learner roles with a reference copy need {need / GIB:.3f} GiB per device and "
         f"{verdict} in {device / GIB:.3f} GiB")
  return ("live" if need <= device else "cached"), why


def reference_mode(config, cfg, mesh, say) -> str:
  """none | live | cached: the reference the loss scores against; ref.mode=auto resolved by the
  memory plan."""
  a, d = config.algo, config.data
  kto, mode = a.loss == "kto", config.ref.mode
  if not pl.NEEDS_REFERENCE[a.loss]:
    say(f"reference: none ({a.loss} is reference-free)")
    return "none"
  if mode == "auto":
    rows = (d.batch_size * (2 if d.format == "prefs" else 1)
            * (2 if kto and a.kto_z0 == "mismatched" else 1))
    mode, why = plan_ref_mode(config, cfg, mesh, rows_per_step=rows)
    say(f"reference: ref.mode=auto -> {mode}: {why}")
  else:
    say(f"reference: ref.mode={mode}")
  if kto and mode == "cached" and a.kto_z0 == "mismatched":
    raise ConfigError("algo.kto_z0='mismatched' needs the live reference (the mismatched rows "
                      "change with every batch, so their log-probs cannot be cached): set "
                      "ref.mode=live, or algo.kto_z0=batch to keep the cache.")
  return mode


def cached_reference(r, report, train, eval_rows, score) -> RefCache:
  """The reference's log-probs of every train and held-out row: DIR/ref_logps.npz when it was
  made for this data and reference, else one pass of score(rows) over all of them, saved."""
  config, d = r.config, r.config.data
  key = "|".join([report["fingerprint"], report["eval_fingerprint"], f"seq_len={d.seq_len}",
                  f"format={d.format}", f"init={config.init.checkpoint}",
                  f"hf={config.model.get('hf_path') or ''}", f"model={r.cfg}",
                  f"seed={config.seed}"])
  cache = RefCache(r.run_dir.path("ref_logps.npz"), key)
  if cache.load():
    r.say(f"reference: {len(cache.table)} cached row log-probs from {cache.path}")
    return cache
  # The policy has not moved yet: it is the reference. All of the data, every process.
  fill_make = prefs.prefs_batches if d.format == "prefs" else prefs.kto_batches
  n = len(train)
  bs = max(r.replicas, min(config.ref.batch_size, n) // r.replicas * r.replicas)
  padded = [train[i % n] for i in range(-(-n // bs) * bs)]  # whole batches cover every row
  fill = fill_make(padded, r.tokenizer, seq_len=d.seq_len, batch_size=bs, seed=0,
                   shuffle=False, num_epochs=1, on_bad_row=d.on_bad_row, data_cfg=d)
  cache.fill(score, list(fill) + eval_rows)
  if r.main:
    cache.save()
  r.say(f"reference: scored {len(cache.table)} rows once; cached in {cache.path}")
  return cache
