# The two commands of README.md: `make demo` and `make test`.
.PHONY: setup demo test bench

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/python examples/demo.py

test: setup
	@bash scripts/browser.sh
	.venv/bin/python -m pytest -q tests notebooks --nbval-lax --nbval-sanitize-with notebooks/nbval_sanitize.cfg -p no:cacheprovider

bench: setup
	bash benchmarks/run_all.sh
