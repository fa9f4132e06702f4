"""A minimal DLPack producer in pure Python (ctypes): "any other DLPack producer" for the tests,
and a way to present host memory as if it lived on a CUDA device (to test device checks on
machines without one; the library must refuse it before touching the memory)."""

from __future__ import annotations

import ctypes

import numpy as np

KDL_CPU, KDL_CUDA = 1, 2
_CODES = {"i": 0, "u": 1, "f": 2}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [
    ("dl_tensor", _DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", _DELETER),
]

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


@_DELETER
def _no_op_deleter(_):  # the Producer object owns everything
    return None


class Producer:
    """Exports a numpy array's memory through ``__dlpack__`` (unversioned capsules), claiming
    ``device_type`` (1 = CPU, 2 = CUDA). Keep the producer alive while the consumer uses it."""

    def __init__(self, array: np.ndarray, device_type: int = KDL_CPU, device_id: int = 0,
                 code: int = -1, bits: int = -1):
        self.array = array
        self.device = (device_type, device_id)
        self._shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        self._strides = (ctypes.c_int64 * array.ndim)(
            *[s // array.itemsize for s in array.strides])
        self._managed = _DLManagedTensor()
        t = self._managed.dl_tensor
        t.data = array.ctypes.data
        t.device = _DLDevice(device_type, device_id)
        t.ndim = array.ndim
        t.dtype = _DLDataType(_CODES[array.dtype.kind] if code < 0 else code,
                              array.itemsize * 8 if bits < 0 else bits, 1)
        t.shape = self._shape
        t.strides = self._strides
        t.byte_offset = 0
        self._managed.deleter = _no_op_deleter

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return _capsule_new(ctypes.addressof(self._managed), b"dltensor", None)

    def __dlpack_device__(self):
        return self.device
