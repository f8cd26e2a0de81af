"""Shared test set-up: 8 fake CPU devices, strict numerics, shared compiled trainers, and a
per-file compile-time report at the end of the run.

Compiling the sharded train step is the slow part of this suite on CPU. Tests that train get
their Trainer from the session fixture `trainer_for(cfg, num_devices)`, memoized on the frozen
config, so every test of one canonical config (tests/helpers.py: `canonical_config`) shares one
set of compiled steps; new tests reuse those configs before compiling new ones. The train step
of every shared Trainer is guarded by `chex.assert_max_traces(n=1)`: a test that makes it
retrace (a batch of another shape, dtype or sharding) fails instead of silently recompiling; its
init function compiles once.

Under pytest-xdist (`-n 2`, see pyproject.toml) the tests of one file, and the files that share
a canonical config (XDIST_GROUPS), run on one worker, so nothing compiles twice.
"""
import collections
import os
import threading
import time

# Must be set before jax is imported anywhere in the test session. LLVM at -O0: compiling the
# sharded train steps is most of this suite's time, and -O0 roughly halves XLA:CPU's code
# generation (canonical fsdp step: 13.3 -> 9.2 s compile, codec/test_training 186 -> 90 s) while
# each step runs about 3x slower (85 -> 248 ms), a good trade for tests that run a few steps.
# Re-measured on the whole suite (529 tests, -n 2): -O0 820 test-s (431 s wall) against -O2's
# 918 (479 s); only step-heavy files gain at -O2 (the replica-codec run, then a file of its
# own, 62 -> 47 s).
# Flags that gave no compile win (codec/test_training, -n 0): within noise,
# --xla_llvm_disable_expensive_passes, loop unrolling and SLP off, the concurrency-optimized
# scheduler off; slower (33 vs 28 s), --xla_cpu_emitter_verification_level=0 and
# --xla_cpu_parallel_codegen_split_count=1.
# Values move by float rounding only (FMA contraction); every bit-exact comparison here is
# between programs compiled alike. Subprocesses get the same flags (tests/helpers.xla_flags).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" {TEST_XLA_FLAGS} --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import chex  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# As a CPU Trainer does (moejax.host_memory), from the start: steps reuse freed pages.
from moejax import host_memory  # noqa: E402

host_memory.keep_freed_memory_mapped()

# No persistent compilation cache: on XLA:CPU (jax 0.11) an executable with collectives loaded
# back from the cache can deadlock its devices (seen: one device in an all-reduce while the
# others wait in an all-gather). Every test session compiles afresh.

# Files that share compiled trainers run on the same xdist worker (one group each).
XDIST_GROUPS = {
    "tiny8": ("tests/train/test_step.py", "tests/train/test_checkpoint.py",
              "tests/train/test_init_from.py", "tests/train/test_faults.py",
              "tests/sharding/test_collectives.py",
              "tests/sharding/test_memory.py", "tests/sharding/test_prefetch.py",
              "tests/sharding/test_overlap.py", "tests/train/test_latency_profile.py",
              "tests/test_generate.py", "tests/test_evaluate.py"),
    "codec_auto": ("tests/codec/test_loop.py", "tests/codec/test_training.py",
                   "tests/report/test_report.py",
                   "tests/sharding/test_multiprocess.py"),
    # the files that ask the torch reference (tests/convert/conftest.py): one worker builds its
    # random models once (apart, each worker built all of them)
    "hf_reference": ("tests/convert/test_hf_parity.py", "tests/convert/test_fine_tune.py"),
}


# ------------------------------------------------------------------------------------------------
# Shared trainers.

_TRAINERS: dict = {}


