"""The benchmark harness works: each pure benchmark runs end to end on minimal sizes and checks what it measures.

No timing is asserted (figures on a shared machine are not test material); what is asserted is that the harness
measures the real code on the input it claims, that its baselines compute the same answers, and that its results
and the generated table are well formed.
"""

from __future__ import annotations

import dataclasses
import json

import fastavro
import pytest

from bench import attribution, codec, collector, common, ledger, run, simulator, stream
from bench.workload import Fleet
from schemas.records import CostRecord, GpuShare, NodeSample
from schemas.typed import codec_for


def test_attribution_measures_engine_and_baseline_that_agree():
    nodes, ticks, gpus, pods = 2, 75, 2, 2
    figures = attribution.measure(nodes=nodes, ticks=ticks, repeats=1, gpus_per_node=gpus, pods_per_gpu=pods)
    workload = figures["workload"]
    assert workload["messages"] == nodes * ticks
    assert workload["gpu_samples"] == nodes * ticks * gpus
    windows_per_node = -(-ticks // attribution.WINDOW_SECONDS)
    assert workload["share_rows"] == nodes * windows_per_node * gpus * (pods + 4)
    assert figures["max_share_difference"] <= 1e-9
    for variant in ("gpumeter", "baseline"):
        assert figures[variant]["runs"] == 1
        assert figures[variant]["gpu_samples_per_cpu_s"] > 0
    assert set(figures["breakdown"]) == {"decode", "decode_v4_arrays", "decode_v3", "decode_json", "engine"}
    assert all(part["gpu_samples_per_cpu_s"] > 0 for part in figures["breakdown"].values())
    assert workload["avro_v3_bytes_per_message"] > 0
    close = figures["close"]
    for variant in ("summed_as_ticks_arrive", "summed_at_close"):
        # One whole window per node, all closed at once (the rows of both ways are checked equal inside).
        assert close[variant]["node_windows"] == nodes  # the fleet's ticks start at a window's start
        assert close[variant]["close_cpu_ms_per_node_window"] >= 0
        assert close[variant]["ingest_cpu_us_per_message"] > 0


def test_share_comparison_notices_a_disagreement():
    data = attribution.build_input(nodes=1, ticks=61, gpus_per_node=1, pods_per_gpu=2)
    shares = attribution.share_rows(attribution.run_engine(attribution.engine_with_pods(data), data.avro_messages))
    rows = attribution.run_naive(attribution.naive_with_pods(data), data.json_messages)
    assert attribution.max_share_difference(shares, rows) <= 1e-9
    rows[0] = {**rows[0], "memory_share": rows[0]["memory_share"] + 0.01}
    assert attribution.max_share_difference(shares, rows) == pytest.approx(0.01)
    with pytest.raises(AssertionError):
        attribution.max_share_difference(shares, rows[1:])


def test_codec_measures_every_record_type_with_identical_hinted_bytes():
    figures = codec.measure(iterations=2, repeats=1)
    assert set(figures) == {"NodeSample", "PodEvent", "GpuShare", "CostRecord", "Violation", "DeadLetter"}
    for name, f in figures.items():
        assert f["avro"]["bytes"] == f["avro_hinted"]["bytes"], name
        assert f["avro"]["decode_us"] > 0 and f["json"]["decode_us"] > 0
    # 8 GPUs x 8 processes: the columnar Avro message is smaller than its JSON.
    assert figures["NodeSample"]["avro"]["bytes"] < figures["NodeSample"]["json"]["bytes"]


def test_collector_runs_the_real_tick_over_a_replay_of_the_simulator():
    figures = collector.measure(gpus=2, processes_per_gpu=3, ticks=2, repeats=1)
    assert figures["workload"]["processes"] == 6
    assert figures["workload"]["nvml_calls_per_tick"] > 0
    for variant in ("gpumeter", "baseline_uncached_cgroups"):
        assert figures[variant]["cpu_ms_per_tick"] > 0


def test_replayed_nvml_gives_the_collector_the_simulators_answers(tmp_path):
    from services.collector.cgroup import ProcessIdentityCache
    from simulator.scenario import load_scenario

    scenario = load_scenario(collector.scenario_yaml(gpus=1, processes_per_gpu=2, duration_seconds=10))
    rig = collector.CollectorRig(scenario, ticks=2, workdir=tmp_path)
    records = rig.run_ticks(rig.collector(ProcessIdentityCache(rig.proc_root)))
    samples = [codec_for(NodeSample).decode(r.value) for r in records]
    assert len(samples) == 2
    for sample in samples:
        (device,) = sample.devices
        assert len(device.process_pids) == 2
        assert all(i >= 0 for i in device.process_pod_index)  # every process mapped to its pod
        assert device.errors == ()
    service, replay, clock, sink = rig.collector(ProcessIdentityCache(rig.proc_root))
    replay._calls = [(name, result, error) for name, result, error in replay._calls]
    replay._calls[replay._next] = ("nvmlSomethingElse", None, None)
    with pytest.raises(AssertionError):
        rig.run_ticks((service, replay, clock, sink))


def test_simulator_fleet_is_the_cluster_the_benchmark_describes():
    scenario = simulator.load_fleet(3, duration_seconds=120)
    assert [n.name for n in scenario.nodes] == [simulator.node_name(i) for i in range(3)]
    for node in scenario.nodes:
        modes = [gpu.sharing.mode for gpu in node.gpus]
        assert modes == ["exclusive"] * 2 + ["time_slicing"] * 2 + ["mps"] * 2 + ["mig"] * 2
        assert sum(1 for pod in scenario.pods if pod.node == node.name) == 25
    assert simulator.fleet_scenario_yaml(3, 120) == simulator.fleet_scenario_yaml(3, 120)


def test_simulator_bench_measures_every_node_count_and_the_whole_replay():
    figures = simulator.measure((1, 2), duration_seconds=60, replay_nodes=2, repeats=1, node_ticks=2)
    assert set(figures["scenario_side"]) == {"1", "2"}
    for count, side in figures["scenario_side"].items():
        assert side["node_ticks"] == int(count) * 6
        assert side["best_cpu_s"] > 0
    whole = figures["replay"]
    # The scenario side measured and the replay read the same input: every tick of every node, and the pod events.
    assert whole["samples"] == 2 * 6
    assert whole["samples"] + whole["pod_events"] == figures["scenario_side"]["2"]["records"]
    assert whole["share_rows"] > 0 and whole["cost_rows"] > 0 and whole["truth_rows"] > 0
    assert whole["rest_cpu_s"] == pytest.approx(whole["cpu_s"] - whole["scenario_side_cpu_s"], abs=1e-3)
    tick = figures["node_tick"]
    assert tick["nvml_calls_per_node_tick"] == sum(tick["nvml_calls_per_node_tick_by_function"].values())
    assert tick["nvml_calls_per_node_tick_by_function"]["nvmlDeviceGetMigDeviceHandleByIndex"] > 0  # MIG read


def test_ledger_bulk_per_window_and_per_row_store_every_row():
    figures = ledger.measure(windows_per_run=2, repeats=1, postgres=False)
    sqlite = figures["sqlite"]
    assert sqlite["rows_per_run"] == 2 * figures["rows_per_node_window"]
    for variant in ledger.VARIANTS:
        # Every line is in the ledger: a row, or a zero line on its bill (revision 0008).
        stored, on_bills = sqlite[variant]["cost_lines_stored"], sqlite[variant]["zero_lines_on_bills"]
        assert stored + on_bills == 2 * (figures["rows_per_node_window"] - 1)
        assert stored == 2 * len(ledger.stored_lines(ledger.template_window()))
        assert sqlite[variant]["rows_per_wall_s"] > 0


def test_sample_encoder_writes_what_the_codec_writes():
    fleet = Fleet(2, gpus_per_node=2, pods_per_gpu=3)
    encoder = stream.SampleEncoder(fleet, variants=2)
    # Tick 3 carries the device readings of variant 3 % 2 = 1, under its own sequence and times.
    sample = fleet.node_sample(1, 1)
    expected = dataclasses.replace(sample, sequence=3, collector_started_at_unix_ms=111, sampled_at_unix_ms=2_000_123,
                                   interval_ms=987)
    data = encoder.encode(1, 3, 111, 2_000_123, 987)
    assert data == codec_for(NodeSample).encode(expected)
    assert codec_for(NodeSample).decode(data) == expected


@pytest.mark.parametrize("value", [0, 1, -1, 63, -64, 64, 1000, -(2**40), 1_795_975_800_000])
def test_zigzag_matches_fastavro(value):
    import io

    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, fastavro.parse_schema("long"), value)
    assert stream.zigzag(value) == buffer.getvalue()


