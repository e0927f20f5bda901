#!/usr/bin/env bash
# Creates .venv in the checkout from a Python >= 3.12 found on this machine, and installs jaxrl
# with its test extras pinned by requirements.lock (the exact versions CI tested).
# Re-running is cheap: it reinstalls only when pyproject.toml or requirements.lock changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv

find_python() {
  local cand
  for cand in python3.13 python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 &&
       "$cand" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
      command -v "$cand"; return 0
    fi
  done
  local root="${PYENV_ROOT:-$HOME/.pyenv}"
  command -v pyenv >/dev/null 2>&1 && root="$(pyenv root)"
  for cand in $(ls -d "$root"/versions/3.1[3-9]* "$root"/versions/3.12* 2>/dev/null | sort -rV); do
    for exe in "$cand"/bin/python3.1[2-9]; do
      if [ -x "$exe" ] && "$exe" -c 'import sys, venv; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then
        echo "$exe"; return 0
      fi
    done
  done
  return 1
}

# TCMalloc, which the jaxrl command preloads (jaxrl/backends/cpu/allocator.py): on CPU it spares
# each learner update ~170,000 page faults (anchor step 1.21-1.30 s against 1.39-1.51 on glibc
# malloc).
# Installed from the distribution when this runs as root with apt-get; otherwise one hint line.
# JAXRL_TCMALLOC=0 skips it. jaxrl works the same without it, only slower on CPU.
have_tcmalloc() {
  ls /usr/lib/*-linux-gnu/libtcmalloc*.so* /usr/lib64/libtcmalloc*.so* \
     /usr/lib/libtcmalloc*.so* /usr/local/lib/libtcmalloc*.so* >/dev/null 2>&1
}
if [ "$(uname -s)" = Linux ] && [ "${JAXRL_TCMALLOC:-}" != 0 ] && ! have_tcmalloc; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing libtcmalloc-minimal4 with apt-get (JAXRL_TCMALLOC=0 skips this)"
    DEBIAN_FRONTEND=noninteractive timeout 180 apt-get install -y -q --no-install-recommends \
      libtcmalloc-minimal4 >/dev/null 2>&1 ||
      echo "setup: apt-get could not install libtcmalloc-minimal4; jaxrl runs on glibc malloc"
  else
    echo "setup: no tcmalloc here, so jaxrl runs on glibc malloc (slower on CPU); to add it:" \
         "sudo apt-get install libtcmalloc-minimal4"
  fi
fi

stamp="$VENV/.jaxrl-installed"
want="$(cat pyproject.toml requirements.lock | sha256sum | cut -d' ' -f1)"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  if ! py="$(find_python)"; then
    echo "jaxrl needs Python 3.12 or newer and none was found (tried python3.13, python3.12, python3 on PATH and pyenv's versions): install Python 3.12, e.g. 'pyenv install 3.12', then re-run." >&2
    exit 1
  fi
  echo "setup: creating $VENV with $py"
  "$py" -m venv "$VENV"
fi
echo "setup: installing jaxrl[test] pinned by requirements.lock"
# (This machine's pip config names extra index folders that may not exist; drop that noise.)
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[test]' \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
echo "$want" > "$stamp"
