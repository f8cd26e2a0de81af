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
