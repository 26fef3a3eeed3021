"""The Triton-AOT helpers the sm_120 tests use: they live in the product now
(sm120kit.tune.aot); this name stays so the tests read as before."""

from sm120kit.tune.aot import (  # noqa: F401
    DTYPES,
    HELPERS,
    SM120_SMEM_OPTIN,
    SMEM_OPTIN,
    Dtype,
    FakeTensor,
    Launch,
    capture_launch,
    capture_launches,
    compile_for,
    compile_key,
    load_kernels,
    set_gpu,
    shared_bytes,
    specialize,
)
