"""bench/fleet.py's parts that need no cluster: the baseline shape is upstream's example
driver's (one slice, 8 GPUs, no counters), every workload's claim names a DeviceClass its
shape installs, and the scheduler histograms are read as histogram_quantile reads them.
The run itself is `python -m bench fleet` (needs the local cluster); tests/cluster/test_fleet.py
runs its publishing and placement on 50 fake nodes."""

from __future__ import annotations

import pytest

from bench.fleet import SHAPES, baseline_inventory, claim_spec, device_classes, parse_metrics, quantile
from driver.publish import slices


def test_the_baseline_is_one_slice_of_eight_gpus_without_counters():
    built = slices.build(baseline_inventory(), slices.PoolIdentity("gpu.example.com", "n"), 1)
    (only,) = built
    devices = only["spec"]["devices"]
    assert len(devices) == 8 and "sharedCounters" not in only["spec"]
    assert all(len(d["attributes"]) == 4 and "consumesCounters" not in d for d in devices)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_workload_asks_for_classes_its_shape_installs(shape):
    s = SHAPES[shape]
    classes = {c["metadata"]["name"] for c in device_classes(s)}
    for workload in s.workloads:
        for i in range(2):
            spec = claim_spec(workload, s, i)
            for request in spec["devices"]["requests"]:
                assert request["exactly"]["deviceClassName"] in classes, (workload, request)


def test_histogram_quantiles_interpolate_within_the_bucket():
    text = "\n".join([
        '# HELP x_seconds a histogram',
        'x_seconds_bucket{result="scheduled",le="0.01"} 50',
        'x_seconds_bucket{result="scheduled",le="0.1"} 90',
        'x_seconds_bucket{result="scheduled",le="+Inf"} 100',
        'x_seconds_bucket{result="error",le="0.01"} 0',
        'x_seconds_bucket{result="error",le="0.1"} 0',
        'x_seconds_bucket{result="error",le="+Inf"} 7',
    ])
    samples = parse_metrics(text)
    assert quantile(samples, "x_seconds", 0.5, result="scheduled") == pytest.approx(0.01)
    assert quantile(samples, "x_seconds", 0.7, result="scheduled") == pytest.approx(0.055)
    # past the last finite bucket: its bound, as histogram_quantile answers
    assert quantile(samples, "x_seconds", 0.99, result="scheduled") == pytest.approx(0.1)
    assert quantile(samples, "x_seconds", 0.5, result="missing") is None


def test_apf_figures_name_the_level_our_publish_landed_in_and_its_rejections():
    """The window's APF counters (after less before): the flow schema and priority level
    that dispatched the most requests, its rejections by reason, the peaks sampled."""
    from bench.fleet import apf_figures

    def text(ours: int, exempt: int, rejected: int, waited: int) -> str:
        return "\n".join([
            'apiserver_flowcontrol_dispatched_requests_total{flow_schema="service-accounts",priority_level="workload-low"} '
            f'{ours}',
            f'apiserver_flowcontrol_dispatched_requests_total{{flow_schema="exempt",priority_level="exempt"}} {exempt}',
            'apiserver_flowcontrol_rejected_requests_total{flow_schema="service-accounts",priority_level="workload-low",'
            f'reason="queue-full"}} {rejected}',
            'apiserver_flowcontrol_rejected_requests_total{flow_schema="global-default",priority_level="global-default",'
            'reason="time-out"} 5',
            'apiserver_flowcontrol_request_wait_duration_seconds_bucket{execute="true",flow_schema="service-accounts",'
            f'priority_level="workload-low",le="0.1"}} {waited}',
            'apiserver_flowcontrol_request_wait_duration_seconds_bucket{execute="true",flow_schema="service-accounts",'
            f'priority_level="workload-low",le="+Inf"}} {waited}',
            'apiserver_flowcontrol_nominal_limit_seats{priority_level="workload-low"} 245',
        ])

    before = parse_metrics(text(10, 400, 2, 10))
    after = parse_metrics(text(310, 450, 9, 310))
    apf = apf_figures(before, after, {"inqueue/workload-low": 42.0, "executing/workload-low": 7.0})
    assert (apf["flow_schema"], apf["priority_level"], apf["dispatched"]) == ("service-accounts", "workload-low", 300)
    assert apf["rejected"] == {"queue-full": 7} and apf["rejected_all_levels"] == 7
    assert (apf["inqueue_peak"], apf["executing_peak"], apf["seats_limit"]) == (42.0, 7.0, 245)
    assert apf["others"] == {"exempt/exempt": 50} and 0 < apf["wait_p99_ms"] <= 100
