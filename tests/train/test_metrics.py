"""The progress display: one line per logged step off a terminal, a live bar (rich) on one."""
from moejax.train.metrics import Progress, progress_line

RECORD = {"loss": 2.5, "val_loss": 2.25, "tokens_per_s": 12_000.0, "step_time_s": 0.5}


def test_off_a_terminal_one_line_per_logged_step(capsys):
  progress = Progress(10, 1, live=False)
  progress.update(4, RECORD, 3.0)
  progress.close()
  assert capsys.readouterr().out == progress_line(4, 10, RECORD, 3.0) + "\n"


def test_on_a_terminal_a_bar_with_step_loss_and_speed(capsys):
  progress = Progress(10, 3, live=True)
  progress.update(10, RECORD, 0.0)
  progress.close()
  out = capsys.readouterr().out
  assert "10/10" in out and "loss 2.500 | val 2.250 | 12.0k tok/s" in out
  assert "step     10/10 |" not in out           # the bar, not the line


def test_the_line_says_what_the_codec_and_a_dropping_dispatch_did():
  """A fixed codec mode that falls back every step looked like any other run: the line gives the
  gather bytes against plain and the compressed rows that fell back; a dispatch that drops
  (moe.dispatch_overflow='drop') its share of assignments. Runs without them read as before."""
  record = dict(RECORD, codec_rows=27.0, codec_fallbacks=26.0, gather_bytes=546.0,
                gather_bytes_plain=1000.0, ep_dropped_frac=0.94)
  line = progress_line(40, 60, record, 3.0)
  assert line.endswith("ETA 0:00:03 | gather 0.55x plain, 26/27 fell back | dispatch dropped "
                       "94.0%"), line
  plain = dict(RECORD, codec_rows=0.0, ep_dropped_frac=0.0)
  assert progress_line(4, 10, plain, 3.0) == progress_line(4, 10, RECORD, 3.0)
  assert progress_line(4, 10, RECORD, 3.0).endswith("ETA 0:00:03")


def test_a_dispatch_dropping_a_large_share_is_said():
  """ep_dropped_frac 0.94 passed with no line (dropped_frac, admission's, read 0): past a tenth
  one note names the share, the settings and the remedies; the loop says it once."""
  from moejax.train.loop import drop_note
  from tests.helpers import tiny_config
  cfg = tiny_config(**{"moe.placement": "ep", "moe.dispatch_capacity_factor": 0.05,
                       "moe.dispatch_overflow": "drop"})
  assert drop_note(3, {"ep_dropped_frac": 0.05}, cfg) is None
  assert drop_note(3, {}, cfg) is None
  note = drop_note(3, {"ep_dropped_frac": 0.94}, cfg)
  assert note.startswith("moejax: note: step 3: the ep dispatch dropped 94.0% of the routed "
                         "assignments (moe.dispatch_overflow='drop', "
                         "moe.dispatch_capacity_factor=0.05)")
  # Under "grow" a step that drops is rerun with larger buffers: a drop logged there is a bug,
  # said as one, not advice to switch to the setting the run has.
  grow = tiny_config(**{"moe.placement": "ep", "moe.dispatch_capacity_factor": 0.05})
  note = drop_note(3, {"ep_dropped_frac": 0.5}, grow)
  assert "moe.dispatch_overflow='grow'" in note and "a bug worth reporting" in note