def _guarded_trainer(cfg, num_devices):
  """A Trainer whose train steps may each trace once: `Trainer(trace_guard=...)` wraps every step
  function in chex.assert_max_traces (named per trainer: chex keys its counters by name and call
  site, and every Trainer's step has the same source)."""
  from moejax.sharding.mesh import make_mesh
  from moejax.train.loop import Trainer
  prefix = f"train_step[{len(_TRAINERS)}]"
  made = []

  def guard(fn):
    def train_step(*a, **k):
      return fn(*a, **k)

    train_step.__name__ = train_step.__qualname__ = f"{prefix}.{len(made)}"
    made.append(train_step.__name__)
    return chex.assert_max_traces(train_step, n=1)

  mesh = make_mesh((1, -1), jax.devices()[:num_devices]) if num_devices else None
  return Trainer(cfg, mesh=mesh, trace_guard=guard)


@pytest.fixture(scope="session")
def trainer_for():
  """trainer_for(cfg, num_devices=None) -> the session's Trainer for this frozen config (None:
  the config's own mesh on all devices; n: a (1, n) mesh on the first n devices)."""
  def get(cfg, num_devices=None):
    key = (cfg, num_devices)
    if key not in _TRAINERS:
      _TRAINERS[key] = _guarded_trainer(cfg, num_devices)
    return _TRAINERS[key]

  return get


@pytest.fixture(scope="session")
def trainer(trainer_for):
  """The canonical fsdp Trainer on 8 devices, shared by the checkpoint, init_from, generate and
  evaluate tests (one compile, one 12-step run per session: `trained`)."""
  from tests.helpers import canonical_config
  return trainer_for(canonical_config("fsdp"), 8)


@pytest.fixture(scope="session")
def trained(tmp_path_factory, trainer):
  """workdir of one uninterrupted canonical run: checkpoints 4, 8, 12. Copy before changing."""
  from moejax.train.loop import run
  from tests.helpers import CANONICAL
  from tests.train.conftest import records
  workdir = tmp_path_factory.mktemp("trained") / "w"
  run(trainer.cfg, str(workdir), trainer=trainer)
  assert [r["step"] for r in records(workdir)] == list(range(1, CANONICAL["steps"] + 1))
  assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "4", "8"]
  return workdir


@pytest.fixture(scope="session")
def codec_auto_run(trainer_for, tmp_path_factory):
  """(Trainer, workdir) of one uninterrupted codec.mode=auto run (tests/helpers.CODEC_AUTO_RUN):
  metrics.jsonl, TensorBoard files, codec_selection.json and checkpoints. Copy before changing."""
  from moejax.train.loop import run
  from tests.helpers import CODEC_AUTO_RUN, tiny_config
  trainer = trainer_for(tiny_config(**CODEC_AUTO_RUN))
  workdir = str(tmp_path_factory.mktemp("codec_auto"))
  run(trainer.cfg, workdir, trainer=trainer)
  return trainer, workdir


# ------------------------------------------------------------------------------------------------
# Compile-time report: XLA compile seconds (and count) per test file, from jax.monitoring.

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_TRACE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                 "/jax/core/compile/jaxpr_to_mlir_module_duration")
_stats = collections.defaultdict(lambda: [0.0, 0, 0.0, 0.0])   # file -> [compile s, n, trace s, wall s]
_lock = threading.Lock()
_current = {"file": "(collection)"}
_by_function = collections.defaultdict(lambda: [0.0, 0])    # (file, function) -> [s, n]


def _on_duration(event, duration, fun_name="?", **_):
  if event == _COMPILE_EVENT:
    with _lock:
      entry = _stats[_current["file"]]
      entry[0] += duration
      entry[1] += 1
      entry = _by_function[_current["file"], fun_name]
      entry[0] += duration
      entry[1] += 1
  elif event in _TRACE_EVENTS:
    with _lock:
      _stats[_current["file"]][2] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  _current["file"] = item.nodeid.split("::")[0]
  start = time.perf_counter()
  yield
  with _lock:
    _stats[_current["file"]][3] += time.perf_counter() - start


_GROUP_OF = {f: g for g, files in XDIST_GROUPS.items() for f in files}