def test_window_key_is_read_from_shares_and_cost_records():
    records = codec.sample_records()
    share, cost = records["GpuShare"], records["CostRecord"]
    assert stream.window_key_of(codec_for(GpuShare).encode(share)) == (share.node_name, share.window_start_unix_ms)
    assert stream.window_key_of(codec_for(CostRecord).encode(cost)) == (cost.node_name, cost.window_start_unix_ms)


def test_rows_per_node_window_match_billing_output():
    records = codec.sample_records()
    template = ledger.template_window()
    fleet = Fleet(1)
    assert len(template.costs) == stream.rows_per_node_window(fleet)
    assert records["GpuShare"].rows_in_unit == fleet.pods_per_gpu + 4


def test_percentiles_and_latency_summary():
    values = [float(v) for v in range(1, 101)]
    assert stream.percentile(values, 50) == 50.0
    assert stream.percentile(values, 99) == 99.0
    assert stream.percentile(values, 100) == 100.0
    summary = stream.latency_summary(values)
    assert summary["node_windows"] == 100 and summary["max_s"] == 100.0
    assert stream.latency_summary([]) == {"node_windows": 0}


def test_results_and_the_generated_table(tmp_path):
    started = 1_795_975_800.0
    common.write_result("codec", quick=True, figures=codec.measure(iterations=1, repeats=1),
                        targets=[common.Target("codec (no numeric target)", "measure", "x", True)],
                        started_unix_s=started, results_dir=tmp_path)
    common.write_result("collector", quick=True, figures=collector.measure(1, 2, ticks=1, repeats=1),
                        targets=[common.Target("collector tick", "< 10 ms", "1 ms", False, "a cause")],
                        started_unix_s=started, results_dir=tmp_path)
    results = common.read_results(tmp_path)
    assert set(results) == {"codec", "collector"}
    saved = json.loads((tmp_path / "collector.json").read_text())
    assert saved["machine"]["cores_usable"] >= 1 and saved["machine"]["cpu_model"]
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Performance\n\nHand-written intro.\n\n{run.BEGIN}\nold table\n{run.END}\n\nHand-written tail.\n")
    run.update_doc(results_dir=tmp_path, doc_path=doc)
    text = doc.read_text()
    assert "Hand-written intro." in text and "Hand-written tail." in text
    assert "old table" not in text
    assert "**no**: a cause" in text
    assert "collector tick" in text and "(quick)" in text


