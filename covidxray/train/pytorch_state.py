"""Read a PyTorch state dict saved in PyTorch's legacy (non-zip) format, without torch and without running its code.

A `.pth` file is a pickle, and unpickling can call any function the file names:
`torch.load` of a stranger's file is running a stranger's program. This reader
lets the pickle name only the three things a state dict is made of (an
OrderedDict, torch's tensor-rebuild function and a storage type) and refuses
every other global, so a file from a package index can be read on a training
board without trusting it (the file's sha256 is checked before, in weights.py).

The legacy layout (torch/serialization.py `_legacy_save`), one after the other:
  pickle: the magic number 0x1950a86a20f9469cfc6c
  pickle: the protocol version, 1001
  pickle: system info (byte order, C type sizes)
  pickle: the state dict; each tensor is `_rebuild_tensor_v2(storage, offset, size, stride, ...)` whose storage
          is a persistent id ("storage", storage type, key, device, element count, view or None)
  pickle: the list of storage keys in the order their bytes follow
  per key: the element count as int64, then the raw elements.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from covidxray.errors import UserError

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001
STORAGE_DTYPES = {
    "FloatStorage": np.dtype("<f4"),
    "DoubleStorage": np.dtype("<f8"),
    "HalfStorage": np.dtype("<f2"),
    "LongStorage": np.dtype("<i8"),
    "IntStorage": np.dtype("<i4"),
    "ShortStorage": np.dtype("<i2"),
    "CharStorage": np.dtype("i1"),
    "ByteStorage": np.dtype("u1"),
    "BoolStorage": np.dtype("?"),
}


class UnsafeCheckpoint(UserError):
    """The file is not a plain legacy state dict: it names code to run, or its layout is not PyTorch's."""


@dataclass(frozen=True)
class _StorageType:
    name: str


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: np.dtype
    offset: int  # in elements: a view into a larger storage starts here


@dataclass(frozen=True)
class _TensorRef:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """Stands in for torch._utils._rebuild_tensor_v2: remembers where the tensor's elements are, builds nothing."""
    if not isinstance(storage, _Storage):
        raise UnsafeCheckpoint("a tensor whose storage is not a storage reference")
    return _TensorRef(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


_ALLOWED = {
    ("collections", "OrderedDict"): OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    **{("torch", name): _StorageType(name) for name in STORAGE_DTYPES},
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that resolves only the globals of a state dict; every other global is refused before it is called."""

    def __init__(self, handle, path: Path, storages: dict[str, tuple[np.dtype, int]]):
        super().__init__(handle)
        self.path, self.storages = path, storages

    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeCheckpoint(
                f"{self.path}: refers to {module}.{name}, which a PyTorch state dict never needs; refusing to read it "
                "(the file may run code when loaded with torch.load)"
            ) from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage"):
            raise UnsafeCheckpoint(f"{self.path}: unexpected persistent id {pid!r:.80}")
        _, storage_type, key, _device, numel, view = pid
        if not isinstance(storage_type, _StorageType) or not isinstance(key, str) or not isinstance(numel, int):
            raise UnsafeCheckpoint(f"{self.path}: malformed storage reference {pid!r:.80}")
        dtype = STORAGE_DTYPES[storage_type.name]
        known = self.storages.setdefault(key, (dtype, numel))
        if known != (dtype, numel):
            raise UnsafeCheckpoint(f"{self.path}: storage {key} is declared twice with different types or sizes")
        if view is None:
            return _Storage(key, dtype, 0)
        _view_key, view_offset, _view_size = view
        return _Storage(key, dtype, int(view_offset))


def _load_pickle(handle, path: Path, storages: dict) -> object:
    try:
        return _RestrictedUnpickler(handle, path, storages).load()
    except UnsafeCheckpoint:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise UnsafeCheckpoint(f"{path}: not a legacy PyTorch state dict ({type(err).__name__}: {err})") from None


def _read_storages(handle, path: Path, keys: list, storages: dict) -> dict[str, np.ndarray]:
    arrays = {}
    for key in keys:
        if key not in storages:
            raise UnsafeCheckpoint(f"{path}: storage {key!r} has bytes but no tensor refers to it")
        dtype, numel = storages[key]
        count_bytes = handle.read(8)
        if len(count_bytes) != 8 or int.from_bytes(count_bytes, "little", signed=True) != numel:
            raise UnsafeCheckpoint(f"{path}: storage {key} should hold {numel} elements; the file is damaged")
        data = handle.read(numel * dtype.itemsize)
        if len(data) != numel * dtype.itemsize:
            raise UnsafeCheckpoint(f"{path}: storage {key} is cut short; the file is truncated")
        arrays[key] = np.frombuffer(data, dtype=dtype)
    return arrays


def _tensor(ref: _TensorRef, arrays: dict[str, np.ndarray], path: Path, name: str) -> np.ndarray:
    flat = arrays.get(ref.storage.key)
    if flat is None:
        raise UnsafeCheckpoint(f"{path}: tensor {name} refers to storage {ref.storage.key}, which the file lacks")
    start = ref.storage.offset + ref.offset
    if len(ref.size) != len(ref.stride) or start < 0 or any(s < 0 for s in ref.size + ref.stride):
        raise UnsafeCheckpoint(f"{path}: tensor {name} has an impossible shape or stride")
    if 0 in ref.size:
        return np.zeros(ref.size, flat.dtype)
    last = start + sum((s - 1) * st for s, st in zip(ref.size, ref.stride))
    if last >= flat.size:
        raise UnsafeCheckpoint(f"{path}: tensor {name} reaches past the end of its storage")
    strides = tuple(st * flat.dtype.itemsize for st in ref.stride)
    view = np.lib.stride_tricks.as_strided(flat[start:], shape=ref.size, strides=strides, writeable=False)
    return np.array(view, dtype=flat.dtype.newbyteorder("="))  # a native-order copy that owns its memory


def read_state_dict(path: Path | str) -> dict[str, np.ndarray]:
    """The tensors of a legacy PyTorch state dict, by name, as numpy arrays (shapes and strides as saved)."""
    path = Path(path)
    storages: dict[str, tuple[np.dtype, int]] = {}
    with open(path, "rb") as handle:
        if _load_pickle(handle, path, storages) != MAGIC_NUMBER:
            raise UnsafeCheckpoint(f"{path}: not a legacy PyTorch file (no magic number; a zip-format .pth?)")
        if _load_pickle(handle, path, storages) != PROTOCOL_VERSION:
            raise UnsafeCheckpoint(f"{path}: unknown PyTorch legacy protocol version")
        info = _load_pickle(handle, path, storages)
        if not isinstance(info, dict) or info.get("little_endian") is not True:
            raise UnsafeCheckpoint(f"{path}: saved on a big-endian machine or without system info; not supported")
        state = _load_pickle(handle, path, storages)
        keys = _load_pickle(handle, path, storages)
        if not isinstance(state, dict) or not isinstance(keys, list):
            raise UnsafeCheckpoint(f"{path}: does not hold a state dict (a mapping of names to tensors)")
        arrays = _read_storages(handle, path, keys, storages)
    tensors = {}
    for name, value in state.items():
        if not isinstance(value, _TensorRef):
            raise UnsafeCheckpoint(f"{path}: entry {name!r} is not a tensor")
        tensors[str(name)] = _tensor(value, arrays, path, str(name))
    return tensors
