"""The torch reference for the Hugging Face tests: one `hf_reference.py serve` process per session
in the Python 3.11 env (.venv311), so torch and transformers are imported once.

When the collected tests need it, the process starts right after collection and is asked for the
reference models at once, so torch imports and the models are built while the tests that do not
need them run.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import tempfile

import numpy as np
import pytest

from tests.helpers import REPO

TORCH_PYTHON = os.path.join(REPO, ".venv311", "bin", "python")
REFERENCE = os.path.join(REPO, "tests", "convert", "hf_reference.py")
SETUP = "bash scripts/setup_torch_env.sh"
REPLY_TIMEOUT_S = 300


def torch_env_problem() -> str | None:
  if not os.access(TORCH_PYTHON, os.X_OK):
    return (f"the Hugging Face parity tests need the torch env {TORCH_PYTHON}, which is missing: "
            f"run `{SETUP}` (Python 3.11, CPU torch, transformers)")
  check = subprocess.run(   # package metadata only: importing torch here would cost seconds
      [TORCH_PYTHON, "-c", "import importlib.metadata as m\n"
       "for p in ('safetensors', 'torch', 'transformers', 'accelerate', 'compressed-tensors',"
       " 'numpy'): m.version(p)"],
      capture_output=True, text=True, check=False)
  if check.returncode:
    return (f"the torch env {TORCH_PYTHON} is incomplete ({check.stderr.strip()[-300:]}): "
            f"run `{SETUP}`")
  return None


class Reference:
  """Requests to the reference process, answered in order: `call("make", out_dir=...)`."""

  def __init__(self):
    self.workdir = tempfile.mkdtemp(prefix="hf_reference_")
    self.log_path = os.path.join(self.workdir, "hf_reference.log")
    self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    self.proc = subprocess.Popen([TORCH_PYTHON, REFERENCE, "serve"], cwd=REPO, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=self._log, text=True)
    self.models_dir = os.path.join(self.workdir, "models")
    self.send("make", out_dir=self.models_dir)   # answered by the first `receive`
    self._models = None

  def _log_tail(self) -> str:
    self._log.flush()
    with open(self.log_path) as f:
      return f.read()[-4000:]

  def send(self, cmd: str, **args) -> None:
    self.proc.stdin.write(json.dumps({"cmd": cmd, "args": args}) + "\n")
    self.proc.stdin.flush()

  def receive(self, what: str) -> dict:
    ready, _, _ = select.select([self.proc.stdout], [], [], REPLY_TIMEOUT_S)
    line = self.proc.stdout.readline() if ready else ""
    if not line:
      pytest.fail(f"the torch reference process gave no reply to {what!r}; its log:\n"
                  f"{self._log_tail()}")
    reply = json.loads(line)
    if not reply.pop("ok"):
      pytest.fail(f"the torch reference failed on {what!r}:\n{reply['error']}")
    return reply

  def models(self) -> dict:
    if self._models is None:
      self._models = self.receive("make")["models"]
    return self._models

  def call(self, cmd: str, **args) -> dict:
    self.models()          # the reply to the first request comes first
    self.send(cmd, **args)
    return self.receive(cmd)

  def close(self):
    self.proc.stdin.close()
    self.proc.terminate()      # nothing left to say; no need to wait for torch to unload
    self.proc.wait()
    self._log.close()
    shutil.rmtree(self.workdir, ignore_errors=True)


_reference: Reference | None = None


def pytest_collection_finish(session):
  global _reference
  if os.environ.get("PYTEST_XDIST_WORKER"):
    return     # every xdist worker collects every test: start lazily, where one is needed
  if any("hf_reference" in getattr(item, "fixturenames", ()) for item in session.items):
    if torch_env_problem() is None:
      _reference = Reference()


def pytest_sessionfinish(session):
  if _reference is not None:
    _reference.close()


@pytest.fixture(scope="session")
def hf_reference():
  global _reference
  if _reference is None:
    problem = torch_env_problem()
    if problem:
      pytest.fail(problem)
    _reference = Reference()
  return _reference


@pytest.fixture(scope="session")
def hf_models(hf_reference):
  """{name: (hf_dir, tokens_BxS, logits_BxSxV)} for the random models of hf_reference.MODELS."""
  out = hf_reference.models_dir
  return {name: (hf_dir, np.load(os.path.join(out, f"{name}.tokens.npy")),
                 np.load(os.path.join(out, f"{name}.logits.npy")))
          for name, hf_dir in hf_reference.models().items()}