def test_the_stream_guard_phase_reads_a_guards_partitions_from_its_log_and_judges_the_spread():
    log = ("2026 INFO services.guard.nodes guarding partitions [0, 1, 2, 3] (4 rebuilding)\n"
           "2026 INFO services.guard.nodes guarding partitions [2, 3] (0 rebuilding)\n")
    assert stream._guarded_partitions(log) == [2, 3]
    assert stream._guarded_partitions("no assignment yet") is None
    assert stream._guarded_partitions("guarding partitions [] (0 rebuilding)") == []
    figures = {"workload": {"gpus": 800}, "guard": {
        "1": {"guard_cpu_s_per_1000_gpu_samples": 0.40, "planted_leak_to_violation_s": 0.1},
        "2": {"guard_cpu_s_per_1000_gpu_samples": 0.44, "planted_leak_to_violation_s": 0.2},
        "4": {"guard_cpu_s_per_1000_gpu_samples": 0.80, "planted_leak_to_violation_s": 90.0}}}
    scale, leak = [t for t in stream.targets_for(figures) if t.name.startswith("guard")]
    assert not scale.met and "spread 100%" in scale.measured  # 4 instances at twice the cost: work duplicated
    assert not leak.met  # 90 s: later than one window
    figures["guard"]["4"].update(guard_cpu_s_per_1000_gpu_samples=0.42, planted_leak_to_violation_s=1.0)
    assert all(t.met for t in stream.targets_for(figures) if t.name.startswith("guard"))


def test_the_scale_out_rounds_take_every_count_in_turn_and_group_each_counts_figures():
    import asyncio

    calls = []

    async def phase(count: int, round_: int) -> dict:
        calls.append((count, round_))
        return {"count": count, "round": round_}

    runs = asyncio.run(stream.in_rounds(2, (1, 2, 4), phase))
    assert calls == [(1, 0), (2, 0), (4, 0), (1, 1), (2, 1), (4, 1)]  # 1, 2, 4, then again: not 1, 1, 2, 2
    assert runs == {"1": [{"count": 1, "round": 0}, {"count": 1, "round": 1}],
                    "2": [{"count": 2, "round": 0}, {"count": 2, "round": 1}],
                    "4": [{"count": 4, "round": 0}, {"count": 4, "round": 1}]}


