"""What the device machines' image lets Python import, and a finder that limits this process to it.

The lent machines have no network: a package is there if the image has it (image-packages.txt) or
if we carry its wheel (requirements-device.txt, fetched by fetch_wheels.sh into .whl/). Both lists
are distribution names; ``allowed_modules`` turns them into the top-level module names this
machine's installed distributions provide. ``limit_imports`` then makes every other top-level module
that lives outside the standard library and outside this repository unimportable, as it would be
there: ``import x`` raises ModuleNotFoundError and ``importlib.util.find_spec("x")`` answers None (so
libraries that probe for optional packages, transformers say, take their "not installed" branch).

    python -c "import sys; sys.path.insert(0, 'benchmarks/device'); import image; image.limit_imports(); ..."

tests/test_device_image.py runs ``import lora_runner`` and the gpu tests' collection so, here, in CI.
Only names are checked: a version the image holds (torch 2.11, transformers 5.17) is not emulated.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import re
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
IMAGE_PACKAGES = HERE / "image-packages.txt"
REQUIREMENTS = HERE / "requirements-device.txt"


def normalize(name: str) -> str:
    """PEP 503's normal form of a distribution name (google_re2, Google-RE2 -> google-re2)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def distribution_names(path: Path) -> list[str]:
    """The distribution names of a list file: one per line, '#' comments, '==version' pins dropped."""
    names = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(normalize(re.split(r"[=<>!~; \[]", line, maxsplit=1)[0]))
    return names


def requirements() -> list[str]:
    """requirements-device.txt's pinned lines ('name==version'), in order."""
    return [line.split("#", 1)[0].strip() for line in REQUIREMENTS.read_text().splitlines()
            if line.split("#", 1)[0].strip()]


def allowed_modules() -> frozenset[str]:
    """Top-level module names the image (plus the carried wheels) provides, as installed here."""
    allowed_dists = set(distribution_names(IMAGE_PACKAGES)) | set(distribution_names(REQUIREMENTS))
    modules = {name for name, dists in importlib.metadata.packages_distributions().items()
               if any(normalize(dist) in allowed_dists for dist in dists)}
    return frozenset(modules | set(sys.stdlib_module_names) | set(sys.builtin_module_names))


class ImageOnlyFinder(importlib.abc.MetaPathFinder):
    """sys.path's finder, except that our code finds no top-level module the image lacks.

    It replaces importlib.machinery.PathFinder in sys.meta_path: returning None alone would let the
    PathFinder after it find the module anyway. Modules found inside this repository (the packages,
    tests/, benchmarks/) or the standard library are always found, and so is whatever an installed
    package imports itself: the image holds its own versions of them with what those need (this
    machine's newer huggingface-hub needs httpx2, the image's does not), so only imports made by code
    outside site-packages (ours, ``python -c``) are held to the lists.
    """

    def __init__(self, allowed: frozenset[str]) -> None:
        self.allowed = allowed
        self.refused: set[str] = set()  # what was asked for and not found (for messages)

    def find_spec(self, fullname, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        try:
            if spec is None or "." in fullname or fullname in self.allowed or _imported_by_a_package():
                return spec
        except (NameError, TypeError, AttributeError):  # interpreter shutdown: this module's globals are gone
            return spec
        origin = spec.origin or (spec.submodule_search_locations or [""])[0]
        if origin and _always_allowed(Path(origin).resolve()):
            return spec
        self.refused.add(fullname)
        return None

    def invalidate_caches(self) -> None:
        importlib.machinery.PathFinder.invalidate_caches()

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        """Installed distributions' metadata, as PathFinder answers (importlib.metadata asks the finders)."""
        return importlib.machinery.PathFinder.find_distributions(context)


def _site_packages() -> list[Path]:
    return [Path(sysconfig.get_path(key)).resolve() for key in ("purelib", "platlib")]


def _imported_by_a_package() -> bool:
    """True when the import statement being served is in an installed package's file (site-packages)."""
    frame = sys._getframe(2)  # noqa: SLF001  (find_spec's caller is importlib's machinery)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not (filename.startswith("<frozen importlib") or filename == __file__
                or Path(filename).parent.name == "importlib"):
            break
        frame = frame.f_back
    if frame is None or filename.startswith("<"):
        return False
    path = Path(filename).resolve()
    return not path.is_relative_to(ROOT) and any(path.is_relative_to(d) for d in _site_packages())


def _always_allowed(path: Path) -> bool:
    """In this repository, or in the standard library's folders (its private modules:
    _sysconfigdata_*) but not in site-packages."""
    if path.is_relative_to(ROOT):
        return True
    packages = _site_packages()
    stdlib = [Path(sysconfig.get_path(key)).resolve() for key in ("stdlib", "platstdlib")]
    return any(path.is_relative_to(d) for d in stdlib) and not any(path.is_relative_to(d) for d in packages)


def gpu_test_files(tests: Path) -> list[Path]:
    """The test files under `tests` that hold gpu-marked tests, which the device runs: the others may
    import what the image lacks (the server's fastapi, compressed-tensors) without losing a gpu test."""
    return [path for path in sorted(tests.glob("test_*.py")) if "mark.gpu" in path.read_text()]


def limit_imports() -> ImageOnlyFinder:
    """Install ImageOnlyFinder in place of PathFinder and forget already imported modules it refuses."""
    finder = ImageOnlyFinder(allowed_modules())
    sys.meta_path[:] = [finder if entry is importlib.machinery.PathFinder else entry for entry in sys.meta_path]
    for name in [n for n in sys.modules if "." not in n and n not in finder.allowed]:
        module = sys.modules[name]
        where = getattr(module, "__file__", None)
        if where and not _always_allowed(Path(where).resolve()):
            del sys.modules[name]  # imported before the limit (site hooks): would be found in sys.modules
    return finder


if __name__ == "__main__":  # python benchmarks/device/image.py MODULE...: which of them import under the limit
    limit_imports()
    for name in sys.argv[1:]:
        try:
            __import__(name)
            print(f"{name}: ok")
        except ImportError as exc:
            print(f"{name}: {exc!r}")
