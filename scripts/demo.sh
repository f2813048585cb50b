#!/usr/bin/env bash
# Quick start, command 1: install into .venv, make a demo JPEG dataset, ingest it into the
# catalog and list it. Everything it writes stays under .demo/ (override with BATCHD_HOME);
# the catalog is the embedded SQLite file unless BATCHD_DATABASE_URL points at Postgres.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$repo"
export BATCHD_HOME="${BATCHD_HOME:-$repo/.demo}"
images="${DEMO_IMAGES:-1000}"
echo "==> batchd-server demo-data --out $BATCHD_HOME/data --images $images" >&2
batchd-server demo-data --out "$BATCHD_HOME/data" --images "$images"
echo "==> batchd-server datasets" >&2
batchd-server datasets