def test_a_scale_out_count_reports_its_round_of_least_cpu_and_every_round_beside_it():
    rounds = [{"guard_cpu_s_per_1000_gpu_samples": 0.0209, "planted_leak_to_violation_s": 75.0, "wall_s": 12.9},
              {"guard_cpu_s_per_1000_gpu_samples": 0.0170, "planted_leak_to_violation_s": 0.4, "wall_s": 10.8}]
    best = stream.least_cpu(rounds, "guard_cpu_s_per_1000_gpu_samples", "planted_leak_to_violation_s")
    assert best["wall_s"] == 10.8  # the whole round of least CPU, not a mix of rounds
    assert best["guard_cpu_s_per_1000_gpu_samples_rounds"] == [0.0209, 0.0170]
    assert best["planted_leak_to_violation_s"] == 0.4
    assert best["planted_leak_to_violation_s_rounds"] == [75.0, 0.4]
    assert "guard_cpu_s_per_1000_gpu_samples_rounds" not in rounds[1]  # the rounds themselves are left as they were
    with pytest.raises(ValueError):
        stream.least_cpu([], "guard_cpu_s_per_1000_gpu_samples")
    figures = {"workload": {"gpus": 800}, "guard": {
        "1": best,
        "2": stream.least_cpu([{"guard_cpu_s_per_1000_gpu_samples": 0.0186, "planted_leak_to_violation_s": 0.2}],
                              "guard_cpu_s_per_1000_gpu_samples", "planted_leak_to_violation_s")}}
    scale, leak = [t for t in stream.targets_for(figures) if t.name.startswith("guard")]
    assert scale.met and "1: 0.017 CPU-s (least of 0.0209, 0.017)" in scale.measured
    assert "2: 0.0186 CPU-s (spread" in scale.measured  # one round: no list
    # The leak must be seen within a window in every round, not only in the round of least CPU (0.4 s).
    assert not leak.met and "1 instance(s): 75.0 s, 0.4 s" in leak.measured


def test_the_stream_billing_phase_reads_an_instances_partitions_from_its_log_and_judges_the_spread():
    topic = "bench.node-window-shares.v1"
    log = (f"2026 INFO billing: assigned [('{topic}', 0), ('{topic}', 1), ('{topic}', 2)]\n"
           f"2026 INFO billing: assigned [('{topic}', 2), ('other.topic', 5), ('{topic}', 11)]\n")
    assert stream._billed_partitions(log, topic) == [2, 11]  # the latest line, this topic's partitions only
    assert stream._billed_partitions("starting", topic) is None
    assert stream._billed_partitions("billing: assigned []", topic) == []
    figures = {"workload": {"gpus": 800}, "billing": {"node_windows": 100, "instances": {
        "1": {"billing_cpu_s_per_1000_node_windows": 10.0, "billing_cpu_s_per_1000_gpu_samples": 0.02},
        "2": {"billing_cpu_s_per_1000_node_windows": 10.5, "billing_cpu_s_per_1000_gpu_samples": 0.021},
        "4": {"billing_cpu_s_per_1000_node_windows": 20.0, "billing_cpu_s_per_1000_gpu_samples": 0.04}}}}
    (scale,) = [t for t in stream.targets_for(figures) if t.name == "billing scale-out"]
    assert not scale.met and "spread 100%" in scale.measured  # 4 instances at twice the cost: work duplicated
    figures["billing"]["instances"]["4"]["billing_cpu_s_per_1000_node_windows"] = 11.0
    (scale,) = [t for t in stream.targets_for(figures) if t.name == "billing scale-out"]
    assert scale.met and "spread 10%" in scale.measured


def test_the_stream_latency_calls_the_attributor_overloaded_only_when_it_took_in_less_than_arrived():
    def figures(arrived: float, taken: float) -> dict:
        return {"workload": {"gpus": 10_000}, "live": {"target": {
            "gpus": 10_000, "offered_gpu_samples_per_s": 10_000, "drain_timeout_s": 120.0,
            "input_lag": {"input_gpu_samples_per_s": arrived, "attributor_committed_gpu_samples_per_s": taken},
            "full_window": {"node_windows_costed": 1250, "node_windows_expected": 1250,
                            "close_to_last_cost_record": {"p50_s": 16.5, "p99_s": 18.7},
                            "close_to_share_record": {"p99_s": 4.76}},
            "cpu_while_sending": {"wall_s": 100.0, "cpu_s": {"attributor": 50.0, "billing": 15.0}}}}}

    def latency(f: dict):
        (t,) = [t for t in stream.targets_for(f) if t.name == "stream latency"]
        return t

    # The generator published 9,597 of the 10,000 it offers and the attributor took all of it in: not overloaded.
    kept_up = latency(figures(9_597.3, 9_575.1))
    assert not kept_up.met and "overloaded" not in kept_up.cause
    assert kept_up.cause.startswith("the close burst") and "within 4.76 s (p99)" in kept_up.cause
    assert "the generator, on the same cores, published 9,597 of the 10,000" in kept_up.cause
    # Less taken in than arrived: overloaded, against what arrived.
    behind = latency(figures(9_900.0, 8_000.0))
    assert behind.cause.startswith("overloaded: the attributor took in 8,000 of the 9,900 GPU-samples/s")
    # A generator that kept its rate is not mentioned.
    full_rate = latency(figures(10_000.0, 9_990.0))
    assert full_rate.cause.startswith("the close burst") and "generator" not in full_rate.cause


