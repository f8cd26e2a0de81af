"""What a run checks of its workdir before it trains: that no other run writes there, and, in a
job of several processes, that every process runs the same config into the same folder.

`WorkdirLock`: an exclusive `flock` on WORKDIR/.lock, held by process 0 for the length of the run
(the kernel releases it when the process dies, so a killed run leaves no stale lock). Two runs
into one workdir interleaved their metrics.jsonl lines and deleted each other's checkpoints.

`check_same_job`: process 0's config (field by field) against every other process's, and a file
process 0 writes in its workdir read back by the others (another folder, or one on each
machine's own disk, is refused: a checkpoint needs every process's shards in one folder).
Mismatched configs hung at the first step whose programs differed. Every process gathers every
process's view, so all of them stop with the same line.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import socket
import time

import jax
import numpy as np

from moejax.errors import ConfigError

LOCK_FILE = ".lock"
JOB_FILE = ".job"


class WorkdirLock:
  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._file = open(self.path, "a+", encoding="utf-8")
    try:
      fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
        # A filesystem without flock (Lustre without -o flock, some FUSE mounts): run unlocked.
        print(f"moejax: warning: cannot lock {self.path} ({e.strerror}); another run into "
              "this workdir would not be refused", flush=True)
        return
      self._file.seek(0)
      holder = self._file.read().strip() or "another process"
      self._file.close()
      raise ConfigError(f"workdir {workdir!r} is in use by another run ({holder}): wait for it "
                        "to end, or choose another --workdir") from None
    self._file.seek(0)
    self._file.truncate()
    self._file.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    self._file.flush()

  def release(self) -> None:
    if not self._file.closed:
      fcntl.flock(self._file, fcntl.LOCK_UN)
      self._file.close()


def new_to_every_process(new_here: bool) -> bool:
  """Whether every process of the job found no workdir before any made one (each says whether
  it found none; the gather is the barrier): a job's failed start removes the workdir only then.
  A folder that existed for any process (its own, where workdirs differ) is kept."""
  if jax.process_count() == 1:
    return new_here
  from jax.experimental import multihost_utils
  return bool(np.all(multihost_utils.process_allgather(np.int32(new_here))))


def remove_if_unused(workdir: str) -> bool:
  """Removes a workdir that a run created and stopped in before any step was logged or any
  checkpoint saved (a bad data path, a compile that ran out of memory, Ctrl-C): what it holds
  (the lock, the tokenizer's copy, an empty metrics.jsonl) was written by that start and says
  nothing, and a workdir left behind read as a run that had begun. True if removed."""
  import shutil
  from moejax.data.tokenizer import TOKENIZER_CONFIG_FILE
  from moejax.train.checkpoint import checkpoint_dir
  from moejax.weights import TOKENIZER_FILE
  metrics = os.path.join(workdir, "metrics.jsonl")
  checkpoints = checkpoint_dir(workdir)
  known = {LOCK_FILE, JOB_FILE, os.path.basename(checkpoints), os.path.basename(metrics),
           TOKENIZER_FILE, TOKENIZER_CONFIG_FILE}
  try:
    if ((os.path.exists(metrics) and os.path.getsize(metrics) > 0)
        or (os.path.isdir(checkpoints) and os.listdir(checkpoints))
        or any(name not in known and not name.startswith("events.out.tfevents")
               for name in os.listdir(workdir))):   # a profile, or what another tool wrote
      return False
    shutil.rmtree(workdir)
  except OSError:
    return False
  return True


def _digest(text: str) -> int:
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def check_same_job(config: dict, workdir: str) -> None:
  """ConfigError, on every process alike, when some process's config or workdir differs from
  process 0's (one process: nothing to compare). Each check gathers every process's view, so
  all of them stop with the same line instead of one stopping and the others waiting for it."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils
  from moejax.train.checkpoint import flatten
  fields = sorted(flatten(config).items())
  # The fields' count and names first (a gather needs one shape on every process: another
  # moejax version on one machine may have other fields), then each field's value.
  header = np.asarray([len(fields), _digest(json.dumps([k for k, _ in fields]))], np.int32)
  headers_PxH = np.asarray(multihost_utils.process_allgather(header))
  other = _first_other(headers_PxH)
  if other is not None:
    raise ConfigError(f"process {other} has other config fields than process 0 (another moejax "
                      "version?): run the same code and config on every process")
  mine = np.asarray([_digest(json.dumps(v, sort_keys=True)) for _, v in fields], np.int32)
  digests_PxF = np.asarray(multihost_utils.process_allgather(mine))
  other = _first_other(digests_PxF)
  if other is not None:
    field = fields[int(np.flatnonzero(digests_PxF[other] != digests_PxF[0])[0])][0]
    raise ConfigError(f"process {other} runs another config.{field} than process 0: start every "
                      "process of the job with the same config and workdir")
  me = jax.process_index()
  token = int(np.random.default_rng().integers(1, 2**31 - 1))
  token = int(np.asarray(multihost_utils.broadcast_one_to_all(np.int32(token))))
  path = os.path.join(workdir, JOB_FILE)
  if me == 0:
    with open(path, "w", encoding="utf-8") as f:
      f.write(str(token))
  multihost_utils.sync_global_devices("moejax: workdir token written")
  try:
    with open(path, encoding="utf-8") as f:
      seen = f.read().strip()
  except OSError:
    seen = ""
  sees_P = np.asarray(multihost_utils.process_allgather(np.int32(seen == str(token))))
  blind = [int(p) for p in np.flatnonzero(sees_P == 0)]
  if blind:
    who = "process " + ", ".join(map(str, blind[:8])) + (", ..." if len(blind) > 8 else "")
    raise ConfigError(f"{who} does not see the file process 0 wrote in its workdir (this "
                      f"process's: {os.path.abspath(workdir)!r}): every process must write "
                      "checkpoints to one shared folder (the same --workdir, on a shared "
                      "filesystem)")


def _first_other(rows_PxK):
  """The first process whose row differs from process 0's, or None."""
  differs_P = np.any(rows_PxK != rows_PxK[:1], axis=1)
  return int(np.argmax(differs_P)) if differs_P.any() else None
