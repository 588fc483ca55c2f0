# The two commands of README.md: `make demo` and `make test`.
.PHONY: setup demo console-demo test test-latest lock bench

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

# The suite on the newest releases pyproject.toml admits (in .venv-latest), not the lock's.
test-latest:
	@LATEST=1 bash scripts/setup.sh
	@bash scripts/browser.sh
	@VENV=.venv-latest bash scripts/test.sh

# requirements/test.lock written afresh from pyproject.toml's test extra (docs/contributing.md).
lock:
	@bash scripts/lock.sh

bench: setup
	bash benchmarks/run_all.sh