def test_the_stream_ceiling_says_when_its_shares_came_out_and_what_billing_did_after_the_last():
    figures = {"workload": {"gpus": 800}, "ceiling": {
        "backlog_nodes": 250, "backlog_messages": 15_000, "gpu_samples_per_s_end_to_end": 17_000.0,
        "ready_to_last_cost_record_s": 7.02, "ready_to_first_share_record_s": 2.83,
        "ready_to_last_share_record_s": 5.33, "cpu_s": {"attributor": 9.36, "billing": 2.79},
        "from_ready": {"cpu_s": {"attributor": 4.71, "billing": 2.75, "guard (nodes)": 1.0}, "cores_busy": 1.47}}}
    (ceiling,) = [t for t in stream.targets_for(figures) if t.name == "stream throughput ceiling"]
    assert not ceiling.met
    # The drain's own CPU (from ready on, not the restart's), when the shares came out, billing's tail after them.
    assert "15,000 messages took 4.71 CPU-s" in ceiling.cause
    assert "2.83-5.33 s after it was ready" in ceiling.cause
    assert "250 node-windows (2.75 CPU-s) ended 1.69 s after the last share" in ceiling.cause
    assert "(1.47 busy)" in ceiling.cause
    figures["ceiling"]["gpu_samples_per_s_end_to_end"] = 20_000.0
    (ceiling,) = [t for t in stream.targets_for(figures) if t.name == "stream throughput ceiling"]
    assert ceiling.met and not ceiling.cause


def _scaling_phase(cpu_s: float, gpu_samples: int = 144_000, gpus: int = 2_000) -> dict:
    return {"attributor_cpu_s": cpu_s, "wall_s": 72.0, "gpu_samples": gpu_samples, "gpus": gpus,
            "attributor_cpu_s_per_1000_gpu_samples": round(cpu_s / gpu_samples * 1000, 4)}


def test_the_stream_attributor_scale_out_says_what_an_added_worker_costs_beside_the_same_load():
    def phase(cpu_s: float, gpu_samples: int = 144_000) -> dict:
        return {"gpu_samples_per_s_end_to_end": 20_000.0, "attributor_cpu_s_per_1000_gpu_samples": 0.2,
                "steady": _scaling_phase(cpu_s, gpu_samples)}

    figures = {"workload": {"gpus": 800}, "scaling": {"1": phase(9.0), "2": phase(9.72), "4": phase(13.32)}}
    (scale,) = [t for t in stream.targets_for(figures) if t.name == "attributor scale-out (CPU)"]
    assert not scale.met and "spread 48%" in scale.measured and scale.measured.startswith("at 2,000 GPUs @ 1 Hz")
    # 0.72 CPU-s over 72 s for one added worker; 4.32 over 72 s for three.
    assert "1.0 % of a core (2 workers), 2.0 % of a core (4 workers)" in scale.cause
    assert "12.5 % of a core with one worker" in scale.cause
    figures["scaling"]["4"] = phase(9.9)
    figures["scaling"]["2"] = phase(9.45)
    (scale,) = [t for t in stream.targets_for(figures) if t.name == "attributor scale-out (CPU)"]
    assert scale.met and not scale.cause


