"""Metrics output: a JSONL file and a progress line, written by process 0 only."""
from __future__ import annotations

import datetime
import json
import os

import jax
import numpy as np


def to_python(value):
  """Device/numpy scalars and arrays -> JSON-friendly floats and lists."""
  arr = np.asarray(value)
  if arr.ndim == 0:
    return arr.item()
  return arr.tolist()


class MetricsWriter:
  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.enabled = jax.process_index() == 0
    self._file = open(self.path, "a", encoding="utf-8") if self.enabled else None

  def write(self, record: dict) -> None:
    if self.enabled:
      self._file.write(json.dumps({k: to_python(v) for k, v in record.items()}) + "\n")
      self._file.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


def log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def progress_line(step: int, total: int, record: dict, eta_s: float) -> str:
  val = record.get("val_loss")
  val_text = f"{val:.3f}" if val is not None else "-"
  return (f"step {step:>6d}/{total} | loss {record['loss']:.3f} | val {val_text} | "
          f"{record['tokens_per_s'] / 1000:.1f}k tok/s | {record['step_time_s']:.3f} s/step | "
          f"ETA {datetime.timedelta(seconds=int(eta_s))}")
