"""Joining a multi-process JAX job (`jax.distributed`), and noticing when a process is lost.

Joining. By flag or JAX_* variable (`--coordinator_address`, `--num_processes`,
`--process_id`), or with none of them under a cluster manager: a task of a multi-task SLURM step,
or a pod of a Kubernetes Job (with jax[k8s]), where jax.distributed's own auto-detection reads
the coordinator, process count and index from the environment (examples: docs/cluster.md).

On CPU, collectives between processes need a cross-process implementation; we ask for gloo
(TCP, no extra dependencies) unless JAX_CPU_COLLECTIVES_IMPLEMENTATION names another ("mpi").
The choice must be made before the first backend is created, i.e. before `initialize`.

A lost process. When one process of a job dies, the others hang: in their next collective
(gloo waits for the missing peer) or, if gloo reports the closed connection, in jax.distributed's
shutdown barrier. jax.distributed notices only after its heartbeat timeout (100 s by default) and
then aborts the process with a multi-line log. So every process also keeps a `Watchdog`: one TCP
connection to process 0 (a star; process 0 publishes its port with one broadcast at start-up),
a heartbeat on it every `heartbeat_timeout_s / 5` seconds (at most 5 s), and a thread per
connection that reads it. A connection that closes (the process exited or was killed: the kernel closes its
sockets at once) or stays silent for `config.distributed.heartbeat_timeout_s` means that process
is lost: the watcher prints one line naming it and exits with code 2 at once, from its own
thread, whatever the main thread is blocked in. Process 0 tells the others which process it
lost before it exits, so they name the same one. jax.distributed's own heartbeat timeout is set
to twice ours plus `JAX_MARGIN_S`, as a backstop that fires after our line (at ours + 10 s, jax
declared a stopped process dead first: after 23 s against its 40).

Leaving. `finish()` (a clean end: the others stop watching this process) and `stop(code)` (this
process stops with an error it has printed: the others stop too, saying so, and this process
exits without waiting on them) are what train.py calls; to the others, an exit without either
(an uncaught exception) is an error exit too. On a peer's error exit a process waits
`ERROR_GRACE_S` first: when every process stops for the same reason at once (a config that
differs between them), each prints that reason rather than the other's exit.
"""
from __future__ import annotations

import atexit
import importlib.util
import os
import socket
import sys
import threading
import time

import jax
import numpy as np

from moejax.errors import ConfigError

CPU_COLLECTIVES_ENV = "JAX_CPU_COLLECTIVES_IMPLEMENTATION"
JAX_MARGIN_S = 10              # jax.distributed's heartbeat timeout = 2 x ours + this
CONNECT_TIMEOUT_S = 120        # for all processes to connect to process 0's watchdog
JOIN_TIMEOUT_S = 300           # for all processes to join jax.distributed (jax's default)
LOST_EXIT_CODE = 2
ERROR_GRACE_S = 1.0           # a peer's error exit: how long this process's own error may take

_watchdog: "Watchdog | None" = None


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None:
    return None
  try:
    return int(value)
  except ValueError:
    raise ConfigError(f"{name}={value!r}: expected an integer") from None


# One task of a multi-task SLURM step: the variables jax's SlurmCluster reads.
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
              "SLURM_LOCALID")


def detected_cluster() -> str | None:
  """The cluster manager jax.distributed can bootstrap this job from with no flags: "slurm" (a
  task of an srun step of more than one task) or "k8s" (a pod of an Indexed Kubernetes Job, with
  the `kubernetes` client installed: jax[k8s]); None otherwise (one process)."""
  if all(v in os.environ for v in SLURM_VARS) and (_env_int("SLURM_NTASKS") or 1) > 1:
    return "slurm"
  if ("KUBERNETES_SERVICE_HOST" in os.environ and "JOB_COMPLETION_INDEX" in os.environ
      and importlib.util.find_spec("kubernetes")):    # a pod of an Indexed Job
    return "k8s"
  return None


