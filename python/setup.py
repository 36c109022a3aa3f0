"""Builds memanat's CPython extension from the repository's one header.

The C sources live outside this folder (../memanat.h, ../bind/); they are copied into src/
before the build, so that `pip install ./python` and an sdist made here both carry them.
"""
import os
import shutil
import sys

from setuptools import Extension, setup

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SRC = os.path.join(HERE, "src")
FILES = ["memanat.h", os.path.join("bind", "memanat_api.h"), os.path.join("bind", "memanat_api.c")]


def copy_sources() -> None:
    """Refreshes src/ from the repository when the repository is there."""
    for name in FILES:
        origin = os.path.join(ROOT, name)
        if os.path.exists(origin):
            os.makedirs(os.path.dirname(os.path.join(SRC, name)), exist_ok=True)
            shutil.copyfile(origin, os.path.join(SRC, name))
        elif not os.path.exists(os.path.join(SRC, name)):
            sys.exit("memanat: %s not found; build from a checkout of the repository "
                     "(pip install ./python)" % origin)


copy_sources()
unix = not sys.platform.startswith("win")
setup(
    ext_modules=[
        Extension(
            "memanat._native",
            sources=["memanat/_native.c", "src/bind/memanat_api.c"],
            include_dirs=["src"],
            # one cache per call: no lock needed, and no pthreads to link
            define_macros=[("MEMANAT_NO_THREADS", "1"), ("Py_LIMITED_API", "0x03090000")],
            extra_compile_args=["-std=c99", "-O2"] if unix else [],
            extra_link_args=["-s"] if sys.platform.startswith("linux") else [],  # no debug info
            libraries=["m"] if unix else [],
            py_limited_api=True,
        )
    ],
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
