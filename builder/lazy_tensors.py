"""LazyTensors: a graph's weight tensors by name, each made when read and never kept, so a build streams.

A build reads every weight from the model source once per rank file it writes: the sharding passes
record how a rank's tensor derives from a source tensor (a slice of rows, a concatenation) and the
emitter materialises one tensor at a time, writes it, and lets it go. Peak memory is then about the
largest tensor, not the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping

import torch

Loader = Callable[[], torch.Tensor]


class LazyTensors(MutableMapping):
    def __init__(self, loaders: Mapping[str, Loader] | None = None):
        self._loaders: dict[str, Loader] = dict(loaders or {})

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> LazyTensors:
        """A lazy copy of `tensors` (a plain dict's tensors are held as they are)."""
        if isinstance(tensors, LazyTensors):
            return tensors.copy()
        return cls({name: _constant(t) for name, t in tensors.items()})

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._loaders[name]()

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._loaders[name] = _constant(tensor)

    def __delitem__(self, name: str) -> None:
        del self._loaders[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)

    def __contains__(self, name: object) -> bool:
        return name in self._loaders

    def pop(self, name: str, *default):
        """Forget `name` without loading it (MutableMapping.pop would load it to return it)."""
        if name not in self._loaders and default:
            return default[0]
        self._loaders.pop(name)
        return None

    def derive(self, name: str, sources: list[str], fn: Callable[..., torch.Tensor]) -> None:
        """`name` becomes fn(*source tensors), computed each time it is read."""
        loaders = [self._loaders[s] for s in sources]
        self._loaders[name] = lambda: fn(*(load() for load in loaders))

    def copy(self) -> LazyTensors:
        return LazyTensors(self._loaders)

    __copy__ = copy


def _constant(tensor: torch.Tensor) -> Loader:
    return lambda: tensor
