"""``rollout.speculative`` on the vLLM engine: the ``speculative_config`` it starts with, and the acceptance it
logs from vLLM's counters (vLLM itself is not needed: the driver runs on a stand-in here)."""

from types import SimpleNamespace

import pytest

from tidal.rollout.local import SamplingConfig
from tidal.rollout.speculative import SpeculativeConfig
from tidal.rollout.vllm_engine import VllmDriver
from tidal.rollout.vllm_options import VllmOptions, spec_counts, speculative_config


@pytest.mark.parametrize("spec,expected", [
    (SpeculativeConfig(), None),
    (SpeculativeConfig(method="ngram", num_draft_tokens=5, ngram_max=4, ngram_min=2),
     {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}),
    (SpeculativeConfig(method="draft_model", draft_model="/m/draft"),
     {"method": "draft_model", "num_speculative_tokens": 4, "model": "/m/draft"}),
    (SpeculativeConfig(method="mtp", num_draft_tokens=1), {"method": "mtp", "num_speculative_tokens": 1}),
])
def test_rollout_speculative_maps_to_vllm_names(spec, expected):
    assert speculative_config(spec, VllmOptions()) == expected
    assert speculative_config(None, VllmOptions()) is None


def test_raw_speculative_config_passes_through():
    raw = {"method": "eagle3", "model": "/m/eagle", "num_speculative_tokens": 3}
    assert speculative_config(SpeculativeConfig(method="ngram"), VllmOptions(speculative_config=raw)) == raw


class _MetricsLLM:
    """What the driver reads of ``vllm.LLM`` for acceptance: ``get_metrics()`` counters (name, value)."""

    def __init__(self):
        self.llm_engine = SimpleNamespace()
        self.counters = {"vllm:spec_decode_num_draft_tokens": 0.0, "vllm:spec_decode_num_accepted_tokens": 0.0}

    def get_metrics(self):
        return [SimpleNamespace(name="vllm:num_requests_running", value=3.0),
                *(SimpleNamespace(name=k, value=v) for k, v in self.counters.items())]


def test_driver_logs_acceptance_per_read():
    llm = _MetricsLLM()
    driver = VllmDriver("unused", SamplingConfig(), llm=llm, sampling_params_cls=dict)
    llm.counters |= {"vllm:spec_decode_num_draft_tokens": 40.0, "vllm:spec_decode_num_accepted_tokens": 30.0}
    stats = driver.stats()
    assert stats["rollout/spec_acceptance"] == 0.75 and stats["rollout/spec_drafted_tokens"] == 40.0
    llm.counters |= {"vllm:spec_decode_num_draft_tokens": 60.0, "vllm:spec_decode_num_accepted_tokens": 35.0}
    assert driver.stats()["rollout/spec_acceptance"] == 0.25  # 5 of the 20 drafted since the last read


def test_no_counters_no_acceptance():
    assert spec_counts([SimpleNamespace(name="vllm:num_requests_running", value=1.0)]) is None
    assert spec_counts([SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=8.0)]) == (8.0, 0.0)


def test_no_acceptance_read_when_vllm_stats_are_off():
    """vLLM's ``LLM.get_metrics`` asserts ``log_stats`` (off unless speculative decoding turned it on): a run
    without drafts must not ask (CI's vLLM quickstart crashed on that at its first logged step)."""
    llm = _MetricsLLM()
    llm.llm_engine = SimpleNamespace(log_stats=False)

    def get_metrics():
        raise AssertionError("Stat logging disabled")  # what vLLM 0.32 does with log_stats off

    llm.get_metrics = get_metrics
    stats = VllmDriver("unused", SamplingConfig(), llm=llm, sampling_params_cls=dict).stats()
    assert "rollout/spec_acceptance" not in stats and "rollout/interruptions" in stats
