"""Freed memory goes back to the OS after each outer round (node/heap.py)."""

import platform

import pytest

from agora_node.node.heap import release_freed_memory

pytestmark = pytest.mark.timeout(30)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_glibc_returns_freed_pages():
    blocks = [bytearray(1 << 16) for _ in range(2000)]  # 128 MiB in many small blocks
    del blocks[::2]  # freed out of order: holes glibc keeps
    assert release_freed_memory() is True


def test_without_malloc_trim_it_is_a_no_op(monkeypatch):
    from agora_node.node import heap

    monkeypatch.setattr(heap, "_trim", lambda: None)
    assert release_freed_memory() is False


def test_agora_malloc_trim_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("AGORA_MALLOC_TRIM", "0")
    assert release_freed_memory() is False
