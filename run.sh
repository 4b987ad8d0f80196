#!/usr/bin/env bash
# Set up a virtual environment with the pinned CPU set (one pip command), then run a command inside it, so that
# every command works in a fresh shell without activating anything:
#   bash run.sh demo [demo options]        # the main job: vanilla vs ToMe on the embedded model
#   bash run.sh test [pytest options]      # ruff check, then the full test suite (tests/ and the doctests of the package and research/)
#   bash run.sh test [options] PATH...     # only those tests, e.g. bash run.sh test -x -q tests/test_api.py
#   bash run.sh bench [bench options]      # python -m ppdiffusers_tome bench ...
#   bash run.sh python [args]              # the environment's python, e.g. bash run.sh python examples/controlnet.py
#   bash run.sh --version                  # the package's version
# PYTHON selects the interpreter that creates the environment (default python3); VENV the environment folder
# (default .venv), e.g. PYTHON=python3.11 VENV=/tmp/tome-env bash run.sh demo
set -euo pipefail
cd "$(dirname "$0")"
usage() {
  echo "usage: bash run.sh demo|bench [options]   bash run.sh test [pytest options] [PATH...]"
  echo "       bash run.sh python [args]   bash run.sh --version   bash run.sh --help"
  echo "test: without PATHs, the whole suite (tests/ and the doctests of ppdiffusers_tome and research/); with PATHs (files,"
  echo "      folders or node ids, relative to the repository), only those. Options alone keep the whole suite."
  echo "environment: PYTHON (interpreter that creates the environment; default python3), VENV (its folder; default .venv),"
  echo "             TEST_WORKERS (processes that run the whole suite; default: the CPU count, at most 4)"
}
# pip's output in, one line per phase out, as it comes: every 10th package found, then the install's start
progress() {
  local line found=0 names
  while IFS= read -r line; do
    case "$line" in
      "Collecting "*)
        found=$((found + 1))
        if [ $((found % 10)) -eq 1 ]; then echo "run.sh:   resolving: $found packages so far"; fi ;;
      "Installing collected packages"*)
        IFS=',' read -ra names <<< "${line#*: }"
        echo "run.sh:   installing ${#names[@]} packages (the slow part) ..." ;;
    esac
  done
}
case "${1:-}" in
  demo|bench|test|python|--version) ;;
  -h|--help) usage; exit 0 ;;
  *) usage >&2; exit 2 ;;
esac
venv="${VENV:-.venv}"
stamp="$venv/.installed-$(cat requirements.txt constraints.txt setup.py | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  echo "run.sh: setting up $venv with the pinned CPU set (one pip command; about 5 minutes the first time)" >&2
  start=$(date +%s)
  "${PYTHON:-python3}" -m venv "$venv"
  log="$venv/pip-install.log"
  # pip's own lines go to the log; the screen gets one line per phase (packages found, then installing), each as
  # soon as pip prints it (progress reads line by line: awk reading a pipe may hold lines back until its buffer fills)
  set +e
  PYTHONUNBUFFERED=1 "$venv/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
    --use-pep517 -r requirements.txt -c constraints.txt -e . 2>&1 | tee "$log" | progress >&2
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    tail -n 25 "$log" >&2
    echo "run.sh: pip install failed (exit $status); the whole log is in $log" >&2
    exit "$status"
  fi
  echo "run.sh: $venv ready in $(( $(date +%s) - start )) s" >&2
  touch "$stamp"
fi
what="$1"
shift
case "$what" in
  demo|bench) exec "$venv/bin/python" -m ppdiffusers_tome "$what" "$@" ;;
  --version) exec "$venv/bin/python" -m ppdiffusers_tome --version ;;
  test)
    # Paths among the arguments replace the default selection; an option's value (-k EXPR, --ignore PATH, ...)
    # is not a path even if a file of that name exists.
    # The whole suite runs its files on TEST_WORKERS processes (pytest-xdist, a file per process at a time; default:
    # the CPU count, at most 4); -n/--numprocesses or -p no:xdist among the options decide instead.
    selection=(tests --doctest-modules ppdiffusers_tome research)
    workers="${TEST_WORKERS:-$(nproc 2>/dev/null || echo 1)}"
    case "$workers" in
      ''|*[!0-9]*|0) echo "run.sh: TEST_WORKERS must be an integer >= 1, got '$workers'" >&2; exit 2 ;;
    esac
    if [ "$workers" -gt 4 ]; then workers=4; fi
    previous=""
    for arg in "$@"; do
      case "$previous" in
        -k|-m|-p|-o|-c|-W|--ignore|--ignore-glob|--deselect|--rootdir|--basetemp|--confcutdir|--junitxml) ;;
        *) case "$arg" in -*) ;; *) if [ -e "${arg%%::*}" ]; then selection=(--doctest-modules); fi ;; esac ;;
      esac
      case "$previous $arg" in
        "-p no:xdist"|*" -n"|*" -n"[0-9]*|*" --numprocesses"*|*" -nauto") workers=0 ;;
      esac
      previous="$arg"
    done
    distribute=()
    if [ "${#selection[@]}" -gt 1 ] && [ "$workers" -gt 1 ]; then distribute=(-n "$workers" --dist loadfile); fi
    if [ "${#selection[@]}" -gt 1 ]; then
      # the whole suite starts with the linter (ruff.toml: pyflakes and import order), a second or two
      echo "run.sh: ruff check (pyflakes, import order)" >&2
      "$venv/bin/ruff" check --quiet . || { echo "run.sh: ruff check failed; 'bash run.sh python -m ruff check --fix .' mends most of it" >&2; exit 1; }
    fi
    # pytest prints nothing while it collects and starts its workers (about a minute for the whole suite)
    if [ "${#selection[@]}" -gt 1 ]; then chosen="the whole suite (tests/ and the doctests)"; else chosen="the tests of the given paths"; fi
    if [ "${#distribute[@]}" -gt 0 ]; then chosen="$chosen on $workers processes"; fi
    echo "run.sh: collecting $chosen ..." >&2
    exec "$venv/bin/python" -m pytest "${selection[@]}" "${distribute[@]}" "$@" ;;
  python) exec "$venv/bin/python" "$@" ;;
esac
