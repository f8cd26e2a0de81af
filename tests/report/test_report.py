"""The run's TensorBoard files and report, from the suite's codec.mode=auto run (tests/conftest.py
`codec_auto_run`, fsdp on 8 devices): TensorBoard's own reader gives back every number of
metrics.jsonl; each plot's series are the records' (and codec_selection.json's) values; the page
embeds every plot the run has and names the one it lacks. (The straggler plot, which needs ep or
fssdp, is checked on the fssdp run: tests/placement/test_fssdp_train.py.)"""
import base64
import json
import os
import shutil
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from moejax.report import series
from tests.helpers import REPO


@pytest.fixture(scope="module")
def workdir(codec_auto_run):
  return codec_auto_run[1]


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_tensorboard_holds_every_number_of_metrics_jsonl(workdir):
  events = event_accumulator.EventAccumulator(
      workdir, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0})
  events.Reload()
  tags = events.Tags()
  expected = {}           # tag -> {step: value}
  for record in _records(workdir):
    for key, value in record.items():
      arr = np.asarray(value, np.float64)
      if key == "step" or arr.ndim == 2:
        continue
      names = [key] if arr.ndim == 0 else [f"{key}/layer{i}" for i in range(arr.size)]
      for name, v in zip(names, arr.ravel()):
        expected.setdefault(name, {})[record["step"]] = v
  assert set(tags["scalars"]) == set(expected)
  assert {"loss", "val_loss", "lr", "grad_norm", "gather_bytes", "load_max/layer1"} <= set(
      expected)
  for tag, by_step in expected.items():
    got = {e.step: e.value for e in events.Scalars(tag)}
    assert got.keys() == by_step.keys(), tag
    np.testing.assert_allclose([got[s] for s in by_step], list(by_step.values()),
                               rtol=1e-6, err_msg=tag)      # stored as float32
  # Expert loads: one histogram per layer and step, bucket e = expert e's tokens.
  last = _records(workdir)[-1]
  for key in ("expert_load_LxE", "admitted_load_LxE"):
    for layer, load_E in enumerate(last[key]):
      histogram = {e.step: e.histogram_value for e in events.Histograms(f"{key}/layer{layer}")}
      value = histogram[last["step"]]
      np.testing.assert_array_equal(value.bucket, load_E)
      assert value.num == sum(load_E)


def test_each_plot_is_built_from_the_records(workdir):
  records = _records(workdir)
  steps = np.array([r["step"] for r in records])
  panels = {p.name: p for p in series.panels(workdir)}
  assert list(panels) == ["loss", "lr_grad_norm", "speed", "expert_load", "dropped", "bytes",
                          "codec", "straggler"]

  def check(line, key, reduce=None, subset=None):
    want = np.array([r[key] for r in records if key in r and (subset is None or subset(r))],
                    np.float64)
    if reduce is not None:
      want = reduce(want.reshape(len(want), -1))
    np.testing.assert_allclose(line[1], want, err_msg=key)

  check(panels["loss"].lines["train loss"], "loss")
  check(panels["loss"].lines["validation loss"], "val_loss")
  np.testing.assert_array_equal(panels["loss"].lines["validation loss"][0],
                                [r["step"] for r in records if "val_loss" in r])
  check(panels["lr_grad_norm"].lines["learning rate"], "lr")
  check(panels["lr_grad_norm"].right["gradient norm"], "grad_norm")
  after_first = lambda r: r["step"] > records[0]["step"]  # noqa: E731
  check(panels["speed"].lines["tokens/s"], "tokens_per_s", subset=after_first)
  check(panels["speed"].right["step time"], "step_time_s", subset=after_first)
  check(panels["dropped"].lines["dropped (admission)"], "dropped_frac",
        reduce=lambda x: x.mean(axis=1))
  mib = lambda x: x.sum(axis=1) / 2**20  # noqa: E731
  check(panels["bytes"].lines["gather (sent)"], "gather_bytes", reduce=mib)
  check(panels["bytes"].lines["gather (plain equivalent)"], "gather_bytes_plain", reduce=mib)
  check(panels["bytes"].lines["reduce-scatter"], "scatter_bytes", reduce=mib)
  assert "all-to-all" not in panels["bytes"].lines           # fsdp moves no tokens

  # Expert load, before and after admission: each layer's tokens per expert over its mean.
  for title, key in (("router's choice (before admission)", "expert_load_LxE"),
                     ("after admission", "admitted_load_LxE")):
    got_steps, values_TxR, rows = panels["expert_load"].heatmaps[title]
    load_TxLxE = np.array([r[key] for r in records], np.float64)
    np.testing.assert_array_equal(got_steps, steps)
    np.testing.assert_allclose(values_TxR, (load_TxLxE / load_TxLxE.mean(
        axis=2, keepdims=True)).reshape(len(steps), -1))
    assert len(rows) == load_TxLxE.shape[1] * load_TxLxE.shape[2]

  # Codec modes: off until the decision after step 3, then codec_selection.json's choice.
  with open(os.path.join(workdir, "codec_selection.json")) as f:
    decision = json.load(f)["decisions"][0]
  got_steps, modes_TxP, names = panels["codec"].heatmaps["mode in force"]
  np.testing.assert_array_equal(got_steps, steps)
  for p, entry in enumerate(decision["params"]):
    assert names[p] == entry["group"] + entry["path"]
    chosen = series.CODEC_MODES.index(entry["mode"])
    assert list(modes_TxP[:, p]) == [0 if s <= decision["step"] else chosen for s in steps]
  assert (modes_TxP > 0).any()

  assert panels["straggler"].missing and "ep and fssdp" in panels["straggler"].missing
  assert all(p.missing is None for name, p in panels.items() if name != "straggler")


