"""What a run checks of its workdir before it trains: that no other run writes there, and, in a
job of several processes, that every process runs the same config into the same folder.

`WorkdirLock`: an exclusive `flock` on WORKDIR/.lock, held by process 0 for the length of the run
(the kernel releases it when the process dies, so a killed run leaves no stale lock). Two runs
into one workdir interleaved their metrics.jsonl lines and deleted each other's checkpoints.

`check_same_job`: process 0's config (field by field) against every other process's, and a file
process 0 writes in its workdir read back by the others (another folder, or one on each
machine's own disk, is refused: a checkpoint needs every process's shards in one folder). Mismatched configs hung at
the first step whose programs differed.
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


def _digest(text: str) -> int:
  return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def check_same_job(config: dict, workdir: str) -> None:
  """ConfigError on a process whose config or workdir differs from process 0's (every process
  calls this; one process: nothing to compare)."""
  if jax.process_count() == 1:
    return
  from jax.experimental import multihost_utils
  from moejax.train.checkpoint import flatten
  fields = sorted(flatten(config).items())
  me = jax.process_index()
  # The fields' count and names first (a broadcast needs one shape on every process: another
  # moejax version on one machine may have other fields), then each field's value.
  header = np.asarray([len(fields), _digest(json.dumps([k for k, _ in fields]))], np.int32)
  if not np.array_equal(header, np.asarray(multihost_utils.broadcast_one_to_all(header))):
    raise ConfigError(f"process {me} has other config fields than process 0 (another moejax "
                      "version?): run the same code and config on every process")
  mine = np.asarray([_digest(json.dumps(v, sort_keys=True)) for _, v in fields], np.int32)
  theirs = np.asarray(multihost_utils.broadcast_one_to_all(mine))
  if not np.array_equal(mine, theirs):
    field = fields[int(np.flatnonzero(mine != theirs)[0])][0]
    raise ConfigError(f"process {me} runs another config.{field} than process 0: start every "
                      "process of the job with the same config and workdir")
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
  if seen != str(token):
    raise ConfigError(f"process {me} does not see the file process 0 wrote in workdir "
                      f"{os.path.abspath(workdir)!r}: every process must write checkpoints to "
                      "one shared folder (the same --workdir, on a shared filesystem)")
  multihost_utils.sync_global_devices("moejax: workdir token read")

