"""Backend options from Python: listing them, configure_backend, its errors, and runs under a
changed option checked against the float64 reference (CI: the cpu backend; the cuda routes on a
GPU machine)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest

import pagedattn as pa
from conftest import HAS_CUDA

needs_cpu_backend = pytest.mark.skipif(not pa.with_cpu_backend, reason="no cpu backend built")


def _options(name: str) -> dict[str, pa.BackendOptionInfo]:
    return {o.name: o for o in pa.get_backend(name).options()}


@contextlib.contextmanager
def _configured(name: str, **options) -> Iterator[None]:
    """The backend with `options` set, its previous values back afterwards."""
    saved = {k: v.value for k, v in _options(name).items()}
    pa.configure_backend(name, **options)
    try:
        yield
    finally:
        pa.configure_backend(name, **saved)


def test_ref_has_no_options() -> None:
    assert pa.get_backend("ref").options() == []
    with pytest.raises(pa.InvalidArgument, match="'ref' has no options"):
        pa.configure_backend("ref", anything=1)
    with pytest.raises(pa.InvalidArgument, match="'nope' is not a registered backend"):
        pa.configure_backend("nope", threads=1)


@needs_cpu_backend
def test_cpu_threads_option() -> None:
    info = _options("cpu")["threads"]
    assert info.allowed == ["auto", "an integer in [1, 4096]"]
    assert info.help
    before = pa.get_backend("cpu")
    with _configured("cpu", threads=3):
        assert _options("cpu")["threads"].value == "3"
        assert pa.get_backend("cpu") is not before  # the registry holds a new backend
        # Settings apply over the current ones, so the value stays until it is set again.
        pa.configure_backend("cpu")
        assert _options("cpu")["threads"].value == "3"
    assert _options("cpu")["threads"].value == info.value


@needs_cpu_backend
def test_cpu_spin_option() -> None:
    spin = _options("cpu")["spin_us"]
    assert spin.value == "50"
    assert spin.allowed == ["an integer in [0, 1000000]"]
    assert "sleeps" in spin.help
    with _configured("cpu", spin_us=0, threads=2):
        assert _options("cpu")["spin_us"].value == "0"
    assert _options("cpu")["spin_us"].value == "50"


@needs_cpu_backend
def test_bad_settings_name_the_option_the_value_and_what_is_allowed() -> None:
    before = _options("cpu")["threads"].value
    with pytest.raises(pa.InvalidArgument, match=r"option 'threads': '0' is not auto or an "
                                                 r"integer in \[1, 4096\]"):
        pa.configure_backend("cpu", threads=0)
    with pytest.raises(pa.InvalidArgument, match=r"option 'threads': 'many'"):
        pa.configure_backend("cpu", threads="many")
    with pytest.raises(pa.InvalidArgument, match=r"has no option 'treads'; its options: threads"):
        pa.configure_backend("cpu", treads=2)
    # A failed call changes nothing, even when an earlier setting of it was valid.
    with pytest.raises(pa.InvalidArgument):
        pa.configure_backend("cpu", threads=2, nope=1)
    assert _options("cpu")["threads"].value == before


@needs_cpu_backend
@pytest.mark.parametrize("threads", [1, 7])
def test_cpu_runs_under_the_option(threads: int) -> None:
    # A long context split over the planned threads (7: uneven), merged; checked against ref.
    case = pa.make_random_case(seed=threads, num_heads=8, num_kv_heads=2, head_size=64,
                               dtype="float32", requests=[(700, 3), (40, 1)])
    with _configured("cpu", threads=threads):
        result = pa.run_case(case, backend="cpu")
    assert pa.check_case(case, result).passed


@pytest.mark.skipif(not pa.with_cuda, reason="pagedattn built without CUDA")
def test_cuda_options_listed_and_checked() -> None:
    opts = _options("cuda")
    for name in ("checked", "splits", "prefill", "prefill_kernel", "decode_copy", "mla_consumer",
                 "mla_copy", "prefill_copy", "prefill_persistent", "prefill_pair_group",
                 "prefill_walk"):
        assert name in opts, name
    assert opts["prefill"].allowed == ["auto", "off", "all"]
    assert "redundant" not in opts["mla_consumer"].allowed
    with _configured("cuda", prefill="all", prefill_persistent=1, checked=True):
        now = _options("cuda")
        assert (now["prefill"].value, now["prefill_persistent"].value,
                now["checked"].value) == ("all", "1", "on")
    with pytest.raises(pa.InvalidArgument, match=r"option 'splits': '65' is not auto or an "
                                                 r"integer in \[1, 64\]"):
        pa.configure_backend("cuda", splits=65)
    with pytest.raises(pa.InvalidArgument, match=r"option 'mla_consumer': 'redundant'"):
        pa.configure_backend("cuda", mla_consumer="redundant")


@pytest.mark.skipif(not HAS_CUDA, reason="needs torch with a CUDA device and pagedattn with CUDA")
@pytest.mark.parametrize("options", [dict(prefill="all"),
                                     dict(prefill="all", prefill_kernel="portable"),
                                     dict(prefill="all", prefill_persistent=1),
                                     dict(splits=5)])
def test_cuda_routes_match_the_reference(options: dict) -> None:
    case = pa.make_random_case(seed=3, num_heads=8, num_kv_heads=2, head_size=128,
                               dtype="bfloat16", requests=[(300, 200), (0, 90), (1000, 1)])
    with _configured("cuda", **options):
        result = pa.run_case(case, backend="cuda", device="cuda")
    assert pa.check_case(case, result).passed, options
