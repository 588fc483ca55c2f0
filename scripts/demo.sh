#!/usr/bin/env bash
# `make demo`: write the quickstart's HTML report, then start JupyterLab on the quickstart notebook.
# It prints the URL that opens the notebook (with its token); without a display no browser is
# started. Stop it with Ctrl+C.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python examples/quickstart_report.py build/quickstart.html
browser=(--no-browser)
if [ -n "${DISPLAY:-}" ] || [ -n "${WAYLAND_DISPLAY:-}" ] || [ "$(uname)" = Darwin ]; then
    browser=()
fi
[ "$(id -u)" != 0 ] || browser+=(--allow-root)  # containers often run as root
port=${PORT:-8888}
token=$(.venv/bin/python -c "import secrets; print(secrets.token_hex(24))")
echo
echo "The explorer, in JupyterLab (Ctrl+C stops it): open"
echo "    http://127.0.0.1:${port}/lab/tree/notebooks/01_quickstart.ipynb?token=${token}"
echo "and run the notebook (Run > Run All Cells)."
echo
exec .venv/bin/python -m jupyterlab "${browser[@]}" --ServerApp.ip=127.0.0.1 --ServerApp.port="$port" \
    --ServerApp.port_retries=0 --IdentityProvider.token="$token" notebooks/01_quickstart.ipynb
