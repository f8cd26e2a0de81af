"""Errors that carry a one-line message meant for the user.

`train.py` and the other entry points print these as a single line and exit non-zero; anything
else is a bug and keeps its traceback.
"""


class MoejaxError(Exception):
  """Base class: the message names the field, file or value and what would be valid."""


class ConfigError(MoejaxError):
  """A config field has a bad value or an inconsistent combination."""


class DataError(MoejaxError):
  """A data file or tokenizer cannot be used. `input`: which input failed, "tokenizer" or
  "path" (a caller names its own setting for it), or None."""

  def __init__(self, message: str, input: str | None = None):
    super().__init__(message)
    self.input = input


class CheckpointError(MoejaxError):
  """A checkpoint cannot be read, is incomplete, or does not match the config.
  `weights_differ`: the config's model differs from the checkpoint's (its weights would not fit
  the run either), where known."""

  def __init__(self, message: str, weights_differ: bool = True):
    super().__init__(message)
    self.weights_differ = weights_differ


class TrainingError(MoejaxError):
  """Training cannot continue (for example, a non-finite loss)."""


def run_command(body) -> int:
  """An entry point's exit code: `body()` -> 0, or a MoejaxError printed as one line
  `error: ...` on stderr -> 2."""
  import sys
  try:
    body()
  except MoejaxError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
