"""LazyTensors: a graph's weight tensors by name, each made when read and never kept, so a build streams.

A build reads every weight from the model source once per rank file it writes: the sharding passes
record how a rank's tensor derives from a source tensor (a slice of rows, a concatenation) and the
emitter materialises one tensor at a time, writes it, and lets it go. Peak memory is then about the
largest tensor, not the model. A round-to-nearest quantizer's outputs are derived too (derive_parts): computed
again when read, so a quantized build holds neither the float model nor its quantized copy.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
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

    def bind(self, name: str, loader: Loader) -> None:
        """`name` becomes loader(), called each time it is read."""
        self._loaders[name] = loader

    def derive(self, name: str, sources: list[str], fn: Callable[..., torch.Tensor]) -> None:
        """`name` becomes fn(*source tensors), computed each time it is read."""
        loaders = [self._loaders[s] for s in sources]
        self._loaders[name] = lambda: fn(*(load() for load in loaders))

    def derive_parts(self, names: dict[str, str], sources: list[str],
                     fn: Callable[..., dict[str, torch.Tensor]], memo: PartsMemo) -> None:
        """Each name of `names` (part -> name) becomes that part of fn(*source tensors): computed when read, once for
        all its parts while `memo` keeps the result (a quantizer's codes, scales and zeros read one after another)."""
        loaders = [self._loaders[s] for s in sources]
        key = tuple(sources)

        def parts() -> dict[str, torch.Tensor]:
            made = memo.get(key)
            if made is None:
                made = fn(*(load() for load in loaders))
                memo.put(key, made)
            return made

        for part, name in names.items():
            self._loaders[name] = lambda part=part: parts()[part]

    def reads_as(self, name: str, other: LazyTensors, other_name: str | None = None) -> bool:
        """Whether `name` here and `other_name` (default `name`) in `other` are read by the same call (the same
        source weight, untouched by any pass), so their tensors are equal without reading either."""
        a, b = self._loaders.get(name), other._loaders.get(other_name or name)
        if a is None or b is None:
            return False
        if a is b:
            return True
        return (isinstance(a, functools.partial) and isinstance(b, functools.partial) and a.func == b.func
                and a.args == b.args and a.keywords == b.keywords)

    def copy(self) -> LazyTensors:
        return LazyTensors(self._loaders)

    __copy__ = copy


def _constant(tensor: torch.Tensor) -> Loader:
    return lambda: tensor


class PartsMemo:
    """The last few results of derive_parts functions, by their sources (least recently used dropped first)."""

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._items: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()

    def get(self, key: tuple) -> dict[str, torch.Tensor] | None:
        made = self._items.get(key)
        if made is not None:
            self._items.move_to_end(key)
        return made

    def put(self, key: tuple, made: dict[str, torch.Tensor]) -> None:
        self._items[key] = made
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
