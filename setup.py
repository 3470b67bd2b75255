"""Package discovery for the one import package ``kvsidecar``, whose root is this folder.

pyproject.toml holds the metadata; this file only computes ``packages`` from the
tree, so a new subpackage ships without anyone editing a list: every folder that
holds an ``__init__.py`` is ``kvsidecar.<its path>``, except the folders below,
which are the repository's and never the runtime's. This file itself sits in the
package's root folder and is kept out of the wheel.
"""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

NOT_SHIPPED = ("tests", "benchmarks", "scripts", "deploy", "docs", "dashboards", "systemd",
               "build", "dist", ".venv", ".typecheck")


class BuildPy(build_py):
    """build_py without ``kvsidecar/setup.py`` (the root folder is the package)."""

    def find_package_modules(self, package: str, package_dir: str) -> list[tuple[str, str, str]]:
        found = super().find_package_modules(package, package_dir)
        return [m for m in found if (m[0], m[1]) != ("kvsidecar", "setup")]


setup(
    packages=["kvsidecar", *(
        f"kvsidecar.{name}"
        for name in find_packages(".", exclude=[p for d in NOT_SHIPPED for p in (d, f"{d}.*")])
    )],
    cmdclass={"build_py": BuildPy},
)
