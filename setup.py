"""Package discovery for m2nkit's folder layout; everything else is in pyproject.toml.

The design card keeps ``manifest/``, ``adapters/`` and ``engine/`` at the
repository root (and the top package's ``__init__`` in ``package/``), while
they install as ``m2nkit.manifest``, ``m2nkit.adapters`` and
``m2nkit.engine``. pyproject.toml alone can map those folders
(``package-dir``) but then needs every subpackage listed by hand, and one
left out (a new ``adapters/families/``) silently drops out of a wheel while
an editable install still finds it. So this file maps the four roots and
lets setuptools find every package below them: any folder with an
``__init__.py`` whose parents are packages too. ``tests/test_wheel.py``
builds a wheel and imports every such folder from it.
"""

from setuptools import find_packages, setup

#: import package -> folder; subpackages resolve under these by name.
ROOTS = {"m2nkit": "package", "m2nkit.manifest": "manifest",
         "m2nkit.adapters": "adapters", "m2nkit.engine": "engine"}

#: Non-Python files shipped inside the packages (none are read today; a
#: declarative table written as JSON or YAML would be). tests/test_wheel.py
#: fails on any other file found in a package folder that the wheel lacks.
DATA_PATTERNS = ["*.json", "*.yaml", "*.yml", "py.typed"]


def discover(roots: dict[str, str]) -> list[str]:
    """Every package under ``roots``: the roots, and each folder below one
    that holds an ``__init__.py`` (reached only through such folders)."""
    packages = []
    for name, folder in roots.items():
        packages.append(name)
        packages += [f"{name}.{sub}" for sub in find_packages(where=folder)]
    return sorted(packages)


setup(packages=discover(ROOTS), package_dir=dict(ROOTS),
      package_data={"": DATA_PATTERNS})
