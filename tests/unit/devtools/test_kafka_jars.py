"""Kafka's jars without Maven: the committed pin list, checksummed downloads from a repository, and the resolver
that wrote the list.

Downloads go to a repository of our own on loopback (``http.server`` over a folder in Maven Central's layout), so
the real ``urllib`` path runs, including a repository that serves the wrong bytes.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import threading
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from gpumeter.devtools import kafka_jars
from gpumeter.devtools.kafka_jars import (
    Dependency,
    JarChecksumMismatch,
    KafkaJarsError,
    PinnedJar,
    Resolver,
    artifact_url,
    ensure_jars,
    parse_lock,
)


def pinned(group: str, artifact: str, version: str, body: bytes) -> PinnedJar:
    return PinnedJar(group, artifact, version, hashlib.sha256(body).hexdigest(), len(body))


class Repository:
    """A folder in Maven Central's layout served on loopback; counts the requests it answers."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.requests: list[str] = []
        repository = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                repository.requests.append(self.path)
                super().do_GET()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                                      functools.partial(Handler, directory=str(root)))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/"

    def publish(self, jar: PinnedJar, body: bytes) -> None:
        path = self.root / artifact_url("", jar.group, jar.artifact, jar.version, "jar").lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def repository(tmp_path):
    repo = Repository(tmp_path / "repository")
    yield repo
    repo.close()


ALPHA = b"alpha jar bytes" * 1000
BETA = b"beta jar bytes" * 100


@pytest.mark.network
def test_jars_are_downloaded_verified_and_then_used_from_the_cache(repository, tmp_path):
    jars = [pinned("org.example", "alpha", "1.0", ALPHA), pinned("org.example.sub", "beta", "2.1", BETA)]
    for jar, body in zip(jars, (ALPHA, BETA)):
        repository.publish(jar, body)
    messages: list[str] = []

    paths = ensure_jars(tmp_path / "cache", jars=jars, repository=repository.url, log=messages.append)

    assert paths == [tmp_path / "cache" / "kafka" / "libs" / "alpha-1.0.jar",
                     tmp_path / "cache" / "kafka" / "libs" / "beta-2.1.jar"]
    assert [p.read_bytes() for p in paths] == [ALPHA, BETA]
    assert sorted(repository.requests) == ["/org/example/alpha/1.0/alpha-1.0.jar",
                                           "/org/example/sub/beta/2.1/beta-2.1.jar"]
    assert "downloading 2 of 2 jars (16 kB)" in messages[0]  # says what and how big before it starts
    assert sorted(p.name for p in paths[0].parent.iterdir()) == ["alpha-1.0.jar", "beta-2.1.jar"]  # no leftovers

    messages.clear()
    assert ensure_jars(tmp_path / "cache", jars=jars, repository=repository.url, log=messages.append) == paths
    assert len(repository.requests) == 2 and messages == []  # nothing downloaded again, nothing said


@pytest.mark.network
def test_a_download_that_does_not_match_its_pin_is_an_error_and_is_never_used(repository, tmp_path):
    jar = pinned("org.example", "alpha", "1.0", ALPHA)
    repository.publish(jar, ALPHA[:-1] + b"!")  # same size, other bytes

    with pytest.raises(JarChecksumMismatch) as caught:
        ensure_jars(tmp_path / "cache", jars=[jar], repository=repository.url, log=lambda m: None)

    message = str(caught.value)
    assert "org.example:alpha:1.0" in message and jar.sha256 in message
    assert hashlib.sha256(ALPHA[:-1] + b"!").hexdigest() in message and "not used" in message
    assert list((tmp_path / "cache" / "kafka" / "libs").iterdir()) == []  # neither the jar nor a partial file


@pytest.mark.network
def test_a_cached_jar_that_differs_from_its_pin_is_replaced_not_used(repository, tmp_path):
    jar = pinned("org.example", "alpha", "1.0", ALPHA)
    repository.publish(jar, ALPHA)
    libs = tmp_path / "cache" / "kafka" / "libs"
    libs.mkdir(parents=True)
    (libs / jar.file_name).write_bytes(ALPHA[:-1] + b"!")  # corrupted in the cache, size unchanged
    messages: list[str] = []

    [path] = ensure_jars(tmp_path / "cache", jars=[jar], repository=repository.url, log=messages.append)

    assert path.read_bytes() == ALPHA
    assert "cached alpha-1.0.jar is not the pinned jar" in messages[0]


