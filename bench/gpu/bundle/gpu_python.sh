# Sourced by the bundle makers: the GPU machine (CPython 3.12 on x86_64) as the target of
# `pip download`/`pip install --target` here. py312 prints a Python 3.12 to download and
# install with, or says how to get one; PLATFORMS are the wheel tags that machine runs.
py312() {
  for c in "${PY:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
    [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$c"; return; }
  done
  echo "no Python 3.12 found: set PY=/path/to/python3.12 (e.g. pyenv install 3.12, uv python install 3.12)" >&2
  return 1
}
PLATFORMS="$(for n in $(seq 39 -1 5); do printf -- ' --platform manylinux_2_%s_x86_64' "$n"; done)"
PLATFORMS="$PLATFORMS --platform manylinux2014_x86_64 --platform manylinux2010_x86_64"
PLATFORMS="$PLATFORMS --platform manylinux1_x86_64 --platform any"