# Seconds each heavy unit takes under `-n 2` (the "test s" column of a whole-suite run; the
# others take a few seconds). Units start longest first, so no long unit is left for the end
# while the other worker idles; only the order matters, not the figures.
UNIT_SECONDS = {"tiny8": 146, "hf_reference": 122, "codec_auto": 112,
                "tests/placement/test_fssdp_train.py": 100, "tests/train/test_families.py": 95,
                "tests/models/test_decode.py": 65, "tests/train/test_job_faults.py": 42,
                "tests/layers/test_moe.py": 33, "tests/codec/test_gather.py": 32,
                "tests/layers/test_attention.py": 31, "tests/placement/test_fssdp.py": 28,
                "tests/codec/test_kernels.py": 20, "tests/placement/test_experts.py": 17,
                "tests/train/test_dispatch_growth.py": 50, "tests/routing/test_admission.py": 14,
                "tests/train/test_optim.py": 14, "tests/sharding/test_hook.py": 14,
                "tests/placement/test_dispatch.py": 40, "tests/layers/test_linear_attention.py": 14,
                "tests/placement/test_planner.py": 13,
                "tests/routing/test_sharded_admission.py": 13,
                "tests/sharding/test_gatherer.py": 12, "tests/train/test_cuda_lowering.py": 19}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
  """Like --dist loadfile (a file's tests run on one worker, in order), with the files of one
  XDIST_GROUPS entry as one unit, and the units handed out longest first (`UNIT_SECONDS`).
  (Not --dist loadgroup: xdist 3.8 groups by rewriting node ids, which pytest 9 ignores. Not
  xdist's own reordering, by number of tests: a slow file of one test would start last.)"""
  from xdist.scheduler import LoadScopeScheduling
  config.option.loadscopereorder = False      # ties keep the collection's order

  class FileGroupScheduling(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      path = nodeid.split("::")[0]
      return _GROUP_OF.get(path, path)

    def _assign_work_unit(self, node):
      # The longest unit left goes next (the first of equals, in collection order). Not by
      # re-sorting the registered collections: a worker runs the indexes it is sent against its
      # own collection's order, so a re-sorted copy would hand it other files' tests.
      longest = max(self.workqueue, key=lambda scope: UNIT_SECONDS.get(scope, 0))
      self.workqueue.move_to_end(longest, last=False)
      super()._assign_work_unit(node)

  return FileGroupScheduling(config, log)


def pytest_sessionfinish(session):
  workeroutput = getattr(session.config, "workeroutput", None)
  if workeroutput is not None:          # an xdist worker: hand the figures to the controller
    workeroutput["compile_stats"] = {k: list(v) for k, v in _stats.items()}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
  for path, (seconds, count, trace, wall) in node.workeroutput.get("compile_stats", {}).items():
    entry = _stats[path]
    entry[0] += seconds
    entry[1] += count
    entry[2] += trace
    entry[3] += wall


def pytest_terminal_summary(terminalreporter):
  if not _stats:
    return
  rows = sorted(_stats.items(), key=lambda kv: -kv[1][0])
  tr = terminalreporter
  tr.section("XLA compile time per test file")
  tr.write_line(f"{'compile s':>10} {'compiles':>9} {'trace+lower s':>14} {'test s':>8}  file")
  for path, (seconds, count, trace, wall) in rows:
    if count or wall >= 1.0:
      tr.write_line(f"{seconds:10.1f} {count:9d} {trace:14.1f} {wall:8.1f}  {path}")
  total = [sum(v[i] for v in _stats.values()) for i in range(4)]
  tr.write_line(f"{total[0]:10.1f} {int(total[1]):9d} {total[2]:14.1f} {total[3]:8.1f}  "
                "total (test s: summed over workers; compiles in subprocesses not counted)")
  if os.environ.get("MOEJAX_COMPILE_REPORT") == "functions" and _by_function:
    tr.write_line("slowest compiled functions (this process):")
    for (path, name), (seconds, count) in sorted(_by_function.items(),
                                                 key=lambda kv: -kv[1][0])[:40]:
      tr.write_line(f"{seconds:10.1f} {count:9d}  {path} {name}")
