"""Importing PaddleOCR-VL in the engine worker without what it never uses.

paddlex's import pulls in libraries that an OCR run never touches, and a worker pays for them
at every start (each `ocrvl convert`, each worker replacement):
* torch, transformers and peft through modelscope (~10 s on a GPU machine's Python);
* scikit-learn, and scipy with it, for PaddleX's time-series and table models (~1.7 s of a
  ~3.6 s import on a 2-core machine).

`import_paddleocr_vl` keeps both out. Whatever of them paddlex does use later still gets the
real library, loaded on first use.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Iterator, Sequence
from typing import Any

# Imported by paddlex at import time for models an OCR run does not use.
DEFERRED_PACKAGES = ("sklearn",)


def import_paddleocr_vl() -> type:
    """paddleocr's `PaddleOCRVL`, imported without torch and with scikit-learn deferred."""
    _give_modelscope_its_hub()
    with deferred(DEFERRED_PACKAGES):
        from paddleocr import PaddleOCRVL
    return PaddleOCRVL  # type: ignore[no-any-return]


class _Deferred:
    """A name imported from a deferred module: the real object, imported on first use."""

    def __init__(self, module: str, name: str) -> None:
        self._where = (module, name)

    def _real(self) -> Any:
        module, name = self._where
        return getattr(importlib.import_module(module), name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._real()(*args, **kwargs)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self._real(), attr)

    def __repr__(self) -> str:
        return "<deferred {}.{}>".format(*self._where)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers imports of the deferred packages (and their submodules) with stand-ins whose
    every attribute is a `_Deferred`."""

    def __init__(self, packages: Sequence[str]) -> None:
        self.packages = tuple(packages)
        self.made: list[str] = []

    def find_spec(self, fullname: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:  # fmt: skip
        if fullname.split(".")[0] not in self.packages:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)

        def stand_for(attr: str) -> Any:
            if attr.startswith("__"):  # the import system's own questions
                raise AttributeError(attr)
            return _Deferred(spec.name, attr)

        module.__getattr__ = stand_for  # type: ignore[method-assign]
        self.made.append(spec.name)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@contextlib.contextmanager
def deferred(packages: Sequence[str]) -> Iterator[None]:
    """While inside, importing `packages` (installed, not yet imported) gives stand-ins; on
    leaving, they are forgotten, so the next import anywhere is the real one."""
    wanted = [p for p in packages
              if p not in sys.modules and importlib.util.find_spec(p) is not None]  # fmt: skip
    if not wanted:
        yield
        return
    finder = _StandInFinder(wanted)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in finder.made:
            sys.modules.pop(name, None)


def _give_modelscope_its_hub() -> None:
    """Keep paddlex's import of modelscope from loading torch, transformers and peft.

    modelscope, which paddlex imports, replaces itself with a lazy module after importing
    `modelscope.hub`, so the lazy module lacks the `hub` attribute; paddlex's `import
    modelscope.hub.errors as ...` then asks for it, and modelscope looks for a `hub` in
    transformers and peft in turn, importing them (and torch). Giving it its `hub` first
    avoids that. Its logger also imports `modelscope.utils.torch_utils` (and torch) only to
    ask whether torch.distributed runs: a stand-in answers that; anything else asked of the
    module loads the real one.
    """
    name = "modelscope.utils.torch_utils"
    if name not in sys.modules:
        stand_in = types.ModuleType(name)

        def real(attr: str) -> Any:
            if attr.startswith("__"):  # the import system's own questions (__path__...)
                raise AttributeError(attr)
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
            return getattr(importlib.import_module(name), attr)

        stand_in.is_dist = lambda: False  # type: ignore[attr-defined]
        stand_in.is_master = lambda group=None: True  # type: ignore[attr-defined]
        stand_in.__getattr__ = real  # type: ignore[method-assign]
        sys.modules[name] = stand_in
    try:
        import modelscope
        import modelscope.hub.errors  # binds `modelscope` only: no lookup on the lazy module
    except ImportError:
        return
    if "hub" not in vars(modelscope):
        modelscope.hub = sys.modules["modelscope.hub"]  # type: ignore[attr-defined]
