"""Tables and the PNG plot of projections (shared by the CLI and bench/projection.py)."""
from __future__ import annotations

KINDS = ("compute", "straggler", "host", "codec", "ag", "rs", "ar", "a2a", "spag", "sprs",
         "bcast", "reshard", "optimizer")
LABELS = {"compute": "compute", "straggler": "straggler wait", "host": "framework",
          "codec": "codec kernels", "ag": "all-gather", "rs": "reduce-scatter",
          "ar": "all-reduce", "a2a": "all-to-all", "spag": "SpAG", "sprs": "SpRS",
          "bcast": "broadcast", "reshard": "migration", "optimizer": "optimizer"}


def over_memory(rows: list[dict], hbm_gb: float) -> int:
  """How many rows need more memory per GPU than `hbm_gb`."""
  return sum(r["result"].extra.get("memory_gb", 0.0) > hbm_gb for r in rows)


def _memory(gb: float, hbm_gb: float | None) -> str:
  # Two significant digits below 1 GB (a tiny preset's figures would all read 0.0).
  text = f"{gb:.1f}" if gb >= 1 or gb != gb else f"{gb:.2g}"
  return text + ("*" if hbm_gb is not None and gb > hbm_gb else "")


def table(rows: list[dict], baseline: str | None = None, hbm_gb: float | None = None) -> str:
  """rows: {"gpus", "system", "result": StepTime}. Milliseconds per step: total, then the
  critical path by kind (compute, straggler wait, framework, codec kernels, then exposed
  communication), the speedup over `baseline` at the same GPU count, memory per GPU (marked
  `*` above `hbm_gb`, what the GPU holds)."""
  used = [k for k in KINDS if any(r["result"].exposed.get(k, 0) > 0 for r in rows)]
  head = ["gpus", "system", "step ms"] + [LABELS[k] for k in used] + ["speedup", "GB/GPU"]
  base = {}
  if baseline:
    base = {r["gpus"]: r["result"].seconds for r in rows if r["system"] == baseline}
  lines = [head]
  for r in rows:
    res = r["result"]
    sp = base.get(r["gpus"], 0.0) / res.seconds if r["gpus"] in base else float("nan")
    lines.append([str(r["gpus"]), r["system"], f"{res.seconds * 1e3:.1f}"]
                 + [f"{res.exposed.get(k, 0.0) * 1e3:.1f}" for k in used]
                 + [f"{sp:.2f}x" if r["gpus"] in base else "-",
                    _memory(res.extra.get("memory_gb", float("nan")), hbm_gb)])
  return _format(lines)


def _format(lines: list[list[str]]) -> str:
  widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
  out = []
  for j, row in enumerate(lines):
    out.append("  ".join(c.rjust(w) if i != 1 else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths))))
    if j == 0:
      out.append("  ".join("-" * w for w in widths))
  return "\n".join(out)


def plot(panels: list[dict], path: str, title: str = "") -> str:
  """One panel per entry {"title", "rows"} (rows as in `table`): step time against GPUs per
  system (left) and the critical path by kind at the largest GPU count (right). Writes `path`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  n = len(panels)
  fig, axes = plt.subplots(n, 2, figsize=(12, 3.6 * n), squeeze=False)
  colors = plt.get_cmap("tab20")
  for i, panel in enumerate(panels):
    rows = panel["rows"]
    ax = axes[i][0]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    for s in systems:
      pts = sorted((r["gpus"], r["result"].seconds) for r in rows if r["system"] == s)
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("step time (s)")
    ax.set_title(panel["title"], fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax = axes[i][1]
    top = max(r["gpus"] for r in rows)
    last = [r for r in rows if r["gpus"] == top]
    left = [0.0] * len(last)
    for j, k in enumerate(KINDS):
      vals = [r["result"].exposed.get(k, 0.0) for r in last]
      if any(v > 0 for v in vals):
        ax.barh(range(len(last)), vals, left=left, color=colors(j), label=LABELS[k])
        left = [a + b for a, b in zip(left, vals)]
    ax.set_yticks(range(len(last)))
    ax.set_yticklabels([r["system"] for r in last], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"seconds on the critical path at {top} GPUs")
    ax.legend(fontsize=7, loc="lower right")
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
