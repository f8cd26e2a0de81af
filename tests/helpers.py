"""Small shared helpers for tests."""
from __future__ import annotations

import os
import subprocess
import sys

import configs.olmoe as olmoe_configs
from moejax.config import from_config_dict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(**overrides):
  """The tiny preset with dotted-path overrides, e.g. tiny_config(**{"moe.placement": "ep"})."""
  cd = olmoe_configs.get_config("tiny").to_dict()   # plain dict: our validator sees raw values
  for path, value in overrides.items():
    node = cd
    *parents, leaf = path.split(".")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return from_config_dict(cd)


def run_train(args, timeout=300, env_extra=None):
  """Runs train.py in a subprocess; returns CompletedProcess (text)."""
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  env.update(env_extra or {})
  return subprocess.run([sys.executable, os.path.join(REPO, "train.py"), *args], cwd=REPO,
                        capture_output=True, text=True, timeout=timeout, env=env)
