"""The series a run report plots, read from a workdir: metrics.jsonl (one record per logged step)
and codec_selection.json (the codec's decisions). No plotting here: `panels(workdir)` returns
what each of the eight plots shows, or why the run lacks it, so tests can check every series
against the files it came from.

Letters: T logged steps, L layers, E experts, P codec-compressed parameters.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np

from moejax.errors import ConfigError

METRICS_FILE = "metrics.jsonl"
CODEC_FILE = "codec_selection.json"
CODEC_MODES = ("off", "element", "block", "word", "delta")   # colour order of the mode plot


@dataclasses.dataclass
class Panel:
  """One plot: `lines` {label: (steps_T, values_T)} on one y axis (`right`: a second y axis,
  same form), or `heatmaps` {title: (steps_T, values_TxR, row_labels_R)}; `missing` (a reason)
  when the run has no data for it."""
  name: str
  title: str
  ylabel: str = ""
  lines: dict = dataclasses.field(default_factory=dict)
  right: dict = dataclasses.field(default_factory=dict)
  right_label: str = ""
  heatmaps: dict = dataclasses.field(default_factory=dict)
  colorbar: str = ""
  categories: tuple = ()        # heatmap values are indices into these (the codec modes)
  logy: bool = False
  right_logy: bool = False
  missing: str | None = None


def read_records(workdir: str) -> list[dict]:
  """metrics.jsonl's records, one per step, as the run that continued last saw them: where a
  resumed run logs a step at or before one already logged, the earlier records from that step
  on (the abandoned run's) are dropped."""
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.isfile(path):
    raise ConfigError(f"{path}: no such file (a workdir that train.py has logged to holds one)")
  by_step, last, damaged = {}, None, []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        step = int(record["step"])
      except (ValueError, KeyError, TypeError) as e:
        if line.startswith('{"step": ') and cut_short(line, e):
          damaged.append(number)     # half a record: a run killed while writing left it
          continue
        raise ConfigError(f"{path}:{number}: not a metrics record (one JSON object with a "
                          "'step' per line)") from None
      if last is not None and step <= last:                # resumed from an earlier checkpoint
        by_step = {s: r for s, r in by_step.items() if s < step}
      by_step[step], last = record, step
  if damaged:
    print(f"moejax: note: {path}: skipped {len(damaged)} record(s) cut short (line(s) "
          f"{', '.join(map(str, damaged))}: a run killed while writing leaves one)",
          file=sys.stderr)
  if not by_step:
    raise ConfigError(f"{path}: holds no records yet")
  return [by_step[s] for s in sorted(by_step)]


def cut_short(line: str, error: Exception) -> bool:
  """Whether `error`, from parsing the JSONL `line`, says it is a JSON object cut short (a run
  killed while writing it), not some other damage: the parse failed at the line's end."""
  return (isinstance(error, json.JSONDecodeError) and line.startswith("{")
          and error.pos >= len(line.rstrip()))


def read_decisions(workdir: str) -> list[dict] | None:
  """codec_selection.json's decisions (None without the file; a ConfigError naming it when it
  is damaged: not JSON, or no list of decisions with their `step` and `params`)."""
  path = os.path.join(workdir, CODEC_FILE)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      decisions = json.load(f)["decisions"]
    for d in decisions:
      int(d["step"])
      for e in d["params"]:
        e["group"], e["path"], e["mode"]   # noqa: B018  every entry names its parameter and mode
  except (ValueError, KeyError, TypeError) as e:
    raise ConfigError(f"{path}: not a codec selection file ({type(e).__name__}: {e}); move it "
                      "away to report without the codec plot") from None
  return decisions


def column(records: list[dict], key: str):
  """(steps_T, values_T[, ...]) of the records that hold `key` (None if none does)."""
  rows = [(r["step"], r[key]) for r in records if key in r]
  if not rows:
    return None
  return (np.array([s for s, _ in rows]), np.array([v for _, v in rows], np.float64))


def _lines(records, keys: dict) -> dict:
  return {label: c for label, key in keys.items() if (c := column(records, key)) is not None}


def loss(records, _) -> Panel:
  return Panel("loss", "Loss", "cross-entropy (nats/token)",
               lines=_lines(records, {"train loss": "loss", "validation loss": "val_loss"}))


def lr_and_grad_norm(records, _) -> Panel:
  return Panel("lr_grad_norm", "Learning rate and gradient norm", "learning rate",
               lines=_lines(records, {"learning rate": "lr"}),
               right=_lines(records, {"gradient norm": "grad_norm"}),
               right_label="global gradient norm (before clipping)")


def speed(records, _) -> Panel:
  timed = [r for r in records if r["step"] > records[0]["step"]]   # the first step compiles
  return Panel("speed", "Throughput and step time (first step, which compiles, left out)",
               "tokens/s", lines=_lines(timed, {"tokens/s": "tokens_per_s"}),
               right=_lines(timed, {"step time": "step_time_s"}), right_label="s/step (log)",
               right_logy=True)


def expert_load(records, _) -> Panel:
  heatmaps = {}
  for key, title in (("expert_load_LxE", "router's choice (before admission)"),
                     ("admitted_load_LxE", "after admission")):
    c = column(records, key)
    if c is None:
      continue
    steps, load_TxLxE = c
    mean = np.maximum(load_TxLxE.mean(axis=2, keepdims=True), 1e-9)
    _, num_layers, num_experts = load_TxLxE.shape
    labels = [f"L{l} E{e}" for l in range(num_layers) for e in range(num_experts)]
    heatmaps[title] = (steps, (load_TxLxE / mean).reshape(len(steps), -1), labels)
  missing = None if heatmaps else (
      "the run's records hold no per-expert loads (expert_load_LxE; written since moejax "
      "logs them)")
  return Panel("expert_load", "Expert load per layer (tokens per expert / layer mean)",
               heatmaps=heatmaps, colorbar="load / mean load", missing=missing)


def dropped_and_rerouted(records, _) -> Panel:
  lines = {}
  for label, key in (("dropped (admission)", "dropped_frac"),
                     ("rerouted (admission)", "rerouted_frac")):
    c = column(records, key)
    if c is not None:
      lines[label] = (c[0], c[1].reshape(len(c[0]), -1).mean(axis=1))
  c = column(records, "ep_dropped_frac")
  if c is not None and np.any(c[1] > 0):
    lines["dropped (dispatch buffer full)"] = c
  return Panel("dropped", "Dropped and rerouted assignments (mean over layers)",
               "fraction of token-expert assignments", lines=lines,
               missing=None if lines else "the run's records hold no dropped_frac")


def _summed(records, key):
  c = column(records, key)
  return None if c is None else (c[0], c[1].reshape(len(c[0]), -1).sum(axis=1))


def bytes_by_kind(records, _) -> Panel:
  lines = {}
  for label, key in (("gather (sent)", "gather_bytes"), ("gather (plain equivalent)",
                                                         "gather_bytes_plain"),
                     ("reduce-scatter", "scatter_bytes"), ("all-to-all", "a2a_bytes"),
                     ("SparseAllGather (sent)", "spag_bytes"),
                     ("SparseAllGather (needed)", "spag_bytes_needed"),
                     ("SparseReduceScatter", "sprs_bytes")):
    c = _summed(records, key)
    if c is not None and np.any(c[1] > 0):
      lines[label] = (c[0], c[1] / 2**20)
  return Panel("bytes", "Bytes received per device per step, by collective",
               "MiB per step (log)", lines=lines, logy=True, missing=None if lines else "the run moved no bytes between devices "
               "(one device)")


def codec_modes(records, decisions) -> Panel:
  if decisions is None:
    return Panel("codec", "Codec mode per parameter", missing=(
        f"no {CODEC_FILE} in the workdir: the run chose no codec modes (codec.mode=auto or "
        "codec.select choose after codec.warmup_steps; other modes never do)"))
  if not decisions:
    return Panel("codec", "Codec mode per parameter", missing=(
        f"{CODEC_FILE} holds no decision yet (the run stopped before the codec chose)"))
  names = [f"{e['group']}{e['path']}" for e in decisions[0]["params"]]
  steps = np.array([r["step"] for r in records])
  modes_TxP = np.zeros((len(steps), len(names)), np.int64)   # off before the first decision
  for d in decisions:         # a decision after step s is in force from step s + 1
    chosen = {f"{e['group']}{e['path']}": e["mode"] for e in d["params"]}
    index = [CODEC_MODES.index(chosen.get(n, "off")) for n in names]
    modes_TxP[steps > d["step"]] = index
  return Panel("codec", "Codec mode per parameter (decisions from codec_selection.json)",
               heatmaps={"mode in force": (steps, modes_TxP, names)}, categories=CODEC_MODES)


def straggler(records, _) -> Panel:
  c = column(records, "straggler")
  if c is None:
    return Panel("straggler", "Straggler per layer", missing=(
        "no per-layer straggler in the records: it is reported for placement ep and fssdp"))
  steps, values_TxL = c
  values_TxL = values_TxL.reshape(len(steps), -1)
  return Panel("straggler", "Straggler per layer (busiest device's tokens / mean)",
               "max / mean expert tokens per device",
               lines={f"layer {l}": (steps, values_TxL[:, l]) for l in range(values_TxL.shape[1])})


PANELS = (loss, lr_and_grad_norm, speed, expert_load, dropped_and_rerouted, bytes_by_kind,
          codec_modes, straggler)


def panels(workdir: str) -> list[Panel]:
  """The eight plots of the report, in order, each with its series or the reason it is missing."""
  records, decisions = read_records(workdir), read_decisions(workdir)
  out = []
  for make in PANELS:
    panel = make(records, decisions)
    if panel.missing is None and not (panel.lines or panel.right or panel.heatmaps):
      panel.missing = "the run's records hold none of its series"
    out.append(panel)
  return out
