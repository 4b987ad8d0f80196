"""Import a script of ``benchmarks/`` (not a package) as a module, for the tests of its pure functions."""

import importlib.util
import os

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def load_benchmark(name):
    """The script ``benchmarks/<name>.py`` as a fresh module."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
