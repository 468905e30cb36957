"""Building and loading the CPU kernels (shard/paged_kernel.py) never stops a shard: without a compiler, with a
compiler that fails or hangs, with a library that will not load or lacks a function, the shard's Runner serves
on the torch paths and the log says why, once; a cache folder that cannot be used costs only the cache."""
import _ctypes
import logging
import os
import shutil
import stat
import time

import pytest
import torch

from shard import paged_kernel
from shard.model import load
from shard.runner import Runner

from serve import greedy

CPU = torch.device("cpu")
REAL_CC = shutil.which("cc") or shutil.which("gcc")


@pytest.fixture(scope="module")
def loaded(tiny_llama):
    return load(str(tiny_llama), "float32", CPU, 0, 1)


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """Each test builds anew, into a cache of its own, whatever CB_PAGED_KERNEL the run was given."""
    monkeypatch.setattr(paged_kernel, "_tried", False)
    monkeypatch.setattr(paged_kernel, "_lib", None)
    monkeypatch.setenv("CB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CB_PAGED_KERNEL", raising=False)
    monkeypatch.delenv("CC", raising=False)


def fake_compiler(tmp_path, body: str) -> str:
    """A compiler that runs `body` (a shell script) with $OUT the library it was asked for."""
    path = tmp_path / "fake-cc"
    path.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\nOUT="$2"\n' + body + "\n")
    path.chmod(0o755)
    return str(path)


def serve(loaded, monkeypatch, caplog) -> tuple[Runner, list[str], int]:
    """A Runner built as a shard builds it, a few greedy steps of two requests: (runner, the warnings logged,
    the decode attention calls that went to the kernel)."""
    calls = []
    decode = paged_kernel.decode
    monkeypatch.setattr(paged_kernel, "decode", lambda *a: calls.append(1) or decode(*a))
    with caplog.at_level(logging.WARNING, logger="cb.shard"):
        r = Runner(loaded, CPU, 16, 0, 1)
    r.allocate(64)
    tokens = greedy(r, {0: [5, 17, 23, 99, 4], 1: list(range(40, 61))}, 4)
    assert [len(t) for t in tokens.values()] == [4, 4]
    warnings = [rec.getMessage() for rec in caplog.records if rec.name == "cb.shard" and rec.levelno >= logging.WARNING]
    return r, warnings, len(calls)


def assert_torch_path(loaded, monkeypatch, caplog, *reason: str) -> None:
    r, warnings, kernel_calls = serve(loaded, monkeypatch, caplog)
    assert not r.kernel and kernel_calls == 0
    assert len(warnings) == 1 and all(part in warnings[0] for part in reason), warnings
    assert paged_kernel.greedy(torch.zeros(2, 8)) is None, "sampling stays in torch too"


def test_no_compiler_named_by_cc(loaded, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert_torch_path(loaded, monkeypatch, caplog, "no C compiler", "no-such-cc")


def test_no_compiler_on_path(loaded, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert_torch_path(loaded, monkeypatch, caplog, "neither cc nor gcc")


def test_compiler_fails(loaded, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CC", fake_compiler(tmp_path, 'echo "paged_decode.c:1: error: no such luck" >&2\nexit 3'))
    assert_torch_path(loaded, monkeypatch, caplog, "exited 3", "no such luck")


def test_compiler_past_the_timeout_is_ended(loaded, monkeypatch, caplog, tmp_path):
    """The compiler's own children too (this `sleep`, as cc1 would be): they would hold its pipe open."""
    monkeypatch.setenv("CC", fake_compiler(tmp_path, "sleep 60"))
    monkeypatch.setattr(paged_kernel, "COMPILE_TIMEOUT", 0.5)
    start = time.monotonic()
    assert_torch_path(loaded, monkeypatch, caplog, "ran past 0.5 s")
    assert time.monotonic() - start < 30


def test_library_that_does_not_load(loaded, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CC", fake_compiler(tmp_path, 'echo "not a shared object" > "$OUT"'))
    assert_torch_path(loaded, monkeypatch, caplog, "loading", "failed")


@pytest.mark.skipif(not getattr(_ctypes, "__file__", None), reason="no shared library at hand to stand in")
def test_library_without_the_kernels(loaded, monkeypatch, caplog, tmp_path):
    """A library that loads but holds other functions (here Python's own _ctypes module)."""
    monkeypatch.setenv("CC", fake_compiler(tmp_path, f'cp "{_ctypes.__file__}" "$OUT"'))
    assert_torch_path(loaded, monkeypatch, caplog, "loading", "paged_decode")


def _file_in_the_way(cache):
    cache.write_text("")  # $CB_CACHE a file: no folder can be made under it


def _read_only(cache):
    cache.mkdir()
    cache.chmod(stat.S_IRUSR | stat.S_IXUSR)


def _unreadable(cache):
    cache.mkdir()
    cache.chmod(0)


@pytest.mark.skipif(REAL_CC is None, reason="no C compiler to build the kernels with")
@pytest.mark.parametrize("make", [
    _file_in_the_way,
    pytest.param(_read_only, marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes anyway")),
    pytest.param(_unreadable, marks=pytest.mark.skipif(os.geteuid() == 0, reason="root reads anyway")),
])
def test_unusable_cache_folder_builds_in_a_temporary_one(loaded, monkeypatch, caplog, tmp_path, make):
    cache = tmp_path / "cache"
    make(cache)
    try:
        r, warnings, kernel_calls = serve(loaded, monkeypatch, caplog)
    finally:
        if cache.is_dir():
            cache.chmod(0o700)
    assert r.kernel and kernel_calls > 0
    assert len(warnings) == 1 and "cache folder" in warnings[0] and "temporary folder" in warnings[0], warnings