def _use_gloo_on_cpu() -> None:
  if not os.environ.get(CPU_COLLECTIVES_ENV):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, *, heartbeat_timeout_s: int = 30) -> bool:
  """Initializes jax.distributed if a coordinator is given by flag or environment, or if a
  cluster manager started this process (`detected_cluster`: jax.distributed's own
  auto-detection then finds the coordinator, process count and index), and starts this
  process's `Watchdog` (`heartbeat_timeout_s`: config.distributed.heartbeat_timeout_s)."""
  coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
  if not coordinator and num_processes is None and process_id is None:
    cluster = detected_cluster()
    if cluster is None:
      return False
    _use_gloo_on_cpu()
    try:
      jax.distributed.initialize(
          heartbeat_timeout_seconds=_jax_heartbeat_s(heartbeat_timeout_s))
    except RuntimeError as e:      # e.g. a Job without a headless Service, or no permission
      detail = " ".join(str(e).split())
      raise ConfigError(f"this looks like a {cluster} job, but jax.distributed could not start "
                        f"it from the environment: {detail[:300]}") from None
    from jax._src import distributed as jax_distributed   # the address jax detected
    _watch(jax_distributed.global_state.coordinator_address, jax.process_index(),
           jax.process_count(), heartbeat_timeout_s)
    return True
  if not coordinator:
    raise ConfigError("--num_processes/--process_id were given without --coordinator_address "
                      "(or JAX_COORDINATOR_ADDRESS)")
  if num_processes is None:
    num_processes = _env_int("JAX_NUM_PROCESSES")
  if process_id is None:
    process_id = _env_int("JAX_PROCESS_ID")
  if num_processes is None or process_id is None:
    raise ConfigError("a coordinator address was given but not both --num_processes and "
                      "--process_id (or JAX_NUM_PROCESSES and JAX_PROCESS_ID)")
  if not 0 <= process_id < num_processes:
    raise ConfigError(f"--process_id={process_id} must be in [0, num_processes={num_processes})")
  _use_gloo_on_cpu()
  # jax waits JOIN_TIMEOUT_S for every process to join, then aborts with its own log.
  print(f"moejax: process {process_id} of {num_processes} joining the job at {coordinator} "
        f"(waits up to {JOIN_TIMEOUT_S} s for the others)", flush=True)
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             initialization_timeout=JOIN_TIMEOUT_S,
                             process_id=process_id,
                             heartbeat_timeout_seconds=_jax_heartbeat_s(heartbeat_timeout_s))
  _watch(coordinator, process_id, num_processes, heartbeat_timeout_s)
  return True


def _jax_heartbeat_s(heartbeat_timeout_s) -> int:
  """jax.distributed's heartbeat timeout: past ours. Measured (2 processes, one SIGSTOPped,
  ours 30 s): jax declared the silent process dead after 23 s with its timeout at 40 s, before
  our line, so its timeout is set to twice ours plus the margin."""
  return 2 * int(heartbeat_timeout_s) + JAX_MARGIN_S


def _watch(coordinator: str, process_id: int, num_processes: int, heartbeat_timeout_s) -> None:
  global _watchdog
  if num_processes > 1:
    _watchdog = Watchdog(_host(coordinator), process_id, num_processes, heartbeat_timeout_s)
    atexit.register(_watchdog.close, clean=False)


def finish() -> None:
  """This process ends cleanly: the other processes stop watching it."""
  if _watchdog is not None:
    _watchdog.close(clean=True)


def stop(code: int) -> None:
  """This process stops with an error it has already printed. In a multi-process job: tells the
  others (they stop too, saying so) and exits now, without waiting on them; else returns."""
  if _watchdog is not None:
    _watchdog.close(clean=False)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _host(address: str) -> str:
  host = address.rsplit(":", 1)[0] if ":" in address else address
  return host.strip("[]")


