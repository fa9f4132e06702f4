#include "convert.h"

#include <array>
#include <memory>

#include "pagedattn/dlpack.h"

namespace pagedattn::py {

using detail::cat;
using detail::require;

namespace {

namespace dl = nb::dlpack;

// DLPack 1.x type codes of the fp8 types pagedattn has (nanobind 2 has no names for them).
constexpr uint8_t kDLFloat8E4M3FN = 10;
constexpr uint8_t kDLFloat8E5M2 = 12;

template <class A>
TensorView view_of(const A& a, std::string_view name) {
  require(a.is_valid(), name, " is not an array");
  dl::dtype dt = a.dtype();
  // DLPack 1.x codes for the two fp8 types pagedattn has; from_dlpack (DLPack 0.6) reads bytes.
  std::optional<DType> fp8;
  if (dt.bits == 8 && dt.lanes == 1) {
    if (dt.code == kDLFloat8E4M3FN) fp8 = DType::kFp8E4M3;
    if (dt.code == kDLFloat8E5M2) fp8 = DType::kFp8E5M2;
    if (fp8) dt.code = uint8_t(dl::dtype_code::UInt);
  }
  require(dt.code != uint8_t(dl::dtype_code::Bool), name,
          ": bool arrays are not supported; supported: float 16/32/64, bfloat 16, int 32/64, "
          "uint 8, float8_e4m3fn, float8_e5m2");
  DLTensor t{};
  // data() has the producer's byte_offset folded in (every nanobind version).
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.device = DLDevice{static_cast<DLDeviceType>(a.device_type()), a.device_id()};
  t.ndim = int(a.ndim());
  t.dtype = DLDataType{dt.code, dt.bits, dt.lanes};
  t.shape = const_cast<int64_t*>(a.shape_ptr());
  t.strides = const_cast<int64_t*>(a.stride_ptr());
  t.byte_offset = 0;
  TensorView v;
  try {
    v = from_dlpack(t);
  } catch (const InvalidArgument& e) {
    throw InvalidArgument(cat(name, ": ", e.what()));
  }
  if (fp8) v.dtype = *fp8;
  return v;
}

template <class A>
bool try_array(nb::handle obj, A& out) {
  return nb::try_cast(obj, out, /*convert=*/false) && out.is_valid();
}

// Owner of exported memory: a copy of the tensor (shared storage).
nb::capsule tensor_owner(const Tensor& t) {
  return nb::capsule(new Tensor(t), [](void* p) noexcept { delete static_cast<Tensor*>(p); });
}

}  // namespace

TensorView to_view(const InArray& a, std::string_view name) {
  return view_of(a, name);
}
TensorView to_view(const OutArray& a, std::string_view name) {
  return view_of(a, name);
}
TensorView to_view(const std::optional<InArray>& a, std::string_view name) {
  return a ? view_of(*a, name) : TensorView{};
}
TensorView to_view(const std::optional<OutArray>& a, std::string_view name) {
  return a ? view_of(*a, name) : TensorView{};
}

TensorView to_view(nb::handle obj, std::string_view name, bool writable) {
  if (obj.is_none()) return {};
  if (writable) {
    OutArray a;
    if (try_array(obj, a)) return view_of(a, name);
  } else {
    InArray a;
    if (try_array(obj, a)) return view_of(a, name);
  }
  // torch refuses to export tensors that require grad: say so instead of "not an array".
  require(!(nb::hasattr(obj, "requires_grad") && nb::hasattr(obj, "detach") &&
            nb::cast<bool>(obj.attr("requires_grad"))),
          name, " requires grad; pass tensor.detach() (pagedattn has no autograd)");
  detail::fail(name, " must be ", writable ? "a writable array" : "an array",
               " (numpy, torch or any DLPack producer); got an object of type ",
               nb::type_name(obj.type()).c_str());
}

TensorView as_heads(const TensorView& v, std::string_view name, int heads, int head_size) {
  if (!v.defined() || v.ndim == 3) return v;
  require(v.ndim == 2 && v.size(1) == int64_t(heads) * head_size, name, " must be [num_tokens, ",
          heads, "*", head_size, "] or [num_tokens, ", heads, ", ", head_size, "]; got ",
          describe(v));
  require(v.size(0) == 0 || v.stride(1) == 1, name,
          " must be contiguous in its last dimension; its stride there is ", v.stride(1));
  TensorView out = v;
  out.ndim = 3;
  out.shape = {v.size(0), heads, head_size, 0, 0, 0};
  out.strides = {v.stride(0), head_size, 1, 0, 0, 0};
  return out;
}

KVCacheView to_cache_view(nb::handle cache, std::string_view name, std::optional<DType> fp8_dtype) {
  KVCacheView view;
  InArray combined;
  if (nb::isinstance<nb::tuple>(cache) || nb::isinstance<nb::list>(cache)) {
    const nb::sequence pair = nb::borrow<nb::sequence>(cache);
    require(nb::len(pair) == 2, name, " must be one [num_blocks, 2, block_size, num_kv_heads, ",
            "head_size] array or a (key_cache, value_cache) pair; got a sequence of ",
            nb::len(pair), " items");
    InArray k, v;
    require(try_array(pair[0], k), name, "[0] (key_cache) is not an array");
    require(try_array(pair[1], v), name, "[1] (value_cache) is not an array");
    view.key = view_of(k, cat(name, ".key"));
    view.value = view_of(v, cat(name, ".value"));
    require(view.key.ndim == 4 && view.value.ndim == 4, name,
            " key and value caches must be [num_blocks, block_size, num_kv_heads, head_size]; "
            "got ",
            describe(view.key), " and ", describe(view.value));
  } else if (try_array(cache, combined)) {
    view = KVCacheView::from_combined(view_of(combined, name));
  } else {
    detail::fail(name, " must be one [num_blocks, 2, block_size, num_kv_heads, head_size] array ",
                 "or a (key_cache, value_cache) pair of arrays; got an object of type ",
                 nb::type_name(cache.type()).c_str());
  }
  if (fp8_dtype && is_fp8(*fp8_dtype) && view.key.dtype == DType::kU8 &&
      view.value.dtype == DType::kU8) {
    view.key.dtype = view.value.dtype = *fp8_dtype;  // vLLM keeps fp8 caches as bytes
  }
  return view;
}

Device parse_device(nb::handle device) {
  const std::string s = nb::str(device).c_str();
  if (s == "cpu") return Device::cpu();
  if (s == "cuda") return Device::cuda(0);
  if (s.rfind("cuda:", 0) == 0 && s.size() > 5 &&
      s.find_first_not_of("0123456789", 5) == std::string::npos) {
    return Device::cuda(std::stoi(s.substr(5)));
  }
  detail::fail("device '", s, "' is not one of 'cpu', 'cuda', 'cuda:N'");
}

DType parse_dtype(nb::handle dtype) {
  std::string s = nb::str(dtype).c_str();
  if (s.rfind("torch.", 0) == 0) s = s.substr(6);
  if (const auto d = dtype_from_name(s)) return *d;
  detail::fail("dtype '", s,
               "' is not one of float32, float16, bfloat16, float64, float8_e4m3fn, float8_e5m2, "
               "int32, int64, uint8");
}

nb::object export_view(const TensorView& v, nb::handle owner) {
  require(v.defined(), "cannot export an undefined tensor");
  const DLDataType dl = to_dlpack_dtype(v.dtype);
  const dl::dtype dt{dl.code, dl.bits, dl.lanes};
  std::array<size_t, kMaxDims> shape{};
  for (int d = 0; d < v.ndim; ++d) shape[size_t(d)] = size_t(v.size(d));
  const int dev = v.device.is_cpu() ? nb::device::cpu::value : nb::device::cuda::value;
  if (v.device.is_cpu() && v.dtype != DType::kBF16) {
    return nb::ndarray<nb::numpy>(v.data, size_t(v.ndim), shape.data(), owner, v.strides.data(), dt,
                                  dev, v.device.index)
        .cast();
  }
#if NB_VERSION_MAJOR >= 3
  // nanobind's own array type: __dlpack__ / __dlpack_device__, so any framework can import it.
  using Framework = nb::array_api;
#else
  using Framework = nb::pytorch;  // nanobind 2 has no array type of its own: torch tensors
#endif
  return nb::ndarray<Framework>(v.data, size_t(v.ndim), shape.data(), owner, v.strides.data(), dt,
                                dev, v.device.index)
      .cast();
}

nb::object export_tensor(const Tensor& t) {
  require(t.defined(), "cannot export an undefined tensor");
  return export_view(t.view(), tensor_owner(t));
}

void register_exceptions(nb::module_& m) {
  // Classes with two bases (the library's own and the builtin one), so that callers can catch
  // either pagedattn.Error or the builtin category.
  static PyObject* error = nullptr;
  static PyObject* invalid = nullptr;
  static PyObject* format = nullptr;
  static PyObject* unsupported = nullptr;
  error = PyErr_NewExceptionWithDoc("pagedattn.Error",
                                    "Base of every error pagedattn raises (a RuntimeError).",
                                    PyExc_RuntimeError, nullptr);
  auto make = [&](const char* name, const char* doc, PyObject* builtin) {
    nb::object bases = nb::make_tuple(nb::handle(error), nb::handle(builtin));
    return PyErr_NewExceptionWithDoc(name, doc, bases.ptr(), nullptr);
  };
  invalid = make("pagedattn.InvalidArgument",
                 "An argument, configuration field or metadata value outside what the API "
                 "accepts (a ValueError).",
                 PyExc_ValueError);
  format = make("pagedattn.FormatError",
                "A malformed file: safetensors or case file (a ValueError).", PyExc_ValueError);
  unsupported = make("pagedattn.NotSupported",
                     "A valid request that the selected backend or this build cannot serve (a "
                     "NotImplementedError).",
                     PyExc_NotImplementedError);
  if (!error || !invalid || !format || !unsupported) throw nb::python_error();
  m.attr("Error") = nb::handle(error);
  m.attr("InvalidArgument") = nb::handle(invalid);
  m.attr("FormatError") = nb::handle(format);
  m.attr("NotSupported") = nb::handle(unsupported);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const FormatError& e) {
      PyErr_SetString(format, e.what());
    } catch (const InvalidArgument& e) {
      PyErr_SetString(invalid, e.what());
    } catch (const NotSupported& e) {
      PyErr_SetString(unsupported, e.what());
    } catch (const Error& e) {
      PyErr_SetString(error, e.what());
    }
  });
}

}  // namespace pagedattn::py