def test_the_stream_attributor_scale_out_is_judged_at_the_fleet_load_and_reports_the_light_one():
    """The fleet's load (``steady_fleet``) decides; the drain's nodes alone (``steady``) are reported beside it with
    what an added worker costs there."""
    def phase(fleet_cpu_s: float, light_cpu_s: float) -> dict:
        return {"gpu_samples_per_s_end_to_end": 20_000.0, "attributor_cpu_s_per_1000_gpu_samples": 0.2,
                "steady_fleet": _scaling_phase(fleet_cpu_s, 720_000, 10_000),
                "steady": _scaling_phase(light_cpu_s, 144_000, 2_000)}

    figures = {"workload": {"gpus": 10_000},
               "scaling": {"1": phase(42.0, 8.5), "2": phase(42.6, 9.4), "4": phase(43.7, 10.2)}}
    (scale,) = [t for t in stream.targets_for(figures) if t.name == "attributor scale-out (CPU)"]
    assert scale.met and not scale.cause
    assert scale.measured.startswith("at 10,000 GPUs @ 1 Hz: 1: 0.0583 CPU-s; 2: 0.0592 CPU-s; 4: 0.0607 CPU-s "
                                     "(spread 4%); at 2,000 GPUs @ 1 Hz: 1: 0.059; 2: 0.0653; 4: 0.0708 (spread 20%")
    assert "1.3 % of a core (2 workers), 0.8 % of a core (4 workers)" in scale.measured  # 0.9 / 72 s; 1.7 / 3 / 72 s
    figures["scaling"]["4"] = phase(50.4, 10.2)
    figures["scaling"]["4"]["steady_fleet"]["assignments_during_load"] = 2
    (scale,) = [t for t in stream.targets_for(figures) if t.name == "attributor scale-out (CPU)"]
    assert not scale.met and "spread 20%" in scale.measured and scale.cause
    # A rebalance inside the measured load is named beside the count it happened to.
    assert "4: 0.07 CPU-s (2 assignment(s) during the load)" in scale.measured
    assert "1: 0.0583 CPU-s;" in scale.measured
    # Measured in rounds: the round of least CPU decides, every round named beside it.
    figures["scaling"]["1"]["steady_fleet"] = stream.least_cpu(
        [_scaling_phase(46.0, 720_000, 10_000), _scaling_phase(42.0, 720_000, 10_000)],
        "attributor_cpu_s_per_1000_gpu_samples")
    (scale,) = [t for t in stream.targets_for(figures) if t.name == "attributor scale-out (CPU)"]
    assert "1: 0.0583 CPU-s (least of 0.0639, 0.0583);" in scale.measured


def test_the_fleet_load_waits_for_every_worker_ready_since_its_latest_assignment():
    topic = "bench.node-samples"
    first = (f"Setting newly assigned partitions {{TopicPartition(topic='{topic}', partition=8), "
             f"TopicPartition(topic='pods', partition=5), TopicPartition(topic='{topic}', partition=2)}} for group g\n")
    assert stream._assigned_partitions("starting\n", topic) is None
    assert stream._assigned_partitions(first, topic) is None  # assigned, not ready yet
    ready = first + "[^---SafeSeekRecovery]: Worker ready\n"
    assert stream._assigned_partitions(ready, topic) == [2, 8]  # this topic's partitions only
    again = ready + ("Heartbeat failed for group g because it is rebalancing\n"
                     f"Setting newly assigned partitions {{TopicPartition(topic='{topic}', partition=8)}} for group g\n")
    assert stream._assigned_partitions(again, topic) is None  # reassigned: not ready since
    assert stream._assigned_partitions(again + "Worker ready\n", topic) == [8]


def test_the_stream_memory_figures_read_a_processs_resident_set_from_proc():
    import os

    mine = stream.process_memory_bytes(os.getpid())
    assert mine is not None and 0 < mine["rss_bytes"] <= mine["peak_rss_bytes"]
    ballast = bytearray(64 * 2**20)  # touched pages: the resident set grows by them
    grown = stream.process_memory_bytes(os.getpid())
    assert grown["peak_rss_bytes"] >= mine["rss_bytes"] + 60 * 2**20
    del ballast
    assert stream.process_memory_bytes(2**22 + 12345) is None  # no such process
    assert stream.process_tree_cpu_s(os.getpid()) > 0
    figures = {"workload": {"gpus": 10_000}, "memory": {
        "when": "after the live phase at 10,000 GPUs", "gpus": 10_000, "pods": 80_000,
        "services": {"attributor": {"rss_bytes": 300 * 2**20, "peak_rss_bytes": 400 * 2**20}, "gone": None}},
        "guard": {"1": {"guard_cpu_s_per_1000_gpu_samples": 0.4, "planted_leak_to_violation_s": 0.1,
                        "memory": [{"rss_bytes": 100 * 2**20, "peak_rss_bytes": 150 * 2**20}]}}}
    (memory,) = [t for t in stream.targets_for(figures) if t.name.startswith("memory")]
    assert "attributor 300 MiB (peak 400)" in memory.measured
    assert "each guard instance at most 150 MiB peak" in memory.measured
    assert "PostgreSQL" not in memory.measured  # no billing scale-out: no ledger server measured


