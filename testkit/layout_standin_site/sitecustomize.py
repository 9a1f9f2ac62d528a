"""Opt-in: with this folder on PYTHONPATH, the stand-in layout model's ink rows reach
PaddleX's transformers engine (`testkit.layout_standin`; inert for any other model).

Test kit and bench only, never the product. Any other `sitecustomize` on the path (which this
one shadows) still runs afterwards.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
_CHECKOUT = str(Path(__file__).resolve().parents[2])


def _install() -> None:
    try:
        from testkit.layout_standin import install
    except ImportError:  # the checkout is not on the path: reach it last, after everything
        sys.path.append(_CHECKOUT)
        from testkit.layout_standin import install
    install()


def _chain() -> None:
    """Run the `sitecustomize` this one shadows, if any."""
    rest = [p for p in sys.path if p and str(Path(p).resolve()) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_install()
_chain()