class Watchdog:
  """Heartbeats between process 0 and each other process; see the module docstring.

  Messages on a connection (bytes): b"h" heartbeat, b"B" a clean end, b"E" an error exit,
  b"L<j>\\n" (from process 0) process j is lost. A new process sends b"I<id>\\n" first.
  """

  def __init__(self, coordinator_host: str, process_id: int, num_processes: int,
               timeout_s: float):
    from jax.experimental import multihost_utils
    self.process_id, self.num_processes = process_id, num_processes
    self.timeout_s = float(timeout_s)
    self._lock = threading.Lock()
    self._closed = False
    self._peers: dict[int, socket.socket] = {}        # process id -> connection
    server = None
    if process_id == 0:        # all interfaces, as the coordinator service binds by default
      if socket.has_dualstack_ipv6():
        server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True,
                                      backlog=num_processes)
      else:
        server = socket.create_server(("", 0), backlog=num_processes)
      port = server.getsockname()[1]
    else:
      port = 0
    port = int(multihost_utils.broadcast_one_to_all(np.asarray(port, np.int32)))
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    if process_id == 0:
      server.settimeout(CONNECT_TIMEOUT_S)
      try:
        while len(self._peers) < num_processes - 1:
          conn, _ = server.accept()
          conn.settimeout(max(deadline - time.monotonic(), 1.0))
          hello = _read_line(conn)
          if hello.startswith(b"I") and hello[1:].isdigit():
            self._peers[int(hello[1:])] = conn
          else:
            conn.close()
      except OSError as e:
        missing = sorted(set(range(1, num_processes)) - set(self._peers))
        raise ConfigError(f"process(es) {', '.join(map(str, missing))} never reached process "
                          f"0's watchdog on port {port} within {CONNECT_TIMEOUT_S} s "
                          f"({e.strerror or e}); the processes must reach each other over "
                          "TCP, as they reach the coordinator") from None
      finally:
        server.close()
    else:
      while True:
        try:
          conn = socket.create_connection((coordinator_host, port), timeout=5)
          break
        except OSError as e:
          if time.monotonic() > deadline:
            raise ConfigError(f"cannot reach process 0's watchdog at {coordinator_host}:{port} "
                              f"({e.strerror or e}); the processes must reach each other over "
                              "TCP, as they reach the coordinator") from None
          time.sleep(0.2)
      conn.sendall(b"I%d\n" % process_id)
      self._peers[0] = conn
    for peer, conn in self._peers.items():
      conn.settimeout(self.timeout_s)
      threading.Thread(target=self._watch, args=(peer, conn), daemon=True,
                       name=f"moejax-watchdog-{peer}").start()
    threading.Thread(target=self._beat, daemon=True, name="moejax-heartbeat").start()

  def _beat(self) -> None:
    interval = max(min(self.timeout_s / 5, 5.0), 0.1)
    while not self._closed:
      for conn in list(self._peers.values()):
        try:
          conn.sendall(b"h")
        except OSError:
          pass                       # its watcher notices
      time.sleep(interval)

  def _watch(self, peer: int, conn: socket.socket) -> None:
    pending = b""
    while True:
      try:
        data = conn.recv(256)
      except socket.timeout:
        return self._lost(peer, f"no heartbeat for {self.timeout_s:g} s "
                                "(config.distributed.heartbeat_timeout_s)")
      except ConnectionResetError:
        # A process that dies with heartbeats unread in its socket resets the connection
        # instead of closing it: the same loss.
        data = b""
      except OSError as e:
        return self._lost(peer, f"its connection failed: {e.strerror or e}")
      if self._closed:
        return
      if not data:
        return self._lost(peer, "its connection closed: the process exited or was killed")
      pending += data.replace(b"h", b"")
      if b"B" in pending:
        return                       # a clean end: no longer watched
      if b"E" in pending:
        return self._lost(peer, "see its output", error=True)
      if b"L" in pending and b"\n" in pending[pending.index(b"L"):]:
        start = pending.index(b"L")
        lost = pending[start + 1:pending.index(b"\n", start)]
        return self._lost(int(lost) if lost.isdigit() else peer, "reported by process 0")

  def _lost(self, peer: int, why: str, error: bool = False) -> None:
    if error:
      # The peer printed why it stopped, and this process may be stopping for the same reason
      # (every process makes the job's checks at once): its own line, if it has one, comes
      # first (its `stop` closes this watchdog, and this line is not printed).
      time.sleep(ERROR_GRACE_S)
    with self._lock:
      if self._closed:
        return
      self._closed = True
    if self.process_id == 0:         # the others learn which process, not just "process 0"
      for other, conn in self._peers.items():
        if other != peer:
          try:
            conn.sendall(b"L%d\n" % peer)
          except OSError:
            pass
    what = "stopped with an error" if error else "was lost"
    print(f"error: process {peer} of {self.num_processes} {what} ({why}); process "
          f"{self.process_id} stops too: rerun every process to resume from the latest "
          "checkpoint", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(LOST_EXIT_CODE)

  def close(self, clean: bool) -> None:
    """Tells the peers that this process ends (b"B" if clean, else b"E") and stops watching."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    for conn in self._peers.values():
      try:
        conn.sendall(b"B" if clean else b"E")
        conn.shutdown(socket.SHUT_WR)
      except OSError:
        pass


def _read_line(conn: socket.socket) -> bytes:
  line = b""
  while not line.endswith(b"\n") and len(line) < 32:
    chunk = conn.recv(1)
    if not chunk:
      break
    line += chunk
  return line.strip()
