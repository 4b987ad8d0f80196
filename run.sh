#!/usr/bin/env bash
# Set up a virtual environment with the pinned CPU set (one pip command), then run the main job or the tests.
#   bash run.sh demo [demo options]    # the main job: vanilla vs ToMe on the embedded tiny SD model
#   bash run.sh test [pytest options]  # the full test suite
# PYTHON selects the interpreter (default python3); VENV the environment folder (default .venv).
set -euo pipefail
cd "$(dirname "$0")"
venv="${VENV:-.venv}"
stamp="$venv/.installed-$(cat requirements.txt constraints.txt setup.py | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  "${PYTHON:-python3}" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    -r requirements.txt -c constraints.txt -e .
  touch "$stamp"
fi
what="${1:-}"
[ $# -gt 0 ] && shift
case "$what" in
  demo) exec "$venv/bin/python" -m ppdiffusers_tome demo "$@" ;;
  test) exec "$venv/bin/python" -m pytest tests --doctest-modules ppdiffusers_tome "$@" ;;
  *) echo "usage: bash run.sh demo|test [options]" >&2; exit 2 ;;
esac
