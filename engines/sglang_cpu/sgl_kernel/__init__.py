"""A CPU stand-in for SGLang's `sgl_kernel`, for the test engine venv `.venv-sglang-cpu` only.

SGLang 0.5.23 with SGLANG_USE_CPU_ENGINE=1 imports a few CPU kernels from `sgl_kernel` at
load time, and no published `sglang-kernel` wheel holds CPU builds. On a CPU without AMX,
plain decoding calls one of them, `assign_req_to_token_pool_cpu`, written here in torch.
Every other name imports (SGLang imports them at module load) as a function that raises
when called: a path that needs a real CPU kernel stops with its name. `make engine-venv`
puts this folder first on the venv's path (engines/sglang_cpu/sglang_cpu.pth) and leaves
the CUDA `sglang-kernel` out (engines/sglang_cpu/requirements.txt); nothing under stages/
imports it.
"""

from __future__ import annotations

import torch

__all__ = ["assign_req_to_token_pool_cpu"]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i, write its next `end_offset[i] - start_offset[i]` entries of
    `out_cache_loc` (requests in order) into row `req_pool_indices[i]` of `req_to_token`,
    columns `start_offset[i]:end_offset[i]`."""
    rows, starts, ends = req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    if not len(rows) == len(starts) == len(ends):
        raise ValueError("assign_req_to_token_pool_cpu: the index tensors differ in length")
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"assign_req_to_token_pool_cpu: pool_len {pool_len} is not "
                         f"req_to_token's width {req_to_token.shape[1]}")
    taken = 0
    for row, start, end in zip(rows, starts, ends):
        if not 0 <= start <= end <= pool_len:
            raise ValueError(f"assign_req_to_token_pool_cpu: columns {start}:{end} outside "
                             f"0:{pool_len}")
        n = end - start
        if taken + n > out_cache_loc.numel():
            raise ValueError("assign_req_to_token_pool_cpu: out_cache_loc is too short")
        req_to_token[row, start:end] = out_cache_loc[taken:taken + n].to(req_to_token.dtype)
        taken += n


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} has no CPU stand-in (engines/sglang_cpu provides only "
            "assign_req_to_token_pool_cpu): this SGLang path needs the sglang-kernel-cpu "
            "build, which is not on the package index")

    missing.__name__ = missing.__qualname__ = name
    return missing
