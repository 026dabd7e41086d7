"""Imports SGLang's PD code on a machine that lacks most of SGLang's dependencies.

The conformance suite and the user check run SGLang's real disaggregation
code (its KV managers, senders, receivers and the scheduler's prefill and
decode passes) on CPU. That code sits inside a package that imports GPU
kernels, tokenizers and the OpenAI protocol layer at module level, none of
which the PD path calls. ``load`` imports what was asked for and, each time
the import stops on something the machine cannot give, puts the least thing
in its place and tries again:

* a module that is missing (or, like pydantic 1 where SGLang needs 2, too
  old to give a name SGLang imports) becomes a placeholder module whose every
  attribute is an inert ``Placeholder``;
* an attribute a present library lacks at import time (torch 1.13 has no
  fp8 dtypes, no ``torch.compiler``) becomes a placeholder attribute.

Nothing of SGLang's own is replaced: a failure inside ``sglang`` that is not
one of those two is raised, so a test never runs on a silently patched
SGLang. Which releases this works on is found by running it, not listed.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import re
import sys
import types


# Where SGLang's own code lives; everything else may be stood in for.
_OWN = ("sglang",)
# SGLang's own compute kernels (attention, quantization, MoE, JIT), which
# locate compiled sources or pick a GPU at import time: a module of theirs
# whose import fails is stood in for, like sgl_kernel, because no kernel runs
# on the PD path. The PD path's own helpers (dp_attention, the scheduler's
# modules) are never among them.
_KERNELS = ("sglang.kernels.", "sglang.jit_kernel.", "sglang.srt.layers.attention.", "sglang.srt.layers.quantization.",
            "sglang.srt.layers.moe.")

# Each stand-in is one retry; the newest release needs a few dozen. A loop
# that hits this is standing in for the same thing again: a bug, not a machine.
_MAX_RETRIES = 400


class Placeholder:
    """An inert stand-in: callable, subscriptable, a base class, a decorator, a context manager."""

    def __init__(self, *args, **kwargs):
        self.__dict__["_name"] = kwargs.pop("_placeholder_name", "placeholder")

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a bare decorator
        return Placeholder(_placeholder_name=self._name + "()")

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Placeholder(_placeholder_name=f"{self._name}.{name}")

    def __getitem__(self, key):
        return Placeholder(_placeholder_name=f"{self._name}[]")

    def __setitem__(self, key, value):
        pass

    def __mro_entries__(self, bases):
        return (_placeholder_class(self._name),)

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __bool__(self):
        return False

    def __int__(self):
        return 0

    def __index__(self):
        return 0

    def __float__(self):
        return 0.0

    def __or__(self, other):
        return self

    __ror__ = __or__

    def __add__(self, other):
        return other  # an empty part: "op" + placeholder_schema is "op"

    __radd__ = __add__

    def __str__(self):
        return ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __repr__(self):
        return f"<placeholder {self._name}>"

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other


_classes = {}


class _PlaceholderMeta(type):
    """Class-level attributes and indexing of placeholder classes (``CONFIG_MAPPING._extra_content[...]``)."""

    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Placeholder(_placeholder_name=f"{cls.__name__}.{name}")

    def __getitem__(cls, key):
        return cls

    def __setitem__(cls, key, value):
        pass

    def __iter__(cls):
        return iter(())

    def __contains__(cls, item):
        return False


def _placeholder_class(name):
    """A real class to derive from, for ``class X(placeholder.Base)``."""
    if name not in _classes:

        def init(self, *args, **kwargs):
            for key, value in kwargs.items():
                try:
                    setattr(self, key, value)
                except Exception:
                    pass

        _classes[name] = _PlaceholderMeta(name.rsplit(".", 1)[-1] or "Placeholder", (), {
            "__init__": init,
            "__init_subclass__": classmethod(lambda cls, **kw: None),
            "__getattr__": lambda self, attr: Placeholder(_placeholder_name=f"{name}.{attr}"),
        })
    return _classes[name]


class PlaceholderModule(types.ModuleType):
    """A module whose every attribute is a placeholder; submodules resolve to more of them."""

    def __init__(self, name):
        super().__init__(name)
        self.__path__ = []
        self.__file__ = f"<placeholder {name}>"
        self.__sglang_watchdog_placeholder__ = True

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if f"{self.__name__}.{name}" in _AS_ON_CPU:
            return importlib.import_module(f"{self.__name__}.{name}")
        value = _placeholder_class(f"{self.__name__}.{name}") if name[:1].isupper() else Placeholder(
            _placeholder_name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the placeholder modules (and all their submodules) that ``load`` decided on."""

    def __init__(self):
        self.roots = set()

    def find_spec(self, fullname, path=None, target=None):
        if any(fullname == r or fullname.startswith(r + ".") for r in self.roots):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = PlaceholderModule(spec.name)
        _AS_ON_CPU.get(spec.name, lambda m: None)(module)
        return module

    def exec_module(self, module):
        pass


