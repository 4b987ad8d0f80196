"""run.sh's own argument handling: usage, --version, which tests ``bash run.sh test ...`` selects and what it says
before pytest starts, and the install's progress lines."""

import os
import queue
import subprocess
import sys
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.dirname(os.path.dirname(sys.executable))  # the environment running these tests


def run_sh(*args, timeout=300, **variables):
    env = dict(os.environ, VENV=VENV, **variables)
    return subprocess.run(["bash", os.path.join(REPO, "run.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def venv_ready():
    """Whether run.sh would use this environment as it is (its install stamp is there) instead of installing."""
    digest = subprocess.run("cat requirements.txt constraints.txt setup.py | cksum", shell=True, cwd=REPO,
                            capture_output=True, text=True).stdout.split()[0]
    return os.path.isfile(os.path.join(VENV, f".installed-{digest}"))


needs_venv = pytest.mark.skipif(not venv_ready(), reason="run.sh would set up an environment first")


def test_help_and_unknown_commands_print_usage_without_setting_up():
    done = run_sh("--help", timeout=30)
    assert done.returncode == 0 and "bash run.sh test [pytest options] [PATH...]" in done.stdout
    assert "PYTHON" in done.stdout and "VENV" in done.stdout
    done = run_sh("frobnicate", timeout=30)
    assert done.returncode == 2 and "usage: bash run.sh" in done.stderr and "setting up" not in done.stderr


@needs_venv
def test_version_prints_the_package_version():
    import ppdiffusers_tome

    done = run_sh("--version", timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"ppdiffusers-tome {ppdiffusers_tome.__version__}"


def collected_files(done):
    return {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}


@needs_venv
def test_a_path_replaces_the_default_selection():
    """``bash run.sh test -q tests/tome/test_config.py`` runs that file only (it used to add the whole suite)."""
    done = run_sh("test", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/tome/test_config.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert collected_files(done) == {"tests/tome/test_config.py"}
    assert "run.sh: collecting the tests of the given paths ..." in done.stderr  # before pytest's first line


@needs_venv
def test_options_alone_keep_the_whole_suite_and_the_doctests():
    """Options without a path (here -p and -k with their values) keep the default selection, tests/ and the
    package's doctests, which -k then filters."""
    done = run_sh("test", "--collect-only", "-q", "-p", "no:cacheprovider", "-k", "test_presets_are_listed or compat",
                  TEST_WORKERS="1")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "bringing up nodes" not in done.stdout  # one worker: this process, no pytest-xdist
    assert "run.sh: collecting the whole suite (tests/ and the doctests) ..." in done.stderr
    files = collected_files(done)
    assert "tests/tools/test_cli.py" in files and "ppdiffusers_tome/compat.py" in files  # a test file and a doctest


@needs_venv
def test_the_whole_suite_runs_its_files_on_test_workers_processes():
    """Without a path the suite runs on TEST_WORKERS processes (pytest-xdist, whole files per process), each file
    still ending with its own line (one worker runs it in this process: the collection test above)."""
    done = run_sh("test", "-q", "-p", "no:cacheprovider", "-k", "test_presets_are_listed or test_the_kernel_family_switch",
                  TEST_WORKERS="2")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "bringing up nodes" in done.stdout, done.stdout[-2000:]
    assert "run.sh: collecting the whole suite (tests/ and the doctests) on 2 processes ..." in done.stderr
    lines = [line for line in done.stdout.splitlines() if " passed in " in line and "elapsed]" in line]
    assert sorted(line.split(":")[0] for line in lines) == ["tests/ops/test_force_kernels.py",
                                                            "tests/tools/test_cli.py"], lines


@pytest.mark.parametrize("workers", ["x", "0", "-2"])
def test_a_bad_test_workers_value_is_refused_by_name(workers):
    done = run_sh("test", "-q", "tests/tome/test_config.py", TEST_WORKERS=workers, timeout=60)
    assert done.returncode == 2 and f"TEST_WORKERS must be an integer >= 1, got '{workers}'" in done.stderr, done.stderr


def test_ci_runs_the_whole_suite():
    """.ci/run passes options only, so run.sh keeps the default selection (every test and doctest)."""
    lines = [line.split() for line in open(os.path.join(REPO, ".ci", "run"), encoding="utf-8")
             if line.startswith("bash run.sh test")]
    assert len(lines) == 1
    arguments = lines[0][3:]
    assert all(arg.startswith("-") or previous in ("-p", "-k", "-m") for previous, arg in zip([""] + arguments,
                                                                                             arguments)), arguments


def progress_function():
    """run.sh's ``progress`` (the filter between pip and the screen during the install), as bash source."""
    with open(os.path.join(REPO, "run.sh"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("progress() {")
    return text[start:text.index("\n}\n", start) + 3]


def test_install_progress_lines_appear_while_pip_is_still_running():
    """Each phase's line is out as soon as pip prints it, not when pip exits (awk reading the pipe used to hold the
    "installing ... (the slow part)" line back until the slow part was over)."""
    shell = subprocess.Popen(["bash", "-c", progress_function() + "progress"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.rstrip("\n")) for line in shell.stdout], daemon=True).start()
    try:
        shell.stdin.write("".join(f"Collecting package-{i}==1.0\n  Downloading package-{i}.whl\n" for i in range(11)))
        shell.stdin.write("Installing collected packages: six, numpy, paddlepaddle\n")
        shell.stdin.flush()  # and pip goes on installing: the pipe stays open
        shown = [lines.get(timeout=30) for _ in range(3)]
    finally:
        shell.stdin.close()
        shell.wait(timeout=30)
    assert shown == ["run.sh:   resolving: 1 packages so far", "run.sh:   resolving: 11 packages so far",
                     "run.sh:   installing 3 packages (the slow part) ..."]


# (message, category, module that warns): what other libraries say during the suite, which pytest.ini silences
THIRD_PARTY = [
    ("No ccache found. Please be aware that recompiling all source files may be required.", UserWarning,
     "paddle.utils.cpp_extension.extension_utils"),
    ("The distutils package is deprecated and slated for removal in Python 3.12.", DeprecationWarning,
     "paddle.jit.sot.opcode_translator.skip_files"),
    ("`pydantic.config.Extra` is deprecated, use literal values instead", DeprecationWarning,
     "paddlenlp.server.http_router.router"),
    ("The configuration file of this scheduler: DDIMScheduler is outdated.", FutureWarning,
     "ppdiffusers.pipelines.stable_diffusion.pipeline_stable_diffusion"),
    ("The 'warn' method is deprecated, use 'warning' instead", DeprecationWarning, "ppdiffusers.pipelines.pipeline_utils"),
    ("In static graph mode, where_() is the same as where() and does not perform inplace operation.", UserWarning,
     "paddle.utils.inplace_utils"),
    ("Tensor do not have 'place' interface for pir graph mode, try not to use it.", UserWarning,
     "paddle.pir.math_op_patch"),
    ("full_graph=False don't support input_spec arguments. It will not produce any effect.", UserWarning,
     "paddle.jit.dy2static.program_translator"),
]


def test_the_suite_silences_other_libraries_warnings_and_keeps_the_packages():
    """pytest.ini's filters (active inside every test) drop the other libraries' warnings of a run, and only those:
    the package's own warnings, even of the same categories, and a warning of ppdiffusers' text from elsewhere, stay."""
    import warnings

    def shown(message, category, module):
        with warnings.catch_warnings(record=True) as seen:  # (keeps the filters in force, records what passes)
            warnings.warn_explicit(message, category, module.replace(".", "/") + ".py", 1, module=module)
        return len(seen) == 1

    for message, category, module in THIRD_PARTY:
        assert not shown(message, category, module), message
    assert shown("ToMe changed nothing in UNet2DConditionModel: no transformer block's tokens ...", UserWarning,
                 "ppdiffusers_tome.core.calls")
    assert shown("clear_cache is deprecated; use clear_table_cache", DeprecationWarning, "ppdiffusers_tome.ops.cache")
    assert shown("a future change", FutureWarning, "ppdiffusers_tome.tome.config")  # (ppdiffusers\. is not a prefix)
