"""The step-time target (EngineConfig.step_time_target_ms, engine/step_budget.py): the step-time
model's fits, the prompt-token cap it gives, the scheduler's use of it, and an engine with it."""

import random
import time

import pytest

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Request
from tokenmill.engine.scheduler import Scheduler, SchedulerLimits
from tokenmill.engine.step_budget import (AUTO_TARGET_MIN_MS, StepBudget, StepClock, StepTimeModel, auto_target_ms,
                                          calibration_shapes)
from tokenmill.entrypoints import cli
from tokenmill.sampling_params import SamplingParams

A, B, C = 2.0, 0.01, 0.05  # ms, ms per token, ms per request


def truth(num_tokens, num_reqs, a=A, b=B, c=C):
    return a + b * num_tokens + c * num_reqs


def calibrated_model(a=A, b=B, c=C, **kwargs) -> StepTimeModel:
    model = StepTimeModel(**kwargs)
    model.fit([(t, r, truth(t, r, a, b, c)) for t, r in calibration_shapes(2048, 64)])
    return model


def random_steps(rng, n):
    """Step shapes as a server sees them: decode batches, and mixed steps with a prompt chunk."""
    for _ in range(n):
        decodes = rng.randint(1, 64)
        yield (decodes, decodes) if rng.random() < 0.6 else (decodes + rng.randint(16, 1024), decodes + 1)


def test_calibration_fit_recovers_known_coefficients():
    rng = random.Random(0)
    model = StepTimeModel()
    model.fit([(t, r, truth(t, r) * (1 + rng.uniform(-0.01, 0.01))) for t, r in calibration_shapes(2048, 64)])
    assert model.calibrated
    assert model.a == pytest.approx(A, rel=0.05) and model.b == pytest.approx(B, rel=0.02)
    assert model.c == pytest.approx(C, rel=0.2)
    assert "ms +" in str(model)


def test_online_fit_follows_the_measured_steps_and_shrugs_off_outliers():
    """Calibrated on one machine's speed, the steps run at another (a = 3, b = 0.02): the online fit
    follows them, undisturbed by steps that stall (a Triton compile), and keeps the per-request
    cost that decode-only steps cannot tell apart from the per-token one."""
    rng = random.Random(1)
    model = calibrated_model()
    for i, (t, r) in enumerate(random_steps(rng, 400)):
        ms = truth(t, r, a=3.0, b=0.02) * (1 + rng.uniform(-0.03, 0.03))
        model.observe(t, r, 800.0 if i % 50 == 7 else ms)  # a compile now and then
    assert model.num_observations == 400 and model.num_outliers >= 8
    assert model.a == pytest.approx(3.0, rel=0.15) and model.b == pytest.approx(0.02, rel=0.05)
    assert model.c == pytest.approx(C, abs=0.02)
    for t, r in ((32, 32), (544, 33), (1024, 1)):
        assert model.predict(t, r) == pytest.approx(truth(t, r, a=3.0, b=0.02), rel=0.05)


def test_one_stalled_step_barely_moves_the_model():
    model = calibrated_model()
    before = model.predict(256, 9)
    model.observe(256, 9, 2000.0)
    assert model.predict(256, 9) == pytest.approx(before, rel=0.15) and model.num_outliers == 1  # not 400x


def test_uncalibrated_model_learns_nothing():
    model = StepTimeModel()
    model.observe(100, 2, 5.0)
    assert model.num_observations == 0 and not model.calibrated


def test_coefficients_stay_non_negative():
    model = StepTimeModel()  # times that fall with the requests: the per-request cost pins at 0
    model.fit([(64, 1, 2.0), (64, 32, 1.5), (256, 1, 4.0), (256, 32, 3.5)])
    assert min(model.a, model.b, model.c) >= 0.0 and model.c == 0.0 and model.b > 0