def test_the_stream_reads_a_process_trees_proportional_memory_and_names_the_ledgers():
    import os
    import subprocess
    import sys

    alone = stream.process_tree_pss_bytes(os.getpid())
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; b = bytearray(64 * 2**20); b[::4096] = b'x' * 16384; time.sleep(30)"])
    try:
        import time
        deadline = time.monotonic() + 20
        while True:  # the child's 64 MiB once it has touched every page of them
            with_child = stream.process_tree_pss_bytes(os.getpid())
            if with_child >= alone + 60 * 2**20 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert with_child >= alone + 60 * 2**20
    finally:
        child.kill()
        child.wait()
    assert stream.process_tree_pss_bytes(2**22 + 12345) is None  # no such process
    figures = {"workload": {"gpus": 10_000}, "memory": {
        "when": "after the live phase at 10,000 GPUs", "gpus": 10_000, "pods": 80_000, "services": {}},
        "billing": {"node_windows": 100, "instances": {
            "1": {"billing_cpu_s_per_1000_node_windows": 10.0, "billing_cpu_s_per_1000_gpu_samples": 0.02,
                  "postgresql_pss_bytes": 90 * 2**20},
            "2": {"billing_cpu_s_per_1000_node_windows": 10.0, "billing_cpu_s_per_1000_gpu_samples": 0.02,
                  "postgresql_pss_bytes": 120 * 2**20}}}}
    (memory,) = [t for t in stream.targets_for(figures) if t.name.startswith("memory")]
    assert "the billing scale-out's PostgreSQL at most 120 MiB" in memory.measured


def test_the_month_fleet_prices_each_node_window_as_billing_does_with_churn_and_spread_labels():
    from bench import ledger_month

    fleet = ledger_month.MonthFleet(nodes=3)
    windows = [w for batch in fleet.batches(0, 2, size=4) for w in batch]
    assert [(w.bill.node_name, w.bill.window_start_unix_ms) for w in windows] == [
        (ledger_month.node_name(n), fleet.start_unix_ms + m * ledger_month.WINDOW_MS) for m in range(2)
        for n in range(3)]
    for window in windows:
        # Every node-window's lines add up to its bill and all carry its key.
        assert sum(c.cost_micro_usd for c in window.costs) == window.bill.node_cost_micro_usd
        assert {(c.node_name, c.window_start_unix_ms) for c in window.costs} == {
            (window.bill.node_name, window.bill.window_start_unix_ms)}
    # Nodes differ in namespaces and teams; a node's pods are new ones after its epoch turns.
    first = ledger_month.node_record(fleet.template, 0, 0)
    second = ledger_month.node_record(fleet.template, 1, 0)
    assert {p.namespace for p in first.pods} != {p.namespace for p in second.pods}
    assert [p.labels["team"] for p in first.pods] != [p.labels["team"] for p in second.pods]
    turned = ledger_month.node_record(fleet.template, 0, 1)
    assert not {p.pod_uid for p in first.pods} & {p.pod_uid for p in turned.pods}
    # Node 3's pods live 5 hours, out of step with the run's start by 3 hours: 15 hours see 4 pod epochs.
    assert [ledger_month.epoch_of(3, hour * 60) for hour in range(15)] == [0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2,
                                                                            3, 3, 3]


def test_the_month_storage_scales_minutes_and_hours_with_time_and_days_with_days():
    sizes = {"cost_lines": 1_000, "node_bills": 200, "cost_rollup_hourly": 50, "cost_rollup_daily": 10,
             "price_versions": 7}
    rows = {"cost_lines": 10, "node_bills": 2, "cost_rollup_hourly": 5, "cost_rollup_daily": 1}
    from bench import ledger_month

    out = ledger_month.storage_per_1000_gpu_days(sizes, rows, hours_written=2, gpus=500)
    assert out["minute"]["bytes_per_1000_gpu_days"] == 1_200 * 12 * 2
    assert out["minute"]["rows_per_1000_gpu_days"] == 12 * 12 * 2
    assert out["hour"]["bytes_per_1000_gpu_days"] == 50 * 12 * 2
    assert out["day"]["bytes_per_1000_gpu_days"] == 10 * 2
    assert out["other"] == {"tables": ["price_versions"], "bytes": 7}
    assert out["default_retention_bytes_for_1000_gpus"] == (
        1_200 * 24 * ledger_month.MINUTE_RETENTION_DAYS + 50 * 24 * ledger_month.HOUR_RETENTION_DAYS
        + 10 * 2 * ledger_month.DAY_RETENTION_DAYS)


