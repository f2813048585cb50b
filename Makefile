# The README's commands, as make targets.
.PHONY: demo test lint proto bench-catalog clean

demo:
	bash scripts/demo.sh

test:
	bash scripts/test.sh

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/mypy client/src server/src

proto:
	.venv/bin/python scripts/gen_proto.py

bench-catalog:
	.venv/bin/python bench/catalog_load.py --rows 1000000

clean:
	rm -rf .venv .demo .pytest_cache .mypy_cache .ruff_cache
