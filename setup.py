"""Build hooks: ship ``unickpt-startup.pth`` into site-packages (regular and editable installs).

Everything else about the package is declared in ``pyproject.toml``. The ``.pth`` file makes Python run
``import unickpt._startup`` at interpreter start; that module is cheap and only activates framework
plugins when their framework is imported (see ``core/_startup.py``). Same technique as pytest-cov's
``pytest-cov.pth``.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "core", "unickpt-startup.pth")


class BuildPyWithPth(build_py):
    """Copies the .pth file to the root of the build directory, i.e. the root of the wheel."""

    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, os.path.basename(PTH)))


cmdclass = {"build_py": BuildPyWithPth}

try:  # setuptools >= 64 (PEP 660 editable installs)
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        """Adds the .pth file to the editable wheel next to setuptools' own ``__editable__`` files."""

        def _install_namespaces(self, installation_dir, pth_prefix):
            super()._install_namespaces(installation_dir, pth_prefix)
            self.copy_file(PTH, os.path.join(installation_dir, os.path.basename(PTH)))

    cmdclass["editable_wheel"] = EditableWheelWithPth
except ImportError:  # pragma: no cover - old setuptools: no editable wheels
    pass

setup(cmdclass=cmdclass)
