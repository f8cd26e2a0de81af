"""For the Triton kernel tests that run in the Python 3.11 side environment, which has no jax."""
import importlib
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[2]


def import_jax_free(name):
  """Import a jax-free module of moejax.codec.kernels without running the package __init__s
  (they import jax)."""
  for pkg in ("moejax", "moejax.codec", "moejax.codec.kernels"):
    if pkg not in sys.modules:
      module = types.ModuleType(pkg)
      module.__path__ = [str(ROOT.joinpath(*pkg.split(".")))]
      sys.modules[pkg] = module
  return importlib.import_module(f"moejax.codec.kernels.{name}")
