"""fastcache as vLLM's KV offloading backend (docs/design.md §10). The only package that imports vLLM.

vLLM loads `FastcacheOffloadingSpec` and `FastcacheConnector` from here by name; they are imported on first
use, so that the parts that do not need vLLM (options, keys) import without it.
"""
__all__ = ["FastcacheConnector", "FastcacheOffloadingSpec"]


def __getattr__(name):
    if name in __all__:
        from . import spec
        return getattr(spec, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
