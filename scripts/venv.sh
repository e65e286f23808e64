# Sourced by demo.sh, test.sh and test_min_versions.sh: make a venv (if missing) and install the
# project into it.
# Usage: ensure_venv EXTRAS [VENV [PIP_ARGS...]]   (e.g. ensure_venv "" or ensure_venv "test,plot";
#        VENV defaults to .venv; PIP_ARGS such as "-c constraints/minimum.txt" go to pip install)
# Re-runs are fast: the install is skipped while pyproject.toml (and PIP_ARGS) are unchanged and
# the extras asked for are among those already installed. One venv serves the demo ("") and the
# tests ("test,plot") alike: asking for fewer extras than installed reinstalls nothing; asking for
# more, or a changed pyproject.toml, installs the union of the old and the new.

# find_python [MINOR]: print the first interpreter >= 3.MINOR (default 10; scripts/engine_env.sh asks
# for 11), only $PYTHON when set. Probed silently: with pyenv, `command -v python3.13` finds a shim
# that prints "pyenv: python3.13: command not found" when run.
find_python() {
  local cand min="${1:-10}" cands="python3.13 python3.12 python3.11 python3.10 python3"
  [ -z "${PYTHON:-}" ] || cands="$PYTHON"  # an explicit choice is the only candidate
  for cand in $cands; do
    if command -v "$cand" >/dev/null 2>&1 \
        && "$cand" -c "import sys; sys.exit(sys.version_info < (3, $min))" >/dev/null 2>&1; then
      echo "$cand"; return 0
    fi
  done
  return 1
}

# extras_union A B: the comma-separated union of two extras lists, sorted, without empties.
extras_union() {
  printf '%s\n' "$1" "$2" | tr ',' '\n' | sed '/^$/d' | sort -u | paste -sd, -
}

ensure_venv() {
  local extras="$1" root venv py stamp key have_key have_extras want_extras
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  venv="${2:-$root/.venv}"
  shift; [ $# -eq 0 ] || shift
  if [ ! -x "$venv/bin/python" ]; then
    py="$(find_python)" || { echo "k3ckpt: need Python >= 3.10 (set PYTHON=/path/to/python)" >&2; return 2; }
    echo "== creating $venv with $py" >&2
    "$py" -m venv "$venv"
  fi
  stamp="$venv/.k3ckpt-installed"
  # The stamp: "<hash of pyproject.toml and the pip arguments> extras=<installed extras>".
  key="$({ cat "$root/pyproject.toml"; printf '%s\n' "$@"; for a in "$@"; do [ ! -f "$a" ] || cat "$a"; done; } \
    | sha256sum | cut -c1-16)"
  have_key="$(cut -d' ' -f1 "$stamp" 2>/dev/null || true)"
  have_extras="$(sed -n 's/^[^ ]* extras=//p' "$stamp" 2>/dev/null || true)"
  # Extras installed before stay (a reinstall keeps them current): the next script to run with
  # the other extras then finds the venv ready.
  want_extras="$(extras_union "$have_extras" "$extras")"
  if [ "$have_key" = "$key" ] && [ "$want_extras" = "$have_extras" ]; then
    export PATH="$venv/bin:$PATH"
    return 0
  fi
  echo "== installing k3ckpt${want_extras:+[$want_extras]} into $venv" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  # pip's and setuptools' chatter goes to a log; it is shown only when the install fails.
  if ! "$venv/bin/python" -m pip install -q "$@" -e "$root${want_extras:+[$want_extras]}" > "$venv/install.log" 2>&1 \
      || ! "$venv/bin/python" -c 'import k3ckpt' 2>>"$venv/install.log"; then
    tail -40 "$venv/install.log" >&2
    echo "k3ckpt: install failed (full log: $venv/install.log)" >&2
    return 2
  fi
  echo "$key extras=$want_extras" > "$stamp"
  export PATH="$venv/bin:$PATH"
}
