# The two commands of README.md: `make demo` and `make test`.
.PHONY: setup demo console-demo test bench

setup:
	@bash scripts/setup.sh

# The explorer: the quickstart's HTML report (build/quickstart.html), then JupyterLab on the quickstart.
demo: setup
	@bash scripts/demo.sh

# A skip-connection model trained through GPipe, in the console.
console-demo: setup
	.venv/bin/python examples/demo.py

test: setup
	@bash scripts/browser.sh
	@bash scripts/test.sh

bench: setup
	bash benchmarks/run_all.sh