def test_prefill_cap_respects_target_floor_and_caps():
    budget = StepBudget(10.0, max_tokens=2048, min_tokens=16, model=calibrated_model())
    # 10 ms - (2 + 0.32 + 33 * 0.05) ms left for tokens at 0.01 ms each
    cap = budget.prefill_cap(32, 33)
    assert cap in (602, 603)  # (10 - 3.97) / 0.01, to rounding
    assert truth(32 + cap, 33) <= 10.0 + 1e-9 < truth(32 + cap + 2, 33)
    assert StepBudget(1.0, 2048, 16, calibrated_model()).prefill_cap(32, 33) == 16  # over already: the floor
    assert StepBudget(1000.0, 2048, 16, calibrated_model()).prefill_cap(32, 33) == 2048  # the hard cap
    assert StepBudget(10.0, 8, 16, calibrated_model()).min_tokens == 8  # the floor within the cap
    assert StepBudget(10.0, 2048).prefill_cap(32, 33) == 2048  # not calibrated: no limit
    with pytest.raises(ValueError):
        StepBudget(0.0, 2048)


def test_calibration_shapes_span_tokens_and_requests():
    shapes = calibration_shapes(512, 8)
    assert shapes[0] == (16, 1) and (512, 1) in shapes and (512, 8) in shapes
    assert all(t <= 512 and r <= min(t, 8) for t, r in shapes)
    assert len({r for _, r in shapes}) > 1 and len({t for t, _ in shapes}) > 1
    assert calibration_shapes(4, 4) == [(1, 1), (4, 1), (4, 4)]


def test_calibrate_times_each_shape_and_fits():
    calls = []
    budget = StepBudget(50.0, 1024)
    budget.calibrate(lambda t, r: calls.append((t, r)), lambda: None, max_tokens=1024, max_reqs=16, repeats=2)
    shapes = calibration_shapes(1024, 16)
    assert calls == [s for s in shapes for _ in range(3)]  # one untimed run, then two timed
    assert budget.model.calibrated


def test_calibration_keeps_to_its_time_budget(monkeypatch):
    """A pass costs 0.1 ms a token (a CPU, say): the shapes that would take the calibration past
    its budget are not run at all."""
    import tokenmill.engine.step_budget as sb

    now = [0.0]
    monkeypatch.setattr(sb.time, "perf_counter", lambda: now[0])
    ran = []

    def run(num_tokens, num_reqs):
        ran.append(num_tokens)
        now[0] += num_tokens * 1e-4

    StepBudget(50.0, 4096).calibrate(run, lambda: None, max_tokens=4096, max_reqs=64, time_budget_s=0.5)
    assert max(ran) == 256 and now[0] <= 0.5  # the next, 1024 tokens x 4 runs, would take 0.41 s more


def test_step_clock_measures_without_a_device_sync(monkeypatch):
    import tokenmill.engine.step_budget as sb

    now = [0.0]
    monkeypatch.setattr(sb.time, "perf_counter", lambda: now[0])

    def at(t):
        now[0] = t

    sync = StepClock(synchronous=True)  # CPU: the launch computes the step
    at(1.0), sync.begin(), at(1.004), sync.launched(), at(1.010)
    assert sync.completed() == pytest.approx(4.0)
    queued = StepClock(synchronous=False, events=False)  # steps on a stream, one in flight: the host interval
    at(0.0), queued.begin(), at(0.001), queued.launched()  # step 1 launched
    at(0.002), queued.begin(), at(0.003), queued.launched()  # step 2 launched before 1 is done
    at(0.010)
    assert queued.completed() == pytest.approx(10.0)  # step 1: from its launch
    at(0.016)
    assert queued.completed() == pytest.approx(6.0)  # step 2: from step 1's end
    at(1.0), queued.begin(), at(1.001), queued.launched(), at(1.005)  # after idling: from its launch
    assert queued.completed() == pytest.approx(5.0)


# ---- the scheduler -----------------------------------------------------------------------------
def make_request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), seed=0, max_tokens=max_tokens,
                   stop_ids=frozenset())


def fixed_budget(target_ms: float, max_tokens: int) -> StepBudget:
    return StepBudget(target_ms, max_tokens, min_tokens=4, model=calibrated_model())


