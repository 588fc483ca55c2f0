"""The compiled part of pipexplore: the simulator's processor-sharing loop (``pipexplore/predict/_sharing.c``).

Everything else is declared in ``pyproject.toml``. The extension is optional: where no C compiler
is found the install goes on and the simulator runs the same loop in Python (slower, same results).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("pipexplore.predict._sharing", ["pipexplore/predict/_sharing.c"], optional=True,
                             extra_compile_args=["-O2", "-ffp-contract=off"])])
