# Sourced by demo.sh and test.sh: make .venv (if missing) and install the project into it.
# Re-runs are fast: the install is skipped while pyproject.toml and the extras are unchanged.
# Usage: ensure_venv EXTRAS   (e.g. "" or "test")
ensure_venv() {
  local extras="$1" root py stamp want
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  py="${PYTHON:-}"
  if [ -z "$py" ]; then
    for cand in python3.13 python3.12 python3.11 python3.10 python3; do
      if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
        py="$cand"; break
      fi
    done
  fi
  [ -n "$py" ] || { echo "k3ckpt: need Python >= 3.10 (set PYTHON=/path/to/python)" >&2; return 2; }
  if [ ! -x "$root/.venv/bin/python" ]; then
    echo "== creating $root/.venv with $py" >&2
    "$py" -m venv "$root/.venv"
  fi
  stamp="$root/.venv/.k3ckpt-installed"
  want="$(cat "$root/pyproject.toml" | sha256sum | cut -c1-16) extras=$extras"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "== installing k3ckpt${extras:+[$extras]} into .venv" >&2
    "$root/.venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    # pip's and setuptools' chatter goes to a log; it is shown only when the install fails.
    if ! "$root/.venv/bin/python" -m pip install -q -e "$root${extras:+[$extras]}" > "$root/.venv/install.log" 2>&1 \
        || ! "$root/.venv/bin/python" -c 'import k3ckpt' 2>>"$root/.venv/install.log"; then
      tail -40 "$root/.venv/install.log" >&2
      echo "k3ckpt: install failed (full log: $root/.venv/install.log)" >&2
      return 2
    fi
    echo "$want" > "$stamp"
  fi
  export PATH="$root/.venv/bin:$PATH"
}
