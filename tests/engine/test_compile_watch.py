"""The compile watcher counts Triton compiles and warns about those after warm-up."""

import logging

import pytest

from tokenmill.engine import compile_watch


class _Fn:
    name = "my_kernel"


def test_counts_and_warns_after_warm_up(caplog, monkeypatch):
    monkeypatch.setattr(compile_watch, "_stats", compile_watch.CompileStats())
    monkeypatch.setattr(compile_watch, "_warm", False)
    # Before warm-up ends: counted, not warned about.
    assert compile_watch.on_compile_start(fn=_Fn(), repr="r") is None  # None: Triton goes on compiling
    compile_watch.on_compile_end(fn=_Fn(), repr="r")
    assert compile_watch.stats() == compile_watch.CompileStats(1, 0, 0.0)
    compile_watch.mark_warm()
    logger = logging.getLogger("tokenmill")  # it does not propagate to the root, where caplog listens
    logger.addHandler(caplog.handler)
    try:
        compile_watch.on_compile_start(fn=_Fn(), repr="my_kernel[num_warps=4](n: i32)")
        compile_watch.on_compile_end(fn=_Fn(), repr="my_kernel[num_warps=4](n: i32)")
    finally:
        logger.removeHandler(caplog.handler)
    s = compile_watch.stats()
    assert s.compiles == 2 and s.compiles_after_warm == 1 and s.seconds_after_warm >= 0.0
    assert "my_kernel" in caplog.text and "after warm-up" in caplog.text


def test_install_sets_triton_hooks(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setattr(compile_watch, "_installed", False)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    assert compile_watch.install()
    assert knobs.runtime.jit_cache_hook is compile_watch.on_compile_start
    assert knobs.runtime.jit_post_compile_hook is compile_watch.on_compile_end


def test_install_leaves_a_foreign_hook_alone(monkeypatch):
    knobs = pytest.importorskip("triton").knobs

    def theirs(**kwargs):
        return None

    monkeypatch.setattr(compile_watch, "_installed", False)
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", theirs)
    assert not compile_watch.install()
    assert knobs.runtime.jit_cache_hook is theirs
