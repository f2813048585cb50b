#!/usr/bin/env bash
# Quick start, command 2: install the test tools into .venv, lint, type-check and run every
# test. Tests use a private throwaway Postgres (initdb + pg_ctl in a temp dir) unless
# BATCHD_TEST_DATABASE_URL names one. Extra arguments go to pytest.
set -euo pipefail
source "$(dirname "$0")/_venv.sh"
cd "$repo"
# The frameworks the examples run on come in on the same command line as test.txt's
# torch==2.13.0, so pip cannot pick a CUDA torch for them.
python -m pip install --quiet -r requirements/test.txt -r requirements/frameworks.txt
# The az:// tests run against Azurite, Azure Blob Storage's emulator, from npm (git ignores
# .cache/). Without npm the tests that need it fail and say how to install it.
azurite_version=3.37.0
if [ -z "${BATCHD_AZURITE:-}" ] && command -v npm >/dev/null \
  && ! grep -qs "\"version\": \"$azurite_version\"" .cache/azurite/node_modules/azurite/package.json; then
  npm install --silent --no-audit --no-fund --prefix .cache/azurite "azurite@$azurite_version" >&2
fi
echo "==> ruff" >&2
ruff check .
ruff format --check .
echo "==> mypy" >&2
mypy client/src server/src
echo "==> pytest" >&2
# Test files run in parallel, one file per pytest-xdist worker at a time (module fixtures stay
# shared within a file): BATCHD_TEST_JOBS workers, default 2; 0 runs everything in-process.
jobs="${BATCHD_TEST_JOBS:-2}"
if [ "$jobs" = "0" ]; then
  python -m pytest "$@"
else
  python -m pytest -n "$jobs" --dist loadfile "$@"
fi
