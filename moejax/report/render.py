"""Draws the report's panels with matplotlib (headless Agg) and writes WORKDIR/report.html: one
self-contained page, every plot embedded as a base64 PNG (also saved as WORKDIR/report/NAME.png),
and a line for each plot the run lacks, saying why."""
from __future__ import annotations

import base64
import html
import io
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import BoundaryNorm, ListedColormap  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from moejax.report.series import Panel, panels, read_records  # noqa: E402

MODE_COLOURS = ("#d9d9d9", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd")


def _line_axes(ax, panel: Panel):
  for label, (steps, values) in panel.lines.items():
    ax.plot(steps, values, marker="." if len(steps) < 60 else None, label=label)
  ax.set_xlabel("step")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))
  ax.set_ylabel(panel.ylabel)
  if panel.logy:
    ax.set_yscale("log")
  ax.grid(alpha=0.3)
  handles, labels = ax.get_legend_handles_labels()
  if panel.right:
    twin = ax.twinx()
    for i, (label, (steps, values)) in enumerate(panel.right.items()):
      twin.plot(steps, values, color=f"C{len(panel.lines) + i}", linestyle="--", label=label)
    twin.set_ylabel(panel.right_label)
    if panel.right_logy:
      twin.set_yscale("log")
    more_h, more_l = twin.get_legend_handles_labels()
    handles, labels = handles + more_h, labels + more_l
  ax.legend(handles, labels, loc="best", fontsize="small")


def _heatmap_axes(fig, ax, panel: Panel, title: str, data, vmax=None):
  steps, values_TxR, rows = data
  # Column edges halfway between logged steps: the steps need not be evenly spaced.
  steps = np.asarray(steps, np.float64)
  gaps = np.diff(steps) if len(steps) > 1 else np.ones(1)
  x_edges = np.concatenate([[steps[0] - gaps[0] / 2], (steps[:-1] + steps[1:]) / 2,
                            [steps[-1] + gaps[-1] / 2]])
  y_edges = np.arange(len(rows) + 1) - 0.5
  if panel.categories:
    cmap = ListedColormap(MODE_COLOURS[:len(panel.categories)])
    norm = BoundaryNorm(np.arange(len(panel.categories) + 1) - 0.5, cmap.N)
    image = ax.pcolormesh(x_edges, y_edges, values_TxR.T, cmap=cmap, norm=norm)
    bar = fig.colorbar(image, ax=ax, ticks=range(len(panel.categories)))
    bar.ax.set_yticklabels(panel.categories)
  else:
    image = ax.pcolormesh(x_edges, y_edges, values_TxR.T, cmap="viridis", vmin=0.0, vmax=vmax)
    fig.colorbar(image, ax=ax, label=panel.colorbar)
  ax.invert_yaxis()                       # first row on top
  ax.set_title(title, fontsize="medium")
  ax.set_xlabel("step")
  ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # no tick between two steps
  step = max(1, len(rows) // 24)          # at most ~24 row labels stay readable
  ax.set_yticks(range(0, len(rows), step))
  ax.set_yticklabels(rows[::step], fontsize="x-small")


def figure(panel: Panel):
  """The matplotlib Figure of one panel that has data."""
  if panel.heatmaps:
    rows = max(len(d[2]) for d in panel.heatmaps.values())
    fig, axes = plt.subplots(1, len(panel.heatmaps), squeeze=False,
                             figsize=(6.5 * len(panel.heatmaps), min(2.5 + rows * 0.18, 9)))
    vmax = max(float(np.max(d[1])) for d in panel.heatmaps.values())   # one colour scale
    for ax, (title, data) in zip(axes[0], panel.heatmaps.items()):
      _heatmap_axes(fig, ax, panel, title, data, vmax)
  else:
    fig, ax = plt.subplots(figsize=(8, 4))
    _line_axes(ax, panel)
  fig.suptitle(panel.title)
  fig.tight_layout()
  return fig


def write_report(workdir: str) -> str:
  """Writes WORKDIR/report.html and WORKDIR/report/*.png; returns the HTML file's path."""
  records = read_records(workdir)
  out_dir = os.path.join(workdir, "report")
  os.makedirs(out_dir, exist_ok=True)
  sections, missing = [], []
  for panel in panels(workdir):
    if panel.missing:
      missing.append(f"<li><b>{html.escape(panel.title)}</b>: {html.escape(panel.missing)}</li>")
      continue
    fig = figure(panel)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    png = buffer.getvalue()
    with open(os.path.join(out_dir, f"{panel.name}.png"), "wb") as f:
      f.write(png)
    sections.append(f'<section id="{panel.name}"><img alt="{html.escape(panel.title)}" '
                    f'src="data:image/png;base64,{base64.b64encode(png).decode()}"></section>')
  last = records[-1]
  # The last record with a loss: a record may hold only some figures (a validation step's).
  trained = next((r for r in reversed(records) if "loss" in r), None)
  summary = f"{len(records)} logged steps (to step {last['step']})" + (
      f"; last loss {trained['loss']:.4f} (step {trained['step']})" if trained else
      "; no training loss logged")
  if "val_loss" in last:
    summary += f", validation loss {last['val_loss']:.4f}"

  left_out = (f"<h2>Left out</h2><ul>{''.join(missing)}</ul>" if missing else "")
  page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>moejax run report: {html.escape(workdir)}</title>
<style>body{{font-family:sans-serif;margin:2em auto;max-width:1400px;color:#222}}
img{{max-width:100%;border:1px solid #ddd}}section{{margin-bottom:2em}}h2{{font-size:1.1em}}</style>
</head><body><h1>moejax run report</h1><p><code>{html.escape(os.path.abspath(workdir))}</code>:
{html.escape(summary)}</p>{''.join(sections)}{left_out}</body></html>
"""
  path = os.path.join(workdir, "report.html")
  with open(path, "w", encoding="utf-8") as f:
    f.write(page)
  return path
