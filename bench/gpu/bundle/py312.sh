# Sourced by the bundle makers: py312 prints a Python 3.12 (the GPU machine's version) to
# download and install for, or says how to get one.
py312() {
  for c in "${PY:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$c"; return; }
  done
  echo "no Python 3.12 found: set PY=/path/to/python3.12 (e.g. pyenv install 3.12, uv python install 3.12)" >&2
  return 1
}