@pytest.mark.network
def test_a_jar_the_repository_does_not_have_is_a_clear_error(repository, tmp_path):
    jar = pinned("org.example", "missing", "1.0", ALPHA)
    with pytest.raises(KafkaJarsError, match="org.example:missing:1.0: .* answered 404"):
        ensure_jars(tmp_path / "cache", jars=[jar], repository=repository.url, log=lambda m: None)


def test_the_lock_format_is_checked_line_by_line():
    digest = "a" * 64
    assert parse_lock(f"# comment\n\norg.x y 1.0 {digest} 12\n") == (PinnedJar("org.x", "y", "1.0", digest, 12),)
    with pytest.raises(KafkaJarsError, match="lock:2: not 'group artifact version sha256 size_bytes'"):
        parse_lock(f"org.x y 1.0 {digest} 12\norg.x z 1.0 {digest[:-1]} 12\n", source="lock")
    with pytest.raises(KafkaJarsError, match="y-1.0.jar is pinned twice"):
        parse_lock(f"org.x y 1.0 {digest} 12\norg.other y 1.0 {digest} 12\n")
    with pytest.raises(KafkaJarsError, match="pins no jar"):
        parse_lock("# nothing\n")


def test_the_committed_lock_pins_the_roots_pom_as_it_is_now():
    """Changing kafka-pom.xml without re-pinning (``python -m gpumeter.devtools.kafka_jars pin``) fails here."""
    text = kafka_jars.LOCK_FILE.read_text()
    jars = parse_lock(text)
    assert lock_value(text, "roots-pom-sha256") == hashlib.sha256(kafka_jars.ROOTS_POM.read_bytes()).hexdigest()
    roots, kafka_version = kafka_jars.roots_of()
    assert lock_value(text, "kafka-version") == kafka_version
    versions = {(j.group, j.artifact): j.version for j in jars}
    for root in roots:
        assert versions[(root.group, root.artifact)] == root.version
    assert versions[("org.apache.kafka", "kafka-clients")] == kafka_version
    assert sum(j.size_bytes for j in jars) > 30_000_000  # the whole broker, not a stub list


def lock_value(text: str, key: str) -> str | None:
    return kafka_jars.lock_header_value(text, key)


def pom(group, artifact, version, *, parent=None, properties=None, managed=(), dependencies=()) -> bytes:
    """A minimal POM: dependencies are (group, artifact, version, scope, optional, exclusions) tuples."""
    project = ElementTree.Element("project", xmlns="http://maven.apache.org/POM/4.0.0")
    if parent:
        element = ElementTree.SubElement(project, "parent")
        for tag, value in zip(("groupId", "artifactId", "version"), parent):
            ElementTree.SubElement(element, tag).text = value
    for tag, value in (("groupId", group), ("artifactId", artifact), ("version", version)):
        if value is not None:
            ElementTree.SubElement(project, tag).text = value
    if properties:
        element = ElementTree.SubElement(project, "properties")
        for name, value in properties.items():
            ElementTree.SubElement(element, name).text = value

    def add(container, items):
        element = ElementTree.SubElement(container, "dependencies")
        for g, a, v, scope, optional, exclusions, *kind in items:
            dep = ElementTree.SubElement(element, "dependency")
            for tag, value in (("groupId", g), ("artifactId", a), ("version", v), ("scope", scope),
                               ("type", kind[0] if kind else None)):
                if value is not None:
                    ElementTree.SubElement(dep, tag).text = value
            if optional:
                ElementTree.SubElement(dep, "optional").text = "true"
            if exclusions:
                holder = ElementTree.SubElement(dep, "exclusions")
                for eg, ea in exclusions:
                    exclusion = ElementTree.SubElement(holder, "exclusion")
                    ElementTree.SubElement(exclusion, "groupId").text = eg
                    ElementTree.SubElement(exclusion, "artifactId").text = ea

    if managed:
        add(ElementTree.SubElement(project, "dependencyManagement"), managed)
    if dependencies:
        add(project, dependencies)
    return ElementTree.tostring(project)


