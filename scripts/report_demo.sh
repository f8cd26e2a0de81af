#!/usr/bin/env bash
# A 40-step tiny run that exercises every plot of the run report (ep placement: straggler and
# all-to-all bytes; reroute admission: dropped and rerouted; codec auto: modes and gather bytes),
# its report, and a screenshot of report.html in headless Chromium to look at.
#   bash scripts/report_demo.sh [WORKDIR]     (default runs/report_demo; needs .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
workdir=${1:-runs/report_demo}
rm -rf "$workdir"
XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python train.py \
  --config configs/olmoe.py:tiny --workdir "$workdir" --config.steps=40 --config.log_every=2 \
  --config.eval_every=10 --config.moe.placement=ep --config.routing.admission=reroute \
  --config.routing.admission_capacity_factor=1.0 --config.codec.mode=auto \
  --config.codec.warmup_steps=10 --config.codec.reselect_every=10 \
  --config.codec.comm_model=bytes --config.optim.lr=3e-4
.venv/bin/python -m moejax.report "$workdir"
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -n "$browser" ]; then
  "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,6000 \
    --screenshot="$workdir/report_screenshot.png" "file://$(realpath "$workdir/report.html")" \
    2>/dev/null
  echo "screenshot: $workdir/report_screenshot.png"
else
  echo "no Chromium on the PATH: open $workdir/report.html in a browser"
fi
