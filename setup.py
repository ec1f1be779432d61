"""The one compiled part: light_jax/data/_jpeg_region.c, a JPEG region decoder over libjpeg-turbo.

Everything else is in pyproject.toml. The extension needs a C compiler, libjpeg's headers and Python's
(Debian/Ubuntu: apt-get install gcc libjpeg-dev python3-dev; `make` installs them when it runs as root). It is
optional: without them the install still succeeds, with a build warning, and whole JPEGs are decoded instead
(light_jax logs this when it reads JPEGs).
"""

from setuptools import Extension, setup

setup(
  ext_modules=[
    Extension("light_jax.data._jpeg_region", ["light_jax/data/_jpeg_region.c"], libraries=["jpeg"], optional=True)
  ]
)
