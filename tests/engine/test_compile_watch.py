"""The compile watch counts Triton compiles per engine and warns about those after warm-up."""

import logging
import threading

import pytest

from tokenmill.engine import compile_watch
from tokenmill.engine.compile_watch import CompileStats, CompileWatch


class _Fn:
    name = "my_kernel"


def _compile(signature: str = "r") -> None:
    """What Triton's hooks see around one compile."""
    assert compile_watch.on_compile_start(fn=_Fn(), repr=signature) is None  # None: Triton goes on compiling
    compile_watch.on_compile_end(fn=_Fn(), repr=signature)


def test_counts_and_warns_after_warm_up(caplog):
    watch = CompileWatch()
    with watch.watching():
        _compile()  # before warm-up ends: counted, not warned about
    assert watch.stats() == CompileStats(1, 0, 0.0)
    watch.mark_warm()
    logger = logging.getLogger("tokenmill")  # it does not propagate to the root, where caplog listens
    logger.addHandler(caplog.handler)
    try:
        with watch.watching():
            _compile("my_kernel[num_warps=4](n: i32)")
    finally:
        logger.removeHandler(caplog.handler)
    s = watch.stats()
    assert s.compiles == 2 and s.compiles_after_warm == 1 and s.seconds_after_warm >= 0.0
    assert "my_kernel" in caplog.text and "after warm-up" in caplog.text


def test_two_watches_keep_separate_counts():
    """Two engines in one process: each counts only the compiles inside its own steps, also on
    different threads; a compile outside any engine is nobody's."""
    a, b = CompileWatch(), CompileWatch()
    a.mark_warm()
    with a.watching():
        _compile()
        with b.watching():  # nested: the inner one is active
            _compile()
        _compile()
    done = threading.Event()

    def other_thread():
        with b.watching():
            _compile()
        done.set()

    with a.watching():
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    _compile()  # no watch active
    assert done.is_set()
    assert a.stats() == CompileStats(2, 2, a.stats().seconds_after_warm)
    assert b.stats().compiles == 2 and b.stats().compiles_after_warm == 0


def test_install_sets_triton_hooks(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    assert compile_watch.install_hooks()
    assert compile_watch.install_hooks()  # idempotent
    assert knobs.runtime.jit_cache_hook is compile_watch.on_compile_start
    assert knobs.runtime.jit_post_compile_hook is compile_watch.on_compile_end


def test_install_leaves_a_foreign_hook_alone(monkeypatch):
    knobs = pytest.importorskip("triton").knobs

    def theirs(**kwargs):
        return None

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", theirs)
    assert not compile_watch.install_hooks()
    assert knobs.runtime.jit_cache_hook is theirs