def test_scheduler_spreads_a_long_prompt_while_decodes_run():
    kv = KVCacheManager(num_blocks=128, block_size=4, enable_prefix_caching=False)
    budget = fixed_budget(2.5, 256)  # one decode: (2.5 - 2 - 0.01 - 2 * 0.05) / 0.01 = 39 prompt tokens
    cap = budget.prefill_cap(1, 2)
    assert cap in (38, 39)
    sched = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512), kv, budget)
    a = make_request("a", list(range(20)), max_tokens=64)
    sched.add_request(a)
    out = sched.schedule()  # nothing decodes: the whole prompt at once
    assert [(e.req_id, e.num_tokens) for e in out.batch] == [("a", 20)] and out.kind == "prefill"
    sched.take_sampled_token("a").output_token_ids.append(1)
    sched.add_request(make_request("b", list(range(100, 200)), max_tokens=4))
    chunks = []
    while sched.requests["b"].num_computed_tokens < 100:
        out = sched.schedule()
        assert out.batch[0].req_id == "a" and out.num_decodes == 1
        chunks += [e.num_tokens for e in out.batch if e.req_id == "b"]
    assert chunks == [cap, cap, 100 - 2 * cap]
    # A step without decodes takes a whole prompt, far past what the target fits beside decodes.
    kv2 = KVCacheManager(num_blocks=128, block_size=4, enable_prefix_caching=False)
    sched2 = Scheduler(SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512), kv2, budget)
    sched2.add_request(make_request("c", list(range(200))))
    out = sched2.schedule()
    assert [(e.req_id, e.num_tokens) for e in out.batch] == [("c", 200)]


def test_scheduler_takes_the_lower_of_the_two_caps_and_the_floor():
    def chunk(target_ms, cap):
        kv = KVCacheManager(num_blocks=128, block_size=4, enable_prefix_caching=False)
        limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=512,
                                 max_prefill_tokens_with_decodes=cap)
        sched = Scheduler(limits, kv, fixed_budget(target_ms, 256))
        sched.add_request(make_request("a", list(range(8)), max_tokens=16))
        sched.schedule()
        sched.take_sampled_token("a").output_token_ids.append(1)
        sched.add_request(make_request("b", list(range(100, 300))))
        return [e.num_tokens for e in sched.schedule().batch if e.req_id == "b"]

    assert chunk(2.5, None) == [fixed_budget(2.5, 256).prefill_cap(1, 2)]
    assert chunk(2.5, 10) == [10]  # max_prefill_tokens_with_decodes lower
    assert chunk(3.0, 200) == [fixed_budget(3.0, 256).prefill_cap(1, 2)]  # the target lower (89)
    assert 88 <= chunk(3.0, 200)[0] <= 89
    assert chunk(0.5, None) == [4]  # over the target already: the floor, so the prompt progresses