def test_replay_bench_replays_a_recorded_fleet_and_times_every_stage():
    from bench import replay as replay_bench
    from pipeline.replay import REPLAY_STAGES

    figures = replay_bench.measure_recording(2, 120)
    assert figures["samples"] == 2 * 120 // 10 and figures["gpu_samples"] == figures["samples"] * 8
    assert figures["frames"] > figures["samples"] and figures["bills"] > 0
    assert set(figures["stage_cpu_s"]) == set(REPLAY_STAGES)
    assert figures["gpu_samples_per_cpu_s"] > 0


def test_gpu_machine_scaleout_splits_the_same_work_among_workers():
    from bench import gpu_machine

    result = gpu_machine.scaleout(total_nodes=4, ticks=5, workers=(1, 2, 4))
    rows = result["rows"]
    assert [r["workers"] for r in rows] == [1, 2, 4]
    # The same GPU-samples in every row: the workers split the nodes, none attributes another's.
    assert {r["gpu_samples"] for r in rows} == {4 * 5 * 8}
    assert rows[0]["speedup"] == 1.0 and all(r["wall_s"] > 0 and r["cpu_s"] > 0 for r in rows)


def test_gpu_machine_summary_reads_context_bytes_and_sm_from_the_ticks():
    from bench import gpu_machine

    class Done:
        pass

    info = {"alloc_mib": 2, "busy_fraction": 0.5, "realloc_every_s": 0.0, "pid": 7, "lines": [{"t_s": 1}],
            "stderr": "", "returncode": 0}
    other = {**info, "pid": 8, "alloc_mib": 0, "busy_fraction": 0.0, "lines": []}
    device = {"index": 0, "process_pids": [7, 8], "process_used_memory_bytes": [(2 << 20) + 500, 500],
              "process_sm_utilization_percent": [60, 0], "memory_used_bytes": (2 << 20) + 1100,
              "memory_reserved_bytes": 9, "errors": [], "sharing_mode": "TIME_SLICING", "mps_server_pids": []}
    ticks = [{"backend": [device], "raw": {"process_utilization": [{"pid": 7, "smUtil": 60}]}}] * 3
    summary = gpu_machine._summarise("time_sliced", [(Done(), info), (Done(), other)], ticks)
    first, second = summary["processes"]
    assert first["context_bytes_min_max"] == [500, 500] and second["context_bytes_min_max"] == [500, 500]
    assert first["sm_percent_backend_mean"] == 60 and first["sm_percent_raw_samples"] == 3
    assert second["sm_percent_raw_mean"] is None
    assert summary["device0_memory_used_minus_listed_bytes"] == [100, 100, 100]
    targets = gpu_machine.targets_from({"time_sliced": summary}, None)
    assert [t.name for t in targets] == ["NVML per-process memory on a real GPU (no numeric target)",
                                         "NVML per-process SM utilization, time-sliced real GPU (no numeric target)"]
    assert "allocated + 500 B" in targets[0].measured and targets[0].met


def test_device_results_are_shown_but_do_not_name_the_bench_machine():
    local = {"cores_usable": 2, "cpu_model": "here", "python": "3.11"}
    device = {"cores_usable": 16, "cpu_model": "there", "python": "3.12"}
    target = {"name": "t", "goal": "g", "measured": "m", "met": True, "cause": ""}
    results = {
        "codec": {"machine": local, "started_at_unix_s": 0, "targets": [target], "figures": {}, "notes": []},
        "gpu_machine": {"machine": device, "started_at_unix_s": 0, "targets": [{**target, "name": "device row"}],
                        "figures": {}, "notes": []},
    }
    table = run.render_table(results)
    assert table.splitlines()[0] == "Machine: 2 usable cores, here, Python 3.11."
    assert "| device row |" in table


def test_the_month_counts_the_bills_rows_and_dictionaries_with_the_minute_grain_and_ab_only_writable_revisions():
    from bench import ledger_month

    for table in ("node_bill_rows", "ledger_bill_kinds", "ledger_bill_names", "ledger_zero_sets", "node_bills"):
        assert ledger_month.GRAIN_OF_TABLE[table] == "minute"
    # Head's writer writes a ledger from 0017 on (its hourly FOCUS charges' ids), not 0015's: the bills' A/B runs.
    assert ledger_month.head_writes("0017_focus_line_ids") and ledger_month.head_writes("head")
    assert not ledger_month.head_writes("0015_focus_hourly")
    assert all(ledger_month.head_writes(r) for r in ledger_month.BILLS_AB_REVISIONS)
