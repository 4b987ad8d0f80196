"""Research code of the repository, outside the installed package: the shapes dataset, model, training and
classifier (``research/shapes``) and the drawing of the plan figure (``research/figure.py``). The benchmark scripts
are in ``benchmarks/``. All of it is tested by the suite; none of it ships in the wheel."""