# ---- the engine --------------------------------------------------------------------------------
def run_staggered(engine):
    """Short requests start decoding, then long prompts arrive while they decode; greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine.step_log = []
    outputs = {}
    arrivals = {0: [list(range(1, 9)), list(range(40, 52))], 3: [list(range(100, 400))],
                6: [list(range(500, 700)), list(range(3, 90))]}
    step = 0
    while step in arrivals or engine.has_unfinished_requests() or step <= max(arrivals):
        for prompt in arrivals.get(step, []):
            engine.add_request(prompt, params, request_id=f"r{prompt[0]}")
        for out in engine.step(emit_unfinished=False):
            outputs[out.request_id] = out.outputs[0].token_ids
        step += 1
    return outputs


def test_engine_with_a_target_changes_scheduling_not_outputs():
    from tokenmill.engine.llm_engine import LLMEngine

    def engine(**overrides):
        config = EngineConfig(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=512, **overrides)
        return LLMEngine("tiny-llama", config, load_format="dummy", dtype="float32", device="cpu")

    plain, targeted = engine(), engine(step_time_target_ms=0.01)  # below any step: the floor, 16 tokens
    assert plain.step_budget is None and plain.scheduler.step_budget is None
    budget = targeted.step_budget
    assert budget is not None and budget.model.calibrated and targeted.scheduler.step_budget is budget
    prior = list(budget.model.coef)
    expected, got = run_staggered(plain), run_staggered(targeted)
    assert got == expected and len(got) == 5 and all(len(t) == 24 for t in got.values())
    # While decodes ran, the target held each step to its decodes plus one block of prompt tokens.
    mixed = [s for s in targeted.step_log if (s.query_lens == 1).any() and (s.query_lens > 1).any()]
    assert mixed and all(int(s.query_lens[s.query_lens > 1].sum()) <= 16 for s in mixed)
    # Without it, the prompts go in far larger pieces beside the decodes (the CPU's cap of 256).
    assert any(int(s.query_lens[s.query_lens > 1].sum()) > 100 for s in plain.step_log if (s.query_lens == 1).any())
    # Every completed step fed the model.
    assert budget.model.num_observations == targeted.steps_completed > len(mixed)
    assert budget.model.coef != prior


def test_target_option_is_validated_and_a_flag():
    for bad in (0, -5.0, "fast", True):
        with pytest.raises(ConfigError, match="step_time_target_ms must be > 0"):
            EngineConfig(step_time_target_ms=bad)
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--step-time-target-ms", "40"])
    assert cli.engine_config_from_args(args).step_time_target_ms == 40.0
    assert EngineConfig().step_time_target_ms is None  # offline: no target
    # tokenmill serve: auto, a target on one CUDA device only
    serve = cli.engine_config_from_args(parser.parse_args(["serve"]))
    assert serve.resolve_step_time_target("cuda") == "auto" and serve.resolve_step_time_target("cpu") is None
    assert cli.engine_config_from_args(parser.parse_args(["serve", "-tp", "2"])).step_time_target_ms is None
    off = parser.parse_args(["serve", "--step-time-target-ms", "off"])
    assert cli.engine_config_from_args(off).resolve_step_time_target("cuda") is None
    assert cli.engine_flags(off) == ["--step-time-target-ms", "off"]  # what bench serve --launch passes on


def test_auto_target_is_twice_the_decode_step_or_the_floor():
    assert auto_target_ms(calibrated_model(), 64) == AUTO_TARGET_MIN_MS  # a decode of 64: 5.8 ms
    slow = calibrated_model(a=20.0)  # a decode of 64: 20 + 0.64 + 3.2 ms
    assert auto_target_ms(slow, 64) == pytest.approx(2 * 23.84)
    budget = StepBudget("auto", 256)
    assert budget.auto and budget.prefill_cap(8, 9) == 256  # before calibration: no limit
    # Calibrated on passes that take as long as the slow model says: the target follows them.
    budget.calibrate(lambda t, r: time.sleep(truth(t, r, a=20.0) / 1e3), lambda: None, max_tokens=256, max_reqs=64)
    assert budget.target_ms == pytest.approx(2 * 23.84, rel=0.25)


def test_a_lasting_change_of_speed_is_followed_within_a_few_steps():
    """Calibrated under load (every pass 20x slower than the steps that follow): after
    rescale_after clipped steps in a row the model rescales, and predicts the new speed."""
    model = calibrated_model(a=40.0, b=0.2, c=1.0)
    rng = random.Random(2)
    for t, r in random_steps(rng, 12):
        model.observe(t, r, truth(t, r))
    assert model.num_rescales == 1
    for t, r in ((32, 32), (544, 33)):
        assert model.predict(t, r) == pytest.approx(truth(t, r), rel=0.2)


def test_a_noisy_fit_never_makes_prompt_tokens_free():
    model = calibrated_model()
    for _ in range(200):  # decodes only, times that do not grow with the tokens
        model.observe(8, 8, 3.0)
        model.observe(2, 2, 3.0)
    budget = StepBudget(10.0, 8192, 16, model)
    assert model.token_cost >= 0.25 * B
    assert budget.prefill_cap(8, 9) <= (10.0 - 0.0) / (0.25 * B)
