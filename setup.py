"""Build the optional native module (deviceop._native); metadata lives in pyproject.toml.

The module is optional: where no C compiler is available the install still succeeds and
deviceop falls back to cuda.bindings for launches and to a watcher thread for wake-ups.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "deviceop._native",
            ["deviceop/_native.c", "deviceop/_native_objs.c"],
            depends=["deviceop/_native.h"],
            libraries=["dl", "pthread"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-missing-field-initializers", "-Wno-cast-function-type"],
            optional=True,
        )
    ]
)
