"""Stand-ins for what the engines' Python servers import and a CPU-only machine
lacks, for the shipped-server process tests (shipped_servers.rs): importing
this module installs them. The engines' own code then imports as shipped.

- GPU-only and heavy modules (torch, triton, SGLang's device, distributed,
  layer and model-executor packages, ...) are empty stand-ins: any attribute,
  call, index, arithmetic or base class of them is one more stand-in.
- `sglang.srt.configs` and `sglang.srt.utils.hf_transformers_patches` keep
  their real files but not their package imports (every model's config).
- `sglang.srt.managers.io_struct` (the engine core's request types, whose
  imports reach the whole model stack): each class is a plain record of the
  fields it is built with.

A script adds its own with `stand_in(...)` (whole packages) and `lenient(...)`
(one module with the attributes it names) before it imports the server.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types



class _Base:
    def __init_subclass__(cls, **kwargs):
        pass

    def __init__(self, *args, **kwargs):
        pass


class _Anything:
    """Any attribute, call, index or base class of a module that is not here."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Anything()

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __getitem__(self, key):
        return _Anything()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __or__(self, other):
        return self

    def __ror__(self, other):
        return other

    def __mro_entries__(self, bases):
        return (_Base,)

    def _same(self, *args):
        return self

    __neg__ = __pos__ = __abs__ = __invert__ = _same
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _same
    __truediv__ = __rtruediv__ = __floordiv__ = __mod__ = __pow__ = _same

    def __lt__(self, other):
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __int__(self):
        return 0

    __index__ = __len__ = __int__

    def __float__(self):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


# Accelerators SGLang probes with hasattr(torch, ...): absent here.
_ABSENT = {"npu", "xpu", "musa", "hpu", "mlu"}


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if (name.startswith("__") and name.endswith("__")) or name in _ABSENT:
            raise AttributeError(name)
        return _Anything()


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if any(name == r or name.startswith(r + ".") for r in self.roots):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = "2.14.1"
        return module

    def exec_module(self, module):
        pass


_FINDER = _StandIns(
    [
        "torch", "triton", "torchvision", "zmq", "tqdm", "IPython", "aiohttp",
        "transformers", "huggingface_hub", "sentencepiece", "safetensors",
        # SGLang's device, distributed, layer and model-executor packages: GPU-only.
        "sglang.srt.platforms", "sglang.srt.distributed", "sglang.srt.layers",
        "sglang.srt.model_executor", "sglang.kernels",
        # The engine core's processes, which the tests replace.
        "sglang.srt.managers.scheduler", "sglang.srt.managers.data_parallel_controller",
    ]
)
sys.meta_path.insert(0, _FINDER)


def stand_in(*names):
    """Stands in for these modules (and their submodules) too."""
    _FINDER.roots.extend(names)




def lenient(name, path=None, **attrs):
    """A module of these attributes, and a stand-in for any other; with `path`,
    its submodules are the real files there."""
    module = _StandInModule(name)
    if path is not None:
        module.__path__ = [path]
    for key, value in attrs.items():
        setattr(module, key, value)
    sys.modules[name] = module
    return module


class Fields:
    """A request record: the fields it was built with; None for any other."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class _RequestTypes(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        kind = type(name, (Fields,), {})
        setattr(self, name, kind)
        return kind


# sglang/__init__ patches transformers' config classes, which are stand-ins here.
lenient("sglang.srt.utils.hf_transformers_patches", apply_all=lambda: None)
import sglang  # noqa: E402

_SGLANG = os.path.dirname(sglang.__file__)
lenient("sglang.srt.configs", path=os.path.join(_SGLANG, "srt", "configs"))
sys.modules["sglang.srt.managers.io_struct"] = _RequestTypes("sglang.srt.managers.io_struct")
