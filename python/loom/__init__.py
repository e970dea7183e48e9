"""loom: generated, autotuned Interleaved Head Attention kernels (docs/IHA.md).

    import loom
    out = loom.iha(q, k, v, alpha_q, alpha_k, alpha_v, collapse, spec)          # any DLPack tensors
    grads = loom.iha_backward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, dout, spec)
    out = loom.decode(q, k, v, alpha_q, alpha_k, alpha_v, collapse,  # one step over a paged cache
                      k_cache, v_cache, page_table, cache_len, spec, cache="raw")

CUDA tensors run the spec's kernels (tuned, cached, compiled by NVRTC), host
tensors the same generated program on the host tile API. For PyTorch
(autograd, torch.compile, an IHA layer) see loom.torch.
"""
from ._loom import (  # noqa: F401  (the public API)
    Error,
    Tensor,
    __version__,
    backward_check_share,
    compile,
    counters,
    decode,
    devices,
    generate,
    generator_version,
    gpu_error,
    iha,
    iha_backward,
    reference,
    reference_backward,
    reload,
    shape_bucket,
)
