# Sourced by the other scripts: make sure .venv exists, holds batchd and batchd-server, and
# is first on PATH. Set PYTHON to choose the interpreter (default: python3.11, else python3).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${BATCHD_VENV:-$repo/.venv}"
py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x "$venv/bin/python" ]; then
  echo "==> creating $venv with $py" >&2
  "$py" -m venv "$venv"
fi
# shellcheck disable=SC1091
source "$venv/bin/activate"
python - <<'PY' || { echo "batchd needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2; exit 1; }
import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY
stamp="$venv/.batchd-installed"
if [ ! -f "$stamp" ] || [ "$repo/client/pyproject.toml" -nt "$stamp" ] || [ "$repo/server/pyproject.toml" -nt "$stamp" ]; then
  echo "==> installing batchd and batchd-server into $venv" >&2
  python -m pip install --quiet --upgrade pip
  # torch only ever at this pin (an unpinned torch lets pip pick a CUDA build).
  python -m pip install --quiet -e "$repo/client[torch]" -e "$repo/server"
  touch "$stamp"
fi