class _NoActiveDriver:
    @property
    def active(self):
        # What triton itself raises on a machine with no GPU; SGLang's callers fall back to CPU on it.
        raise RuntimeError("0 active drivers ([]). There should only be one.")


# Placeholder modules that must behave like the real library on a GPU-less machine.
_AS_ON_CPU = {
    "triton.runtime": lambda m: setattr(m, "driver", _NoActiveDriver()),
    "triton.runtime.driver": lambda m: setattr(m, "active", property(lambda self: _NoActiveDriver().active)),
}

_finder = _PlaceholderFinder()


class Loaded:
    """What ``load`` had to stand in for, for the report."""

    def __init__(self):
        self.placeholders = set()
        self.attributes = set()
        self.source = None
        self.version = None


loaded = Loaded()


def _failing_kernel_module(error):
    """The innermost SGLang kernel module whose import raised ``error``, or None."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == "<module>" and name.startswith(_KERNELS):
            found = name
        tb = tb.tb_next
    return found


def placeholder(name):
    """Serve ``name`` and its submodules as placeholders from now on.

    A missing submodule of a library that is there (``torch.utils._contextlib``
    under torch 1.13) is stood in for alone; the library stays real.
    """
    if _is_own(name) and not name.startswith(_KERNELS):
        raise ValueError(f"refusing to stand in for SGLang's own module {name}")
    root = name.split(".", 1)[0]
    if name != root and importlib.util.find_spec(root) is None:
        name = root
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    _finder.roots.add(name)
    loaded.placeholders.add(name)
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]
    parent, _, child = name.rpartition(".")
    if parent in sys.modules:
        module = importlib.import_module(name)
        setattr(sys.modules[parent], child, module)


def install_module(name, module):
    """Puts a module the harness built (a fake transport) in place of ``name``."""
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, module)


def use_source(src=None):
    """Makes ``sglang`` importable without running its ``__init__`` (the frontend DSL pulls transformers).

    ``src`` is a folder holding ``python/sglang`` or ``sglang``, or None for
    the installed package. Returns the package folder.
    """
    src = src or os.environ.get("SGLANG_SRC") or None
    if src:
        for candidate in (os.path.join(src, "python", "sglang"), os.path.join(src, "sglang"), src):
            if os.path.isfile(os.path.join(candidate, "srt", "disaggregation", "prefill.py")):
                folder = os.path.abspath(candidate)
                break
        else:
            raise FileNotFoundError(f"SGLANG_SRC={src}: no sglang/srt/disaggregation/prefill.py below it")
    else:
        spec = importlib.util.find_spec("sglang")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("no sglang package is installed and SGLANG_SRC is not set")
        folder = list(spec.submodule_search_locations)[0]
    package = sys.modules.get("sglang")
    if package is not None and list(getattr(package, "__path__", [])) == [folder]:
        return folder
    version = _version(folder)  # before the bare package hides the installed one's spec
    package = types.ModuleType("sglang")
    package.__path__ = [folder]
    package.__file__ = os.path.join(folder, "__init__.py")
    package.__spec__ = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    package.__spec__.submodule_search_locations = [folder]
    sys.modules["sglang"] = package
    loaded.source = folder
    loaded.version = version
    return folder


def _version(folder):
    """The release's version: its generated ``_version.py``, a plain ``__version__`` in ``version.py``, or pip's record.

    A source tree of a release built with setuptools-scm has no
    ``_version.py``, and its ``version.py`` falls back to "0.0.0.dev0": None
    then, rather than a version that is not the release's.
    """
    import ast

    try:
        with open(os.path.join(folder, "_version.py")) as f:
            match = re.search(r"^(?:__version__|version)\s*(?::\s*str)?\s*=\s*['\"]([^'\"]+)", f.read(), re.M)
            if match:
                return match.group(1)
    except OSError:
        pass
    try:
        with open(os.path.join(folder, "version.py")) as f:
            tree = ast.parse(f.read())
        for node in tree.body:  # module level only: not a fallback inside try/except
            if (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets)
                    and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
                return node.value.value
    except (OSError, SyntaxError, ValueError):
        pass
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations and os.path.abspath(
            list(spec.submodule_search_locations)[0]) == os.path.abspath(folder):
        try:
            from importlib.metadata import version

            return version("sglang")
        except Exception:
            return None
    return None


def _is_own(name):
    return bool(name) and name.split(".", 1)[0] in _OWN


def _third_party(name):
    root = (name or "").split(".", 1)[0]
    return bool(root) and root not in _OWN and root not in sys.stdlib_module_names


def _stand_in_attribute(module, attr):
    """A placeholder, or for a dtype an older torch lacks, the nearest dtype it has.

    SGLang computes with these at import time (``torch.finfo(torch.float8_e4m3fn)``),
    and on CPU nothing on the PD path stores data in them.
    """
    if module.__name__ == "torch":
        match = re.fullmatch(r"(u?)(int|float)(\d+)(?:_\w+)?", attr)
        if match:
            unsigned, kind, bits = match.groups()
            bits = max(int(bits), 16 if kind == "float" else 8)
            for candidate in (f"{kind}{bits}", f"{kind}64"):
                if kind == "int" and unsigned and bits == 8:
                    candidate = "uint8"
                dtype = getattr(module, candidate, None)
                if dtype is not None:
                    return dtype
    return Placeholder(_placeholder_name=f"{module.__name__}.{attr}")


def _shim_torch():
    """What torch 1.13 (Debian 12) lacks in a form a missing attribute cannot stand in for."""
    try:
        import torch
        import torch.library
    except ImportError:
        return
    _shim_reduce_op()
    _shim_contextlib()
    library = torch.library.Library
    if getattr(library, "__sglang_watchdog_shim__", False):
        return
    try:
        library("sglang_watchdog_probe", "FRAGMENT")
        return
    except ValueError:
        pass
    except Exception:
        return

    class FragmentLibrary(library):
        """Accepts "FRAGMENT" (torch >= 2.1): SGLang registers its custom ops through one; none run on CPU here."""

        __sglang_watchdog_shim__ = True

        def __init__(self, ns, kind, *args, **kwargs):
            self.fragment = kind == "FRAGMENT"
            if not self.fragment:
                super().__init__(ns, kind, *args, **kwargs)
            else:
                self.ns, self.kind = ns, kind

        def define(self, *args, **kwargs):
            return None if self.fragment else super().define(*args, **kwargs)

        def impl(self, *args, **kwargs):
            return None if self.fragment else super().impl(*args, **kwargs)

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *args, **kwargs: None  # _register_fake and later registration calls

        def __del__(self):
            if not getattr(self, "fragment", True):
                super().__del__()

    torch.library.Library = FragmentLibrary
    loaded.attributes.add("torch.library.Library(FRAGMENT)")


def _shim_contextlib():
    """``torch.utils._contextlib`` (torch >= 2.0) holds what torch 1.13 keeps in autograd.grad_mode."""
    try:
        import torch.utils._contextlib  # noqa: F401
        return
    except ImportError:
        pass
    try:
        from torch.autograd import grad_mode
    except ImportError:
        return
    module = types.ModuleType("torch.utils._contextlib")
    module._DecoratorContextManager = grad_mode._DecoratorContextManager
    install_module("torch.utils._contextlib", module)
    loaded.attributes.add("torch.utils._contextlib")


def _shim_reduce_op():
    """``int(ReduceOp.SUM)`` (torch >= 2), which SGLang's parallel_state evaluates at import."""
    try:
        from torch.distributed import ReduceOp

        int(ReduceOp.SUM)
        return
    except TypeError:
        pass
    except Exception:
        return
    members = ReduceOp.RedOpType.__members__

    def as_int(op):
        for member in members.values():
            if op == member:
                return int(member)
        raise TypeError(f"unknown ReduceOp {op!r}")

    ReduceOp.__int__ = as_int
    loaded.attributes.add("torch.distributed.ReduceOp.__int__")


