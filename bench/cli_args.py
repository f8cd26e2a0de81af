"""Argument types the bench scripts share: a bad value stops with argparse's one line naming
the flag (`error: argument --steps: must be >= 1, got 0`) and exit code 2, before any work."""
from __future__ import annotations

import argparse


def at_least(minimum: int):
  """An argparse `type` for an int >= `minimum` (0 is no stand-in for a default here)."""
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
    return value
  return parse