def test_report_html_embeds_every_plot_the_run_has(workdir, tmp_path):
  copy = tmp_path / "w"
  shutil.copytree(workdir, copy)
  result = subprocess.run([sys.executable, "-m", "moejax.report", str(copy)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 0, result.stderr
  page = (copy / "report.html").read_text()
  images = page.split('src="data:image/png;base64,')[1:]
  assert len(images) == 7                                   # all but the straggler plot
  embedded = sorted(base64.b64decode(image.split('"', 1)[0]) for image in images)
  assert "Straggler per layer</b>: no per-layer straggler" in page
  assert sorted(os.listdir(copy / "report")) == sorted(
      f"{n}.png" for n in ("loss", "lr_grad_norm", "speed", "expert_load", "dropped", "bytes",
                           "codec"))
  # The page embeds the plots written beside it, each a real, non-blank image.
  assert embedded == sorted(f.read_bytes() for f in (copy / "report").iterdir())
  for f in (copy / "report").iterdir():
    pixels = matplotlib.image.imread(f)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 0.01, f.name


def test_bad_workdir_is_one_line_exit_2(tmp_path, capsys):
  from moejax.report.__main__ import main
  empty, bad = tmp_path / "empty", tmp_path / "bad"
  empty.mkdir()
  bad.mkdir()
  (bad / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
  for path, message in ((empty, f"{empty}/metrics.jsonl: no such file"),
                        (bad, f"{bad}/metrics.jsonl:2: not a metrics record")):
    assert main([str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {message}"), err


def test_damaged_codec_file_is_one_line_and_odd_records_still_report(tmp_path, capsys):
  from moejax.report.__main__ import main
  (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n'
                                          '{"step": 2, "val_loss": 3.0}\n')
  for text in ('{"decisions": [{"step": 1', '{"decisions": [{"step": 1, "params": [{}]}]}'):
    (tmp_path / series.CODEC_FILE).write_text(text)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / series.CODEC_FILE}: not a codec selection" in err[0]
  # No decision yet, and a last record without a training loss: the report says so.
  (tmp_path / series.CODEC_FILE).write_text('{"decisions": []}')
  assert main([str(tmp_path)]) == 0
  page = (tmp_path / "report.html").read_text()
  assert "holds no decision yet" in page and "last loss 2.0000 (step 1)" in page


def test_a_resumed_runs_records_replace_the_abandoned_ones(tmp_path):
  """A run logged steps 1-6, was resumed from a checkpoint at 4 and logs every 2 steps: from
  the first step it logs again (6) on, only its records count."""
  lines = [{"step": s, "loss": 10.0 - s} for s in range(1, 7)]
  lines += [{"step": s, "loss": 100.0 + s} for s in (6, 8)]
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
  got = [(r["step"], r["loss"]) for r in series.read_records(str(tmp_path))]
  assert got == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 5.0), (6, 106.0), (8, 108.0)]


def test_a_record_cut_short_by_a_kill_is_skipped_and_never_glued_to_the_next(tmp_path, capsys):
  """A run killed while writing leaves half a record as metrics.jsonl's last line. The resumed
  run appended its first record onto it (two records on one line, invalid JSON) and the report
  refused the whole run; now the writer starts a line of its own and readers skip the
  fragment, saying so. Other damage is still refused."""
  from moejax.train.metrics import MetricsWriter
  whole = "".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in (1, 2, 3))
  (tmp_path / "metrics.jsonl").write_text(whole[:-9])              # step 3 cut short
  writer = MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write({"step": 3, "loss": 99.0})
  writer.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 4 and lines[-1] == '{"step": 3, "loss": 99.0}'
  got = [(r["step"], r["loss"]) for r in series.read_records(str(tmp_path))]
  assert got == [(1, 9.0), (2, 8.0), (3, 99.0)]
  assert "skipped 1 record(s) cut short (line(s) 3" in capsys.readouterr().err
  (tmp_path / "metrics.jsonl").write_text(whole + "not a record\n" + whole)
  with pytest.raises(Exception, match="metrics.jsonl:4: not a metrics record"):
    series.read_records(str(tmp_path))


def test_plots_of_a_short_run_tick_whole_steps_only():
  """Three logged steps: matplotlib's own ticks fell at 1.5, 2.5 (between steps)."""
  from moejax.report import render
  steps = np.array([1, 2, 3])
  panel = series.Panel("expert_load", "Expert load", heatmaps={
      "router": (steps, np.ones((3, 4)), [f"e{i}" for i in range(4)])}, colorbar="load")
  lines = series.Panel("loss", "Loss", lines={"train loss": (steps, np.array([3.0, 2.5, 2.0]))},
                       ylabel="loss")
  for p in (panel, lines):
    fig = render.figure(p)
    for ax in fig.axes[:1]:
      low, high = ax.get_xlim()
      ticks = [t for t in ax.get_xticks() if low <= t <= high]
      assert ticks and all(float(t).is_integer() for t in ticks), (p.name, ticks)
    render.plt.close(fig)
