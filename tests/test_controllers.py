import math

import pytest

from confkv.config import CachePolicy
from confkv.controllers import BudgetState, StepSignals, make_controller

CONFIDENT = StepSignals(entropy=0.5, gap=0.9, top1_prob=0.95)
HIGH_ENTROPY = StepSignals(entropy=4.0, gap=0.9, top1_prob=0.5)
SMALL_GAP = StepSignals(entropy=0.5, gap=0.05, top1_prob=0.5)


def dynamic(**kw):
    return make_controller(CachePolicy(controller="dynamic", base_size=100, max_size=1100, min_recent=50, **kw))


def test_dynamic_rule_step_by_step():
    c = dynamic(scaling_factor=0.8)
    s = c.init_state()
    assert s.budget == 100
    s = c.update(s, HIGH_ENTROPY)  # 100 + 0.2 * (1100 - 100)
    assert s.uncertain and s.budget == pytest.approx(300)
    s = c.update(s, SMALL_GAP)  # 300 + 0.2 * 800
    assert s.uncertain and s.budget == pytest.approx(460)
    s = c.update(s, CONFIDENT)  # 460 - 0.2 * 360
    assert not s.uncertain and s.budget == pytest.approx(388)
    for _ in range(200):
        s = c.update(s, CONFIDENT)
    assert s.budget == pytest.approx(100, abs=1e-6)
    for _ in range(200):
        s = c.update(s, HIGH_ENTROPY)
    assert s.budget == pytest.approx(1100, abs=1e-6) and s.budget <= 1100
    assert s.steps == 403


def test_thresholds_are_strict_and_either_signal_counts():
    c = dynamic()
    assert not c.is_uncertain(StepSignals(3.5, 0.15, 0.5))  # equal to the thresholds: confident
    assert c.is_uncertain(StepSignals(3.5001, 0.9, 0.5))
    assert c.is_uncertain(StepSignals(0.1, 0.1499, 0.5))


def test_scaling_one_keeps_budget_still():
    c = dynamic(scaling_factor=1.0)
    s = c.init_state()
    for sig in (HIGH_ENTROPY, SMALL_GAP, CONFIDENT) * 5:
        s = c.update(s, sig)
        assert s.budget == 100


def test_base_equal_max_is_fixed():
    c = make_controller(CachePolicy(base_size=512, max_size=512, min_recent=128))
    s = c.init_state()
    for sig in (HIGH_ENTROPY, CONFIDENT):
        s = c.update(s, sig)
        assert s.budget == 512


@pytest.mark.parametrize("name", ["window", "streaming", "h2o", "snapkv"])
def test_fixed_baselines_hold_max_size(name):
    c = make_controller(CachePolicy(controller=name, max_size=640, min_recent=128))
    s = c.init_state()
    for sig in (HIGH_ENTROPY, CONFIDENT, SMALL_GAP):
        s = c.update(s, sig)
        assert s.budget == 640
    assert c.evicts and not c.recalls


def test_full_never_evicts():
    c = make_controller(CachePolicy(controller="full"))
    assert not c.evicts and math.isinf(c.init_state().budget)


def test_baseline_shapes():
    p = dict(max_size=256, min_recent=512, sink_tokens=4)
    assert make_controller(CachePolicy(controller="window", **p)).sink_tokens == 0
    streaming = make_controller(CachePolicy(controller="streaming", **p))
    assert streaming.sink_tokens == 4 and streaming.protected_recent == 252  # sinks + recent = max_size
    h2o = make_controller(CachePolicy(controller="h2o", max_size=1024, min_recent=256))
    assert h2o.scorer.name == "h2o" and h2o.prefill_attention == "all" and h2o.protected_recent == 256
    assert h2o.decode_attention == "accumulate"
    snap = make_controller(CachePolicy(controller="snapkv", max_size=1024, min_recent=256))
    assert snap.prefill_attention == "window" and snap.decode_attention == "none"


def test_recency_scorer_option():
    c = dynamic(scorer="recency")
    assert c.scorer.name == "recency" and c.prefill_attention == "none" and c.recalls
    assert isinstance(c.init_state(), BudgetState)
