"""Every Prometheus metric gpumeter exports, in one registry of names.

Services create their metrics through ``ServiceMetrics(service)``, which builds them on a private
``CollectorRegistry`` (so tests and several services in one process never collide) from the definitions below,
and holds the service's liveness ``Heartbeat`` and, for a consumer, its ``DeadLetterWindow`` (``gpumeter.health``):
``serve(port)`` answers ``/metrics`` and ``/healthz`` on one port.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from gpumeter.clock import Clock, SystemClock
from gpumeter.settings import DeadLetterHealthSettings
from gpumeter.health import (
    DEFAULT_MAX_SILENCE_SECONDS,
    DEFAULT_MAX_STALL_SECONDS,
    DeadLetterWindow,
    Heartbeat,
    health_wsgi_app,
)


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # counter | gauge | histogram
    doc: str
    labels: tuple[str, ...] = ()


# dcgm-exporter's names for the labels of a pod's GPU (NVIDIA/dcgm-exporter, internal/pkg/rendermetrics), beside
# ``namespace`` and ``pod``: billing's per-pod series carry them so that dashboards join them with ``DCGM_FI_*``
# series on labels (docs/billing.md, "Prometheus metrics"). ``UUID`` is the physical GPU's (a MIG instance's
# parent's), ``Hostname`` and ``hostname`` both the node's name: ``Hostname`` in every release up to 4.5.3-4.8.2,
# ``hostname`` since the rename of #655.
DCGM_JOIN_LABELS = ("container", "UUID", "GPU_I_PROFILE", "GPU_I_ID", "modelName", "Hostname", "hostname")

METRICS: dict[str, MetricDef] = {
    m.name: m
    for m in (
        # collector
        MetricDef("gpumeter_collector_ticks_total", "counter", "Collector ticks run."),
        MetricDef("gpumeter_collector_tick_seconds", "histogram", "Wall time of one collector tick."),
        MetricDef("gpumeter_collector_samples_sent_total", "counter", "NodeSample records acknowledged by Kafka."),
        MetricDef("gpumeter_collector_pod_events_sent_total", "counter", "PodEvent records acknowledged by Kafka."),
        MetricDef("gpumeter_collector_nvml_errors_total", "counter", "NVML errors recorded in samples.",
                  ("nvml_function", "error_code")),
        MetricDef("gpumeter_collector_buffer_depth", "gauge", "Records waiting in the local buffer for Kafka."),
        MetricDef("gpumeter_collector_buffer_dropped_total", "counter", "Records dropped because the buffer was full."),
        MetricDef("gpumeter_collector_undeliverable_records_total", "counter",
                  "Records Kafka would not take (too large, or failing while others went through), given up: "
                  "replaced by a dead letter, or dropped.", ("kind", "outcome")),
        MetricDef("gpumeter_collector_unmapped_processes_total", "counter", "GPU processes mapped to no known pod."),
        MetricDef("gpumeter_collector_kubelet_unavailable_total", "counter",
                  "Ticks where the kubelet PodResources API could not be reached (cgroup-only mapping)."),
        MetricDef("gpumeter_collector_pod_watch_restarts_total", "counter", "Pod watch reconnects and relists.",
                  ("reason",)),
        MetricDef("gpumeter_collector_namespace_watch_restarts_total", "counter",
                  "Namespace watch reconnects and relists (403: the collector's ClusterRole lacks namespaces).",
                  ("reason",)),
        MetricDef("gpumeter_collector_dra_devices_unresolved_total", "counter",
                  "DRA claim devices of gpu.nvidia.com published without a GPU uuid (in no ResourceSlice, or no uuid): "
                  "their pods' GPU use is unassigned."),
        MetricDef("gpumeter_collector_pod_warnings_total", "counter",
                  "Pod objects read with a part left out (HAMI_ANNOTATION_IGNORED: a HAMi allocation annotation "
                  "HAMi would not have written; HAMI_ANNOTATION_UNTRUSTED: a container's HAMi allocation the "
                  "kubelet's device ids do not back, published without it).", ("reason",)),
        # every consumer
        MetricDef("gpumeter_messages_consumed_total", "counter", "Input messages consumed.", ("service", "topic")),
        MetricDef("gpumeter_dead_letters_total", "counter", "Input messages dead-lettered.",
                  ("service", "topic", "reason_code")),
        MetricDef("gpumeter_dead_letters_truncated_total", "counter",
                  "Dead letters whose value, key or reason was cut to fit the producer's max request size.",
                  ("service", "topic")),
        MetricDef("gpumeter_recent_dead_letter_ratio", "gauge",
                  "Share of the input messages of the last GPUMETER_DEAD_LETTER_WINDOW_SECONDS that were dead-lettered "
                  "(0 without input); above GPUMETER_DEAD_LETTER_MAX_RATIO /healthz says degraded.", ("service",)),
        # attributor
        MetricDef("gpumeter_attributor_windows_closed_total", "counter", "Node windows attributed and emitted."),
        MetricDef("gpumeter_attributor_shares_emitted_total", "counter", "GpuShare records emitted."),
        MetricDef("gpumeter_attributor_window_lag_seconds", "gauge",
                  "Seconds between a window's close (end + grace) and its emission."),
        MetricDef("gpumeter_attributor_node_clock_skew_seconds", "gauge",
                  "How far a node's clock is off the broker's append time (+ ahead), as corrected: 0 while within "
                  "the skew threshold.", ("node",)),
        MetricDef("gpumeter_attributor_second_collector_ticks_total", "counter",
                  "Ticks of a node's older collector still writing after a newer one started: two collectors for one "
                  "node, merged into its windows.", ("node",)),
        # billing: the per-pod series carry dcgm-exporter's labels too (DCGM_JOIN_LABELS)
        MetricDef("gpumeter_pod_gpu_cost_micro_usd_total", "counter",
                  "GPU cost billed to a pod for its own use (its direct lines), per GPU it used.",
                  ("namespace", "pod", "team", *DCGM_JOIN_LABELS)),
        MetricDef("gpumeter_pod_shared_cost_micro_usd_total", "counter",
                  "Cost of a bucket of the pod's node-windows shared to it by the sharing policy (its shared lines).",
                  ("namespace", "pod", "team", "shared_from", *DCGM_JOIN_LABELS)),
        MetricDef("gpumeter_pod_gpu_memory_share", "gauge", "Pod's memory share of its GPU unit in the last window.",
                  ("namespace", "pod", "team", "gpu_uuid", *DCGM_JOIN_LABELS)),
        MetricDef("gpumeter_pod_gpu_compute_share", "gauge", "Pod's compute share of its GPU unit in the last window.",
                  ("namespace", "pod", "team", "gpu_uuid", *DCGM_JOIN_LABELS)),
        MetricDef("gpumeter_node_cost_micro_usd_total", "counter", "Node bills priced.", ("node", "instance_type")),
        MetricDef("gpumeter_bucket_cost_micro_usd_total", "counter",
                  "Cost billed to no pod: idle, driver_reserved, unattributed, unavailable or node_other lines the "
                  "sharing policy kept.", ("node", "kind")),
        MetricDef("gpumeter_billing_ledger_rows_written_total", "counter", "Cost lines inserted into the ledger."),
        MetricDef("gpumeter_billing_duplicate_rows_total", "counter", "Cost lines already in the ledger (redelivery)."),
        # api (the ledger's read-only HTTP API)
        MetricDef("gpumeter_api_requests_total", "counter", "HTTP requests answered, by path and status code.",
                  ("path", "code")),
        MetricDef("gpumeter_api_request_seconds", "histogram", "Time to answer one HTTP request.", ("path",)),
        # record (gpumeter record: the live input topics into recordings)
        MetricDef("gpumeter_record_frames_total", "counter", "Messages written into recordings as frames (pod-state "
                  "snapshot frames at a file's start not counted)."),
        MetricDef("gpumeter_record_payload_bytes_total", "counter",
                  "Bytes of the messages written as frames, before compression."),
        MetricDef("gpumeter_record_files_finished_total", "counter",
                  "Recording files finished (synced, renamed to their final name)."),
        MetricDef("gpumeter_record_syncs_total", "counter",
                  "fsyncs of the open recording, each followed by a commit of the offsets it covers."),
        # guard
        MetricDef("gpumeter_guard_violations_firing", "gauge", "Violations firing now.", ("rule", "severity")),
        MetricDef("gpumeter_guard_violation_transitions_total", "counter", "Violation state changes.",
                  ("rule", "state")),
    )
}


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass  # a scrape every few seconds is not news


# What ``MetricWrapperBase.__init__`` gives a parent and never a child: the rest of a parent's attributes are what a
# child made by ``labels()`` has before ``_metric_init`` (prometheus_client 0.26; ``child_factory`` checks it).
_PARENT_ONLY_ATTRIBUTES = frozenset({"_lock", "_metrics"})


def child_factory(metric):
    """A function ``label values -> child`` of the labelled ``metric`` (a prometheus_client ``Counter`` or
    ``Gauge``), equal to ``metric.labels(*values)`` (the same child object for the same values, values that are not
    ``str`` converted by ``str`` as ``labels`` does, the same series in the exposition, removed by
    ``metric.remove``) but several times cheaper for values not seen before:
    ``labels()`` builds each new child through the constructor, which validates every label name of the parent again
    (a regular expression per name, ~25 us of a billing node-window's ~230 new series each), where this copies the
    parent's validated attributes and runs the child's own ``_metric_init``. ``values``: a tuple of the metric's
    label count (``ValueError`` otherwise, as ``labels`` raises).

    Falls back to ``labels()`` where the parent's attributes are not the ones this relies on (another
    prometheus_client version): never a wrong child, at worst the slow one."""
    parent_state = {k: v for k, v in vars(metric).items() if k not in _PARENT_ONLY_ATTRIBUTES}
    label_count = len(getattr(metric, "_labelnames", ()))
    usable = (type(metric) in (Counter, Gauge) and label_count > 0 and parent_state.get("_labelvalues") == ()
              and isinstance(getattr(metric, "_metrics", None), dict) and hasattr(metric, "_lock")
              and hasattr(metric, "_metric_init"))
    if not usable:
        return lambda values: metric.labels(*values)
    children = metric._metrics
    lock = metric._lock
    cls = type(metric)
    new = object.__new__
    parent_items = tuple(parent_state.items())

    def child(values: tuple[str, ...]):
        found = children.get(values)
        if found is not None:
            return found
        if len(values) != label_count:
            raise ValueError(f"{metric}: {len(values)} label values for {label_count} label names")
        if not all(type(v) is str for v in values):
            values = tuple(str(v) for v in values)  # what labels() makes of them
            found = children.get(values)
            if found is not None:
                return found
        made = new(cls)
        # Attribute by attribute, not ``__dict__.update``: the instance keeps CPython's compact attribute storage
        # (a materialized ``__dict__`` makes every later ``inc``/``set`` on the child slower).
        for name, value in parent_items:
            setattr(made, name, value)
        made._kwargs = dict(parent_state["_kwargs"])
        made._labelvalues = values
        made._metric_init()
        with lock:
            return children.setdefault(values, made)

    return child


class ServiceMetrics:
    """The metrics of one service on their own registry, and its liveness heartbeat. ``get(name)`` returns the
    prometheus object; ``beat()`` marks the service's loop as going round and ``progress()`` where it is on its input
    (``gpumeter.health``)."""

    def __init__(self, service: str, names: tuple[str, ...] | None = None, *, clock: Clock | None = None,
                 max_silence_seconds: float = DEFAULT_MAX_SILENCE_SECONDS,
                 max_stall_seconds: float = DEFAULT_MAX_STALL_SECONDS,
                 dead_letters: DeadLetterHealthSettings | None = None) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        # Infrastructure, not logic: the heartbeat measures real silence, so the real clock unless a test passes one.
        clock = clock or SystemClock()
        self.heartbeat = Heartbeat(clock, max_silence_seconds, max_stall_seconds)
        # Every consumer's recent dead-letter rate (what its runner reports); the defaults unless its settings say.
        limits = dead_letters or DeadLetterHealthSettings()
        self.dead_letters = DeadLetterWindow(clock, limits.window_seconds, limits.max_ratio, limits.min_inputs)
        self.server: WSGIServer | None = None
        self._metrics = {}
        for name in names or tuple(METRICS):
            definition = METRICS[name]
            metric_type = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}[definition.kind]
            # prometheus_client appends _total to counters itself.
            base = name[: -len("_total")] if definition.kind == "counter" and name.endswith("_total") else name
            self._metrics[name] = metric_type(base, definition.doc, definition.labels, registry=self.registry)
        if "gpumeter_recent_dead_letter_ratio" in self._metrics:
            self._metrics["gpumeter_recent_dead_letter_ratio"].labels(service).set_function(
                lambda: self.dead_letters.rate().ratio)

    def get(self, name: str):
        return self._metrics[name]

    def beat(self) -> None:
        self.heartbeat.beat()

    def progress(self, name: str, position, waiting: bool) -> None:
        """A loop's position on its input (``gpumeter.health.Heartbeat.progress``)."""
        self.heartbeat.progress(name, position, waiting)

    def inputs(self, count: int = 1, dead_letters: int = 0) -> None:
        """``count`` input messages taken, ``dead_letters`` messages dead-lettered (``DeadLetterWindow.record``)."""
        self.dead_letters.record(count, dead_letters)

    def wsgi_app(self):
        """``/healthz`` from the heartbeat and the dead-letter window, every other path the Prometheus exposition of
        this registry."""
        return health_wsgi_app(self.heartbeat, make_wsgi_app(self.registry), self.dead_letters)

    def serve(self, port: int, addr: str = "0.0.0.0", app=None) -> WSGIServer | None:
        """Serve ``/metrics`` and ``/healthz`` on ``port`` from a daemon thread (0 disables); returns the server.
        ``app`` (a WSGI app given this service's ``wsgi_app()`` to fall back to) serves other paths on the same
        port: one HTTP server per process."""
        if not port:
            return None
        server = make_server(addr, port, app or self.wsgi_app(), server_class=_ThreadingWSGIServer,
                             handler_class=_QuietHandler)
        threading.Thread(target=server.serve_forever, name=f"{self.service}-metrics", daemon=True).start()
        self.server = server
        return server
