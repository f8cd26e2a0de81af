"""Stop requests: SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption or time limit) during a
run end it at a step boundary with a checkpoint there, so a rerun resumes from it.

One process: handlers for both signals note the request; the loop finishes its step, saves and
raises `Interrupted`. A second signal of the same kind acts as it would without moejax (Ctrl-C
twice stops at once). Several processes must stop at the same step, or the ones still training
wait forever in their next collective: jax.distributed's preemption notifier receives SIGTERM,
and every process learns of it at the same step (`reached_preemption_sync_point`, called by all
of them each step); SIGINT is forwarded to it as SIGTERM.
"""
from __future__ import annotations

import os
import signal
import threading

import jax

from moejax.errors import MoejaxError


class Interrupted(MoejaxError):
  """The run stopped on a signal after saving its checkpoint; `exit_code` 128 + the signal."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.exit_code = 128 + signum


def _preemption_service() -> bool:
  """Whether jax.distributed runs its preemption sync manager (jax_enable_preemption_service)."""
  from jax._src import distributed as jax_distributed
  state = getattr(jax_distributed, "global_state", None)
  return getattr(state, "preemption_sync_manager", None) is not None


class StopRequests:
  """Installed for the length of a run (`close` puts the previous handlers back)."""

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict = {}
    self._multi = jax.process_count() > 1
    # Several processes without jax's preemption service: nothing would take a forwarded
    # SIGTERM, nor answer the sync point; signals act as before.
    self._sync = self._multi and _preemption_service()
    if threading.current_thread() is not threading.main_thread():
      return                      # Python delivers signals to the main thread only
    if self._multi and not self._sync:
      return
    for sig in (signal.SIGINT,) if self._multi else (signal.SIGINT, signal.SIGTERM):
      self._previous[sig] = signal.signal(sig, self._handle)
    # A signal that train.py's handler saw but Python dropped (raised in a gc callback): taken
    # up as a request, so the run stops after its first step (train.EarlySignal).
    seen = getattr(self._previous.get(signal.SIGINT), "seen", None)
    if seen in self._previous:
      self._handle(seen, None)

  def _handle(self, signum, frame):
    del frame
    if self.signum == signum:     # the second one: as without moejax
      self.close()
      signal.raise_signal(signum)
      return
    self.signum = signum
    if self._multi:               # to jax's preemption notifier, which all processes consult
      os.kill(os.getpid(), signal.SIGTERM)

  def requested(self, step: int) -> bool:
    """Whether to stop after this run's `step`-th step, counted from 1 in this run (every
    process calls this at every step of the run). jax's sync point counts its calls from 0 and
    stops one past the highest count any process had reached when the signal came, so the
    count must be the run's own, not the training step (a resumed run would never meet it)."""
    if not self._multi:
      return self.signum is not None
    if not self._sync:
      return False
    from jax.experimental import multihost_utils
    return bool(multihost_utils.reached_preemption_sync_point(step))

  def interrupted(self, step: int, saved: str) -> Interrupted:
    """The error the run stops with after saving `step` at `saved`."""
    asked = (signal.Signals(self.signum).name if self.signum is not None else
             "SIGTERM to a process of the job")
    return Interrupted(f"stopped on {asked} after step {step}, saved {saved}; rerun the same "
                       "command to resume", self.signum or signal.SIGTERM)

  def close(self) -> None:
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._previous = {}
