"""Metrics output, written by process 0 only: WORKDIR/metrics.jsonl, TensorBoard event files in
WORKDIR beside it, and the progress display (a live bar on a terminal, one line per log
otherwise).

TensorBoard files are written with tensorboardX: it needs only numpy and protobuf, where
TensorFlow's writer (and flax.metrics.tensorboard / clu, built on it) would pull TensorFlow in.
Every number of a metrics.jsonl record becomes a scalar: a scalar under its own name, a per-layer
[L] array as `NAME/layer{l}`. Per-layer expert loads ([L, E]: `expert_load_LxE` as the router
chose, `admitted_load_LxE` after admission) become histograms `NAME/layer{l}` whose bucket e
holds expert e's tokens, so TensorBoard's histogram view shows each layer's load by expert id.
"""
from __future__ import annotations

import datetime
import json
import os
import sys

import jax
import numpy as np

LOAD_KEYS = ("expert_load_LxE", "admitted_load_LxE")   # [L, E] per record: histograms


def to_python(value):
  """Device/numpy scalars and arrays -> JSON-friendly floats and lists."""
  arr = np.asarray(value)
  if arr.ndim == 0:
    return arr.item()
  return arr.tolist()


def _ends_mid_line(path: str) -> bool:
  """Whether the file at `path` is non-empty and its last byte is not a newline."""
  with open(path, "rb") as f:
    f.seek(0, os.SEEK_END)
    if f.tell() == 0:
      return False
    f.seek(-1, os.SEEK_END)
    return f.read(1) != b"\n"


class MetricsWriter:
  """Appends records to WORKDIR/metrics.jsonl and the same numbers to TensorBoard event files
  in WORKDIR (`tensorboard=False`: the JSONL file only)."""

  def __init__(self, workdir: str, *, tensorboard: bool = True, first_step: int | None = None):
    """`first_step`: the step this run starts at; TensorBoard hides the events of an earlier run
    from that step on (a resumed run's repeated steps replace them)."""
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.enabled = jax.process_index() == 0
    self._file = open(self.path, "a", encoding="utf-8") if self.enabled else None
    if self._file is not None and _ends_mid_line(self.path):
      # A run killed while writing left half a record: ours start on a line of their own (the
      # fragment stays one damaged line, which readers skip), never glued to it.
      self._file.write("\n")
    self._tb = None
    if self.enabled and tensorboard:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(logdir=workdir, flush_secs=30, purge_step=first_step)

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    self._file.write(json.dumps({k: to_python(v) for k, v in record.items()}) + "\n")
    self._file.flush()
    if self._tb is not None:
      write_tensorboard(self._tb, record)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
    if self._tb is not None:
      self._tb.close()


def write_tensorboard(writer, record: dict) -> None:
  """One record as TensorBoard scalars and load histograms (see the module docstring)."""
  step = int(record["step"])
  for key, value in record.items():
    if key == "step":
      continue
    arr = np.asarray(value, np.float64)
    if key in LOAD_KEYS and arr.ndim == 2:
      for layer, load_E in enumerate(arr):
        experts = np.arange(load_E.size, dtype=np.float64)
        writer.add_histogram_raw(
            f"{key}/layer{layer}", min=0.0, max=float(load_E.size - 1), num=float(load_E.sum()),
            sum=float(experts @ load_E), sum_squares=float(experts ** 2 @ load_E),
            bucket_limits=(experts + 0.5).tolist(), bucket_counts=load_E.tolist(),
            global_step=step)
    elif arr.ndim == 0:
      writer.add_scalar(key, float(arr), step)
    elif arr.ndim == 1:
      for layer, v in enumerate(arr):
        writer.add_scalar(f"{key}/layer{layer}", float(v), step)


def log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def progress_line(step: int, total: int, record: dict, eta_s: float) -> str:
  val = record.get("val_loss")
  val_text = f"{val:.3f}" if val is not None else "-"
  return (f"step {step:>6d}/{total} | loss {record['loss']:.3f} | val {val_text} | "
          f"{_tokens_per_s(record['tokens_per_s'])} | {record['step_time_s']:.3f} s/step | "
          f"ETA {datetime.timedelta(seconds=int(eta_s))}" + extras(record))


def extras(record: dict) -> str:
  """What a run's modes change, where they are on: the codec's gather bytes against plain and
  how many of its compressed parameter rows fell back to a plain gather this step; the share of
  assignments ep/fssdp dispatch dropped (moe.dispatch_overflow='drop')."""
  out = ""
  if record.get("codec_rows"):
    ratio = record["gather_bytes"] / max(record["gather_bytes_plain"], 1.0)
    out += (f" | gather {ratio:.2f}x plain, {int(record['codec_fallbacks'])}/"
            f"{int(record['codec_rows'])} fell back")
  if record.get("ep_dropped_frac"):
    out += f" | dispatch dropped {record['ep_dropped_frac']:.1%}"
  return out


class Progress:
  """The progress display of process 0. On a terminal: a live bar (rich) with step, loss,
  tokens/s and ETA, other log lines printed above it. Otherwise (a file, a pipe, a batch
  system's log): `progress_line` once per logged step."""

  def __init__(self, total: int, first_step: int, *, live: bool | None = None):
    self.total = total
    self.enabled = jax.process_index() == 0
    if live is None:
      live = sys.stdout.isatty()
    self._bar = None
    if self.enabled and live and first_step <= total:
      from rich.progress import (BarColumn, MofNCompleteColumn, Progress as RichProgress,
                                 TextColumn, TimeRemainingColumn)
      self._bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                               TextColumn("{task.fields[status]}"), TimeRemainingColumn())
      self._task = self._bar.add_task("train", total=total, completed=first_step - 1,
                                      status="compiling")
      self._bar.start()

  def update(self, step: int, record: dict, eta_s: float) -> None:
    if not self.enabled:
      return
    if self._bar is None:
      print(progress_line(step, self.total, record, eta_s), flush=True)
      return
    val = record.get("val_loss")
    status = (f"loss {record['loss']:.3f}" + (f" | val {val:.3f}" if val is not None else "")
              + f" | {_tokens_per_s(record['tokens_per_s'])}" + extras(record))
    self._bar.update(self._task, completed=step, status=status)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.stop()


def _tokens_per_s(value: float) -> str:
  return f"{value / 1000:.1f}k tok/s" if value >= 1000 else f"{value:.0f} tok/s"
