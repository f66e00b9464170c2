"""The CPU stand-in for SGLang's `sgl_kernel` (engines/sglang_cpu), against a plain loop
written from SGLang's description of the kernel; serving with it: tests/test_real_sglang.py."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers.repo import ROOT

PATH = ROOT / "engines/sglang_cpu/sgl_kernel/__init__.py"


@pytest.fixture(scope="module")
def kernel():
    spec = importlib.util.spec_from_file_location("sgl_kernel_standin", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(rows, table, starts, ends, locs):
    out, taken = table.clone(), 0
    for i in range(len(rows)):
        for j in range(int(starts[i]), int(ends[i])):
            out[int(rows[i]), j] = locs[taken]
            taken += 1
    return out


def test_each_request_gets_its_slots_in_its_row(kernel):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        n, width = int(torch.randint(1, 6, (1,), generator=gen)), 32
        rows = torch.randperm(8, generator=gen)[:n]
        starts = torch.randint(0, 16, (n,), generator=gen)
        ends = starts + torch.randint(0, 16, (n,), generator=gen)
        locs = torch.randint(0, 10_000, (int((ends - starts).sum()),), generator=gen)
        table = torch.full((8, width), -1, dtype=torch.int32)
        expected = reference(rows, table, starts, ends, locs)
        kernel.assign_req_to_token_pool_cpu(rows, table, starts, ends, locs, width)
        assert torch.equal(table, expected)


def test_bad_offsets_are_refused(kernel):
    table = torch.zeros((2, 4), dtype=torch.int32)
    one = torch.tensor([0])
    with pytest.raises(ValueError, match="outside"):
        kernel.assign_req_to_token_pool_cpu(one, table, one, torch.tensor([5]), torch.arange(5), 4)
    with pytest.raises(ValueError, match="too short"):
        kernel.assign_req_to_token_pool_cpu(one, table, one, torch.tensor([3]), torch.arange(2), 4)


def test_any_other_kernel_imports_and_fails_by_name_when_called(kernel):
    copy = kernel.copy_all_layer_kv_cache_cpu  # what SGLang imports at load
    with pytest.raises(NotImplementedError, match="sgl_kernel.copy_all_layer_kv_cache_cpu"):
        copy(1, 2)
    with pytest.raises(AttributeError):
        kernel.__wrapped__  # noqa: B018  (dunders are not kernels)


def test_no_stage_module_imports_the_stand_in():
    """It belongs to the test engine venv: the pipeline never loads it."""
    users = [p.relative_to(ROOT).as_posix() for p in (ROOT / "stages").rglob("*.py")
             if "sgl_kernel" in p.read_text(encoding="utf-8")
             or "sglang_cpu" in p.read_text(encoding="utf-8")]
    assert users == []
