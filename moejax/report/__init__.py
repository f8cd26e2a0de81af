"""Run reports: `python -m moejax.report WORKDIR` writes WORKDIR/report.html (series.py: what is
plotted, from metrics.jsonl and codec_selection.json; render.py: the plots and the page)."""
