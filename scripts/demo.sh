#!/usr/bin/env bash
# Quick start, command 1: install into .venv, make a demo JPEG dataset and ingest it, start
# batchd-server on a unix socket, train a tiny CNN for 2 epochs through batchd.Loader (it
# prints samples/s and how long the loop waited for data), then stop the server cleanly.
# Everything it writes stays under .demo/ (override with BATCHD_HOME); the catalog is the
# embedded SQLite file unless BATCHD_DATABASE_URL points at Postgres.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$repo"
export BATCHD_HOME="${BATCHD_HOME:-$repo/.demo}"
mkdir -p "$BATCHD_HOME"
images="${DEMO_IMAGES:-1000}"
echo "==> batchd-server demo-data --out $BATCHD_HOME/data --images $images" >&2
batchd-server demo-data --out "$BATCHD_HOME/data" --images "$images"
echo "==> batchd-server datasets" >&2
batchd-server datasets

socket="$BATCHD_HOME/batchd.sock"
log="$BATCHD_HOME/server.log"
echo "==> batchd-server serve --listen unix://$socket (log: $log)" >&2
batchd-server serve --listen "unix://$socket" >"$log" 2>&1 &
server=$!
stop_server() {
  if kill -0 "$server" 2>/dev/null; then
    kill -TERM "$server"
    wait "$server" || { echo "batchd-server exited with $?; see $log" >&2; return 1; }
  fi
}
trap 'kill -TERM "$server" 2>/dev/null || true' EXIT
for _ in $(seq 1200); do
  grep -q "ready: serving on" "$log" && break
  kill -0 "$server" 2>/dev/null || { cat "$log" >&2; echo "batchd-server did not start" >&2; exit 1; }
  sleep 0.1
done
grep -q "ready: serving on" "$log" || { cat "$log" >&2; echo "batchd-server not ready after 120 s" >&2; exit 1; }
grep "ready: serving on" "$log" >&2

echo "==> python examples/train_demo.py --epochs 2" >&2
BATCHD_TARGET="unix://$socket" python examples/train_demo.py --epochs 2
echo "==> stopping batchd-server" >&2
stop_server
trap - EXIT
echo "==> done: the server stopped cleanly" >&2
