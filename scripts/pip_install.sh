# Sourced by the setup scripts: pip_install ARGS... installs into "$VENV" quietly, and on failure
# prints pip's output less the index-location noise.
pip_install() {
  local log
  log=$(mktemp)
  if ! "$VENV/bin/python" -m pip install -q "$@" >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2 || true
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}