def load(*modules):
    """Imports SGLang modules, standing in for what the machine lacks; returns them in order."""
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    os.environ.setdefault("SGLANG_HOST_IP", "127.0.0.1")
    _shim_torch()
    _pin_loopback()
    return [_import(name) for name in modules]


def _pin_loopback():
    """SGLang finds its own address by the route to a public one (``get_local_ip_by_remote``) wherever
    SGLANG_HOST_IP is not read (Mooncake and the common bootstrap before v0.5): on a machine with an
    interface that is the interface's address. Every socket of the suite stays on 127.0.0.1."""
    name = "sglang.srt.utils.get_local_ip_by_remote"
    if name in loaded.attributes:
        return
    _import("sglang.srt.utils")  # the package imports the module defining it (utils/network.py, utils/common.py)
    for module in [m for n, m in list(sys.modules.items()) if n == "sglang.srt.utils" or n.startswith("sglang.srt.utils.")]:
        if hasattr(module, "get_local_ip_by_remote"):
            module.get_local_ip_by_remote = _loopback
    loaded.attributes.add(name)


def _loopback():
    return "127.0.0.1"


def _import(name):
    for _ in range(_MAX_RETRIES):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if not _third_party(missing):
                raise
            placeholder(missing)
        except ImportError as e:
            # "cannot import name X from Y": Y is there but not the one SGLang was written for.
            owner = getattr(e, "name", None)
            if not _third_party(owner) or owner in _finder.roots:
                raise
            placeholder(owner)
        except AttributeError as e:
            obj = getattr(e, "obj", None)
            attr = getattr(e, "name", None)
            if not isinstance(obj, types.ModuleType) or not _third_party(obj.__name__) or not attr:
                kernel = _failing_kernel_module(e)
                if kernel is None or kernel in _finder.roots:
                    raise
                placeholder(kernel)
                continue
            setattr(obj, attr, _stand_in_attribute(obj, attr))
            loaded.attributes.add(f"{obj.__name__}.{attr}")
        except Exception as e:
            kernel = _failing_kernel_module(e)
            if kernel is None or kernel in _finder.roots:
                raise
            placeholder(kernel)
    raise ImportError(f"gave up importing {name} after {_MAX_RETRIES} stand-ins")
