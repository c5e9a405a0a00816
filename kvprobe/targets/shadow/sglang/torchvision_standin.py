"""A stand-in for torchvision, copied by kvprobe as `torchvision/__init__.py` into its SGLang shadow
environment (`kvprobe/targets/shadow/sglang/env.py`); this module is that file's source.

SGLang 0.5.23 imports torchvision at module level (`sglang.srt.configs` -> nano_nemotron_vl,
deepseek_ocr; the multimodal processors), and transformers imports it once it is present; the only
torchvision wheels reachable for torch 2.13.0 are CUDA builds that fail to load with its CPU build.
Here every name of every submodule (`torchvision.transforms.v2.functional`, `torchvision.io`, ...)
is a placeholder: reading attributes of it gives more placeholders (module-level uses such as
`InterpolationMode.BICUBIC` as a default argument), calling it raises. A text-only model never
calls one. Standard library only.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvprobe.standin"
STANDIN = True  # how kvprobe's environment check recognises it


class Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is a stand-in in kvprobe's SGLang shadow environment "
                           "(text-only models never call it)")

    def __mro_entries__(self, bases):
        return (object,)  # `class X(transforms.Compose)` at import time

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


def _module_getattr(modname: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{modname}.{attr}")
    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Any `<this package>.x.y` imports as a module of placeholders."""

    def __init__(self, prefix: str):
        self.prefix = prefix + "."

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.prefix):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr(spec.name)
        return mod

    def exec_module(self, module):
        return None


__getattr__ = _module_getattr(__name__)
if not any(isinstance(f, _Submodules) and f.prefix == __name__ + "." for f in sys.meta_path):
    sys.meta_path.append(_Submodules(__name__))
