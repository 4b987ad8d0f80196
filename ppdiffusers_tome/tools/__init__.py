"""What a user runs besides the library: the command line (``demo``, ``bench``), its benchmark engine, model
presets with random weights, measuring instruments, and the shipped shapes pipeline for the offline demo.

The library (``ppdiffusers_tome/*.py`` and ``ppdiffusers_tome/ops/``) never imports from here; a test checks it.
``ppdiffusers_tome.presets`` and ``ppdiffusers_tome.testing`` are the public doors to the presets.
"""