def resolver_of(poms: dict) -> Resolver:
    return Resolver(lambda g, a, v: poms[(g, a, v)])


def test_nearest_version_wins_and_the_first_declared_at_equal_depth():
    poms = {
        ("g", "a", "1"): pom("g", "a", "1", dependencies=[("g", "shared", "1", None, False, ()),
                                                           ("g", "deep", "1", None, False, ())]),
        ("g", "b", "1"): pom("g", "b", "1", dependencies=[("g", "shared", "2", None, False, ())]),
        ("g", "deep", "1"): pom("g", "deep", "1", dependencies=[("g", "c", "9", None, False, ())]),
        ("g", "shared", "1"): pom("g", "shared", "1"),
        ("g", "shared", "2"): pom("g", "shared", "2"),
        ("g", "c", "1"): pom("g", "c", "1"),
    }
    roots = [Dependency("g", "a", "1"), Dependency("g", "b", "1"), Dependency("g", "c", "1")]
    assert resolver_of(poms).resolve(roots) == [("g", "a", "1"), ("g", "b", "1"), ("g", "c", "1"),
                                                ("g", "shared", "1"), ("g", "deep", "1")]


def test_optional_test_and_provided_dependencies_of_dependencies_and_exclusions_are_left_out():
    poms = {
        ("g", "a", "1"): pom("g", "a", "1", dependencies=[
            ("g", "opt", "1", None, True, ()), ("g", "tst", "1", "test", False, ()),
            ("g", "prv", "1", "provided", False, ()), ("g", "rt", "1", "runtime", False, ()),
            ("g", "noisy", "1", None, False, [("g", "unwanted")])]),
        ("g", "rt", "1"): pom("g", "rt", "1", dependencies=[("x", "far", "1", None, False, ())]),
        ("g", "noisy", "1"): pom("g", "noisy", "1", dependencies=[("g", "unwanted", "1", None, False, ()),
                                                                   ("g", "wanted", "1", None, False, ())]),
        ("g", "wanted", "1"): pom("g", "wanted", "1"),
    }
    roots = [Dependency("g", "a", "1", exclusions=frozenset({("x", "*")}))]
    assert resolver_of(poms).resolve(roots) == [("g", "a", "1"), ("g", "rt", "1"), ("g", "noisy", "1"),
                                                ("g", "wanted", "1")]


def test_versions_come_from_parents_properties_and_imported_boms():
    poms = {
        ("g", "parent", "7"): pom("g", "parent", "7", properties={"lib.version": "1.0"},
                                  managed=[("g", "bom", "3", "import", False, (), "pom"),
                                           ("g", "lib", "${lib.version}", None, False, ())]),
        ("g", "bom", "3"): pom("g", "bom", "3", managed=[("g", "fromb", "3.${minor}", None, False, ())],
                               properties={"minor": "5"}),
        ("g", "child", "7"): pom(None, "child", None, parent=("g", "parent", "7"),
                                 properties={"lib.version": "1.1"},
                                 dependencies=[("g", "lib", None, None, False, ()),
                                               ("g", "fromb", None, None, False, ()),
                                               ("${project.groupId}", "sibling", "${project.version}", None,
                                                False, ())]),
        ("g", "lib", "1.1"): pom("g", "lib", "1.1"),
        ("g", "fromb", "3.5"): pom("g", "fromb", "3.5"),
        ("g", "sibling", "7"): pom("g", "sibling", "7"),
    }
    # The child overrides the property its parent's dependency management uses: the child's value wins.
    assert resolver_of(poms).resolve([Dependency("g", "child", "7")]) == [
        ("g", "child", "7"), ("g", "lib", "1.1"), ("g", "fromb", "3.5"), ("g", "sibling", "7")]


def test_version_ranges_are_refused_rather_than_guessed():
    poms = {("g", "a", "1"): pom("g", "a", "1", dependencies=[("g", "r", "[1.0,2.0)", None, False, ())])}
    with pytest.raises(KafkaJarsError, match="version range"):
        resolver_of(poms).resolve([Dependency("g", "a", "1")])
