"""The training loop every trainer shares: resume, step, guard, log, evaluate, checkpoint.

    state, start = resume(ckpt, state, shardings, batches, run)
    summary = train_loop(state=..., step_fn=..., batches=..., put=..., ...)

`batches` is any iterator of process-local numpy batches with get_state()/set_state() (grain's
DatasetIterator); its state is checkpointed beside the train state, so a resumed run sees the
same batches in the same order. Steps are dispatched asynchronously; the host waits only at log,
eval and save steps, where it fetches every step's metrics since the last wait and checks them
for NaN/Inf, so a checkpoint is never written from a diverged state.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

import jax

from jaxrl.parallel.distributed import any_process
from jaxrl.train.checkpoint import CheckpointFailed, Checkpointer, abstract_state
from jaxrl.train.rundir import RunDir, logged_before


class TrainingDiverged(RuntimeError):
  """The loss (or gradient norm) became NaN or Inf; the message says where the last good
  checkpoint is."""


# ----------------------------------------------------------------------------- interrupts


class Interrupts:
  """SIGTERM/SIGINT handlers that ask the loop to save and stop at the next step boundary.

  TPU VM preemption sends SIGTERM. The first signal requests the save; later ones (a second
  Ctrl-C, a launcher that repeats SIGTERM) are absorbed, with one line said, until the
  checkpoint is committed and summary.json written: the handlers stay installed until then, so
  no signal can kill the process half way through a write (kill -9 still can, and a resume
  never picks up a half-written checkpoint). With several processes the request is agreed on
  every step, so all of them stop (and save) at the same step even if only one received it.
  """

  def __init__(self, *, say: bool = True):
    self.signum: int | None = None
    self.say = say
    self._absorbed = False
    self._previous = {}
    self._any = None

  def _handle(self, signum, frame):
    if self.signum is None:
      self.signum = signum
    elif not self._absorbed:
      self._absorbed = True
      if self.say:
        # os.write, not print: the signal may land inside a print, and print is not reentrant.
        line = (f"{signal.Signals(signum).name} again: ignored while the checkpoint is saved "
                "and summary.json written (kill -9 abandons them).\n")
        try:
          os.write(sys.stderr.fileno(), line.encode())
        except (OSError, ValueError, AttributeError):
          pass  # no real stderr (a notebook): absorbed silently

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for s in (signal.SIGTERM, signal.SIGINT):
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc):
    for s, h in self._previous.items():
      signal.signal(s, h)

  def requested(self) -> bool:
    # Through the coordination service, not a program over every device: async GRPO's
    # producer may be running the sampler's programs meanwhile (distributed.any_process).
    if self._any is None:
      self._any = any_process("stop_request")
    return self._any(self.signum is not None)


# ----------------------------------------------------------------------------- progress


class Progress:
  """A tqdm bar on a TTY (step, loss, tokens/s); plain log lines otherwise. Process 0 only."""

  def __init__(self, total: int, start: int, *, enabled: bool, out=print):
    self.out = out if enabled else (lambda *_: None)
    self.bar = None
    if enabled and sys.stdout.isatty():
      from tqdm import tqdm
      self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)
    self.total = total

  def update(self, step: int, metrics: dict) -> None:
    if self.bar is not None:
      self.bar.n = step
      self.bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}",  # (PPO's warm-up)
                           tok_s=f"{metrics.get('perf/tokens_per_s', 0):.0f}", refresh=True)
    else:
      keys = [k for k in ("loss", "lr", "grad_norm", "critic/value_loss", "perf/tokens_per_s")
              if k in metrics]
      warmup = " (critic warm-up: the actor waits)" if metrics.get("critic/warmup") else ""
      self.out(f"step {step}/{self.total} "
               + " ".join(f"{k}={_fmt(metrics[k])}" for k in keys) + warmup)

  def note(self, text: str) -> None:
    if self.bar is not None:
      self.bar.write(text)
    else:
      self.out(text)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def _fmt(v: float) -> str:
  return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"


# ----------------------------------------------------------------------------- resume


def resume(ckpt: Checkpointer, state, shardings, batches, run: RunDir, *, out=print,
           updates_per_step: int = 1):
  """(state, step): the latest checkpoint's state and data position when DIR has one, else the
  given fresh state at its own step. Metrics logged past the checkpoint (all of them, without
  one) are dropped, since those steps run again. A trainer whose step makes several optimizer
  updates (GRPO's iterations x minibatches) passes `updates_per_step`; checkpoints are keyed by
  its steps."""
  step = ckpt.latest_step()
  if step is None:
    run.truncate_metrics(-1)  # rows from an attempt that never committed a checkpoint
    return state, int(jax.device_get(state.step)) // updates_per_step
  target = abstract_state(jax.eval_shape(lambda: state), shardings)
  del state  # free the fresh state before the restored one arrives
  restored, data_state = ckpt.restore(target, step)
  batches.set_state(data_state)
  run.truncate_metrics(step)
  if jax.process_index() == 0:
    out(f"resuming from {ckpt.directory} at step {step}")
  return restored, step


# ----------------------------------------------------------------------------- the loop


def _first_bad(pending: list[tuple[int, dict]]) -> tuple[int, str, float] | None:
  for step, m in pending:
    for k in ("loss", "grad_norm"):
      if k in m and not math.isfinite(float(m[k])):
        return step, k, float(m[k])
  return None


def train_loop(*, state, step_fn: Callable, batches, put: Callable, total_steps: int,
               run: RunDir, ckpt: Checkpointer | None, log_every: int, save_every: int,
               eval_every: int = 0, eval_fn: Callable | None = None,
               tokens_fn: Callable | None = None, flops_fn: Callable | None = None,
               updates_per_step: int = 1,
               summary_extra: Callable[[], dict] | None = None, out=print) -> dict:
  """Runs steps until `total_steps`, an interrupt, or a non-finite loss. Returns the summary
  (also written to DIR/summary.json): status, step, last metrics, wall time.

  put(batch) turns a process-local numpy batch into global device arrays; tokens_fn(batch)
  counts its real (non-padding) tokens for `perf/tokens_per_s`, and flops_fn(batch) the model
  FLOPs the step spends on it (jaxrl.models.flops) for `perf/tflops`, over the whole mesh (the
  MFU numerator). `total_steps` and the logged steps count calls of step_fn, each making
  `updates_per_step` optimizer updates.
  summary_extra() gives a trainer's own summary fields (its data report, GRPO's alarms), read
  when the summary is written, so they land in summary.json however the loop ended.
  """
  main = jax.process_index() == 0
  step = int(jax.device_get(state.step)) // updates_per_step
  start_step, t_start = step, time.perf_counter()
  progress = Progress(total_steps, step, enabled=main, out=out)
  pending: list[tuple[int, dict]] = []
  # A resumed run starts from what it logged before (a finished one re-run keeps its numbers).
  last, evals = logged_before(run.workdir, step) if step > 0 else ({}, {})
  if main and step >= total_steps > 0:
    out(f"this run is already complete (step {step} of {total_steps}): its summary is "
        f"{os.path.join(run.workdir, 'summary.json')} (raise train.steps to train on).")
  status = "failed"  # until the loop ends normally or is interrupted
  t_last, steps_since, tokens_since, flops_since = time.perf_counter(), 0, 0, 0.0
  with Interrupts(say=main) as interrupts:
    try:
      if step == 0 and eval_fn is not None and eval_every > 0:
        # The untrained baseline, so every curve starts where the model started.
        evals = eval_fn(state.params, 0)
        run.log(0, evals)
        progress.note("eval @ 0: " + " ".join(f"{k}={_fmt(v)}" for k, v in evals.items()))
      while step < total_steps:
        batch = next(batches)
        tokens_since += tokens_fn(batch) * jax.process_count() if tokens_fn else 0
        flops_since += flops_fn(batch) * jax.process_count() if flops_fn else 0.0
        state, metrics = step_fn(state, put(batch))
        step += 1
        steps_since += 1
        pending.append((step, metrics))
        stop = interrupts.requested()
        final = step == total_steps or stop
        do_eval = eval_fn is not None and eval_every > 0 and (
            step % eval_every == 0 or step == total_steps)
        do_save = ckpt is not None and (step % save_every == 0 or final)
        do_log = step % log_every == 0 or final or do_eval
        if not (do_log or do_save):
          continue
        host = jax.device_get(pending)  # the one wait: every pending step's scalars
        pending = []
        if ckpt is not None:
          ckpt.check()  # a failed background write stops the run here, not steps later
        bad = _first_bad(host)
        if bad is not None:
          status = "diverged"
          raise _diverged(bad, ckpt)
        dt = time.perf_counter() - t_last
        last = {k: float(v) for k, v in host[-1][1].items()}
        last["timing_s/step"] = dt / steps_since
        if tokens_fn:
          last["perf/tokens_per_s"] = tokens_since / dt
        if flops_fn:
          last["perf/tflops"] = flops_since / dt / 1e12
        if do_eval:
          t0 = time.perf_counter()
          evals = eval_fn(state.params, step)
          last.update(evals)
          last["timing_s/eval"] = time.perf_counter() - t0
        if do_log:
          run.log(step, last)
          progress.update(step, last)
          if do_eval:
            progress.note(f"eval @ {step}: " + " ".join(
                f"{k}={_fmt(v)}" for k, v in evals.items()))
        if do_save:
          ckpt.save(step, state, batches.get_state())
        t_last, steps_since, tokens_since, flops_since = time.perf_counter(), 0, 0, 0.0
        if stop:
          status = "interrupted"
          sig = signal.Signals(interrupts.signum).name if interrupts.signum else "a signal"
          progress.note(f"{sig} at step {step}: checkpoint saved; re-run the same command to "
                        "resume.")
          break
      else:
        status = "completed"
    finally:
      progress.close()
      summary = {"status": status, "step": step, "start_step": start_step,
                 "total_steps": total_steps, "wall_s": time.perf_counter() - t_start,
                 "metrics": last, "eval": evals, **(summary_extra() if summary_extra else {})}
      _finish(run, ckpt, summary)
  return {**summary, "state": state}


def _diverged(bad: tuple[int, str, float], ckpt: Checkpointer | None) -> TrainingDiverged:
  where = (f"the last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}"
           if ckpt is not None and ckpt.latest_step() is not None
           else "no checkpoint was saved before it")
  return TrainingDiverged(
      f"{bad[1]} is {bad[2]} at step {bad[0]}: training stopped and nothing was saved past it; "
      f"{where}. Lower optim.lr or tighten optim.clip_norm, then re-run.")


def _finish(run: RunDir, ckpt: Checkpointer | None, summary: dict) -> None:
  """Waits for the checkpoint's async writes (they must land before the process exits), then
  writes DIR/summary.json: status "failed" and the error where a write failed, which is then
  raised."""
  failed = None
  if ckpt is not None:
    try:
      ckpt.wait()
    except CheckpointFailed as e:
      failed = e
  write_failed = ckpt.failed if ckpt is not None else None
  if failed is not None or write_failed is not None:
    summary["status"] = "failed"
  if write_failed is not None:
    summary["error"] = str(write_failed)
  try:
    run.write_summary(summary)
  except OSError:
    # A failed checkpoint write (a full disk) is the sentence the user needs; a summary the
    # same disk cannot take must not replace it with a traceback.
    if failed is None and write_failed is None:
      raise
  if failed is not None:
    raise failed
