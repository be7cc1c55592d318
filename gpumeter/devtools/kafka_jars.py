"""Apache Kafka's broker jars, straight from Maven Central: a pinned list, checksummed downloads, a cache.

No Maven is needed. Contract:

* ``kafka-jars.lock`` (next to this file, committed) pins every jar of the broker's runtime classpath: one line
  ``group artifact version sha256 size_bytes`` each. It was resolved from ``kafka-pom.xml`` (the roots: Kafka's
  broker and the log4j binding) by ``python -m gpumeter.devtools.kafka_jars pin``, which reads the POMs from
  Maven Central and resolves them as Maven does (parents, properties, dependency management and imported BOMs,
  exclusions, optional and test/provided scopes dropped, nearest version wins), then downloads each jar and
  checks it against Central's own ``.sha1``, ``.sha256`` and ``.sha512`` files where Central has them.
* ``ensure_jars(cache_dir)`` returns the classpath (one file per pinned jar, in the lock's order) under
  ``cache_dir/kafka/libs``. A jar already there is used only when its size and SHA-256 equal the pin; a missing
  or different one is downloaded over HTTPS with the standard library, into a temporary file that becomes the jar
  only once its SHA-256 and size equal the pin. A download that does not match raises ``JarChecksumMismatch``
  naming the jar, both digests and the URL, and leaves nothing behind: a mismatch is never used.
  It prints what it downloads and how big before it starts.
* ``GPUMETER_MAVEN_REPOSITORY`` names another repository with Maven Central's layout (a mirror or proxy);
  the pinned checksums are what make any source safe.

Command line: ``python -m gpumeter.devtools.kafka_jars fetch|pin|check``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

LOCK_FILE = Path(__file__).with_name("kafka-jars.lock")
ROOTS_POM = Path(__file__).with_name("kafka-pom.xml")
MAVEN_CENTRAL = "https://repo1.maven.org/maven2/"
REPOSITORY_ENV = "GPUMETER_MAVEN_REPOSITORY"
_CHUNK_BYTES = 1 << 20
_ATTEMPTS = 3


class KafkaJarsError(RuntimeError):
    """The pinned jars could not be read, resolved, downloaded or verified."""


class JarChecksumMismatch(KafkaJarsError):
    """A downloaded jar is not the pinned one (SHA-256 or size differ). It was deleted, never used."""


@dataclass(frozen=True)
class PinnedJar:
    """One jar of the broker's classpath, as the lock pins it."""

    group: str
    artifact: str
    version: str
    sha256: str
    size_bytes: int

    @property
    def coordinates(self) -> str:
        return f"{self.group}:{self.artifact}:{self.version}"

    @property
    def file_name(self) -> str:
        return f"{self.artifact}-{self.version}.jar"

    def url(self, repository: str = MAVEN_CENTRAL) -> str:
        return artifact_url(repository, self.group, self.artifact, self.version, "jar")


def artifact_url(repository: str, group: str, artifact: str, version: str, extension: str) -> str:
    """The URL of ``group:artifact:version`` with ``extension`` in a repository with Maven Central's layout."""
    base = repository if repository.endswith("/") else repository + "/"
    return f"{base}{group.replace('.', '/')}/{artifact}/{version}/{artifact}-{version}.{extension}"


def default_repository(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get(REPOSITORY_ENV) or MAVEN_CENTRAL


# ----------------------------------------------------------------------------------------------------------------
# The lock file

_LOCK_LINE = re.compile(r"^(\S+) (\S+) (\S+) ([0-9a-f]{64}) ([0-9]+)$")


def parse_lock(text: str, source: str = "kafka-jars.lock") -> tuple[PinnedJar, ...]:
    """The pinned jars of a lock file's text. Comment (``#``) and blank lines are ignored."""
    jars: list[PinnedJar] = []
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _LOCK_LINE.match(line)
        if match is None:
            raise KafkaJarsError(f"{source}:{number}: not 'group artifact version sha256 size_bytes': {raw!r}")
        group, artifact, version, sha256, size = match.groups()
        jar = PinnedJar(group, artifact, version, sha256, int(size))
        if jar.file_name in names:
            raise KafkaJarsError(f"{source}:{number}: {jar.file_name} is pinned twice")
        names.add(jar.file_name)
        jars.append(jar)
    if not jars:
        raise KafkaJarsError(f"{source}: pins no jar")
    return tuple(jars)


def load_lock(path: Path = LOCK_FILE) -> tuple[PinnedJar, ...]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise KafkaJarsError(f"cannot read the pinned jar list {path}: {exc}") from exc
    return parse_lock(text, source=path.name)


def lock_header_value(text: str, key: str) -> str | None:
    """A ``# key: value`` header line's value (``kafka-version``, ``roots-pom-sha256``), or None."""
    match = re.search(rf"^# {re.escape(key)}: (\S+)$", text, re.MULTILINE)
    return match.group(1) if match else None


def format_lock(jars: Sequence[PinnedJar], *, kafka_version: str, roots_pom_sha256: str) -> str:
    lines = [
        f"# Apache Kafka {kafka_version}'s broker runtime classpath, pinned. Do not edit by hand: regenerate with",
        "#   python -m gpumeter.devtools.kafka_jars pin",
        "# which resolves kafka-pom.xml against Maven Central (no Maven needed) and checks every jar against",
        "# Central's .sha1/.sha256/.sha512. The SHA-256 and size below are of the jars as Central serves them.",
        f"# kafka-version: {kafka_version}",
        f"# roots-pom-sha256: {roots_pom_sha256}",
        "# group artifact version sha256 size_bytes",
    ]
    for jar in sorted(jars, key=lambda j: (j.group, j.artifact)):
        lines.append(f"{jar.group} {jar.artifact} {jar.version} {jar.sha256} {jar.size_bytes}")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Downloads


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def human_bytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.0f} kB"


Opener = Callable[[str, float], "urllib.response.addinfourl"]


def _open(url: str, timeout_s: float):
    request = urllib.request.Request(url, headers={"User-Agent": "gpumeter-kafka-jars"})
    return urllib.request.urlopen(request, timeout=timeout_s)


def fetch_bytes(url: str, *, opener: Opener = _open, timeout_s: float = 60.0) -> bytes:
    """The body of ``url``; ``FileNotFoundError`` on HTTP 404, ``KafkaJarsError`` after three failed tries."""
    last: Exception | None = None
    for attempt in range(_ATTEMPTS):
        try:
            with opener(url, timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise FileNotFoundError(url) from exc
            last = exc
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.5 * (attempt + 1))
    raise KafkaJarsError(f"cannot download {url}: {last}")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _matches(path: Path, jar: PinnedJar) -> bool:
    try:
        return path.stat().st_size == jar.size_bytes and file_sha256(path) == jar.sha256
    except OSError:
        return False


def download_jar(jar: PinnedJar, target: Path, *, repository: str = MAVEN_CENTRAL, opener: Opener = _open,
                 timeout_s: float = 60.0) -> None:
    """Download ``jar`` to ``target``: streamed into a temporary file next to it, hashed on the way, and moved
    into place only when its SHA-256 and size equal the pin (``JarChecksumMismatch`` otherwise)."""
    url = jar.url(repository)
    last: Exception | None = None
    for attempt in range(_ATTEMPTS):
        handle, temporary = tempfile.mkstemp(prefix=f".{jar.file_name}.", suffix=".part", dir=target.parent)
        try:
            digest = hashlib.sha256()
            size = 0
            with os.fdopen(handle, "wb") as out, opener(url, timeout_s) as response:
                for chunk in iter(lambda: response.read(_CHUNK_BYTES), b""):
                    digest.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
            if digest.hexdigest() != jar.sha256 or size != jar.size_bytes:
                raise JarChecksumMismatch(
                    f"{jar.coordinates} from {url} is not the pinned jar: SHA-256 {digest.hexdigest()} "
                    f"({size} bytes), pinned {jar.sha256} ({jar.size_bytes} bytes) in {LOCK_FILE.name}. "
                    "It was deleted and not used; if the pin itself is wrong, re-pin with "
                    "`python -m gpumeter.devtools.kafka_jars pin`."
                )
            os.replace(temporary, target)
            return
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise KafkaJarsError(f"{jar.coordinates}: {url} answered 404 (not in that repository)") from exc
            last = exc
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
        time.sleep(0.5 * (attempt + 1))
    raise KafkaJarsError(f"cannot download {jar.coordinates} from {url}: {last}")


def libs_dir(cache_dir: Path) -> Path:
    return cache_dir / "kafka" / "libs"


def ensure_jars(cache_dir: Path, *, jars: Sequence[PinnedJar] | None = None, repository: str | None = None,
                log: Callable[[str], None] = _to_stderr, opener: Opener = _open) -> list[Path]:
    """The broker's classpath: every pinned jar under ``cache_dir/kafka/libs``, verified, downloading what is
    missing or different (see the module docstring)."""
    jars = load_lock() if jars is None else tuple(jars)
    repository = repository or default_repository()
    libs = libs_dir(cache_dir)
    libs.mkdir(parents=True, exist_ok=True)
    paths = [libs / jar.file_name for jar in jars]
    missing = []
    for jar, path in zip(jars, paths):
        if _matches(path, jar):
            continue
        if path.exists():
            log(f"Kafka jars: cached {path.name} is not the pinned jar (size or SHA-256 differ); downloading it again")
        missing.append((jar, path))
    if not missing:
        return paths
    total = sum(jar.size_bytes for jar, _ in missing)
    log(f"Kafka jars: downloading {len(missing)} of {len(jars)} jars ({human_bytes(total)}) from {repository} "
        f"into {libs} — once; every file is checked against its pinned SHA-256...")
    started = time.monotonic()
    for jar, path in missing:
        download_jar(jar, path, repository=repository, opener=opener)
    log(f"Kafka jars: {len(missing)} downloaded and verified in {time.monotonic() - started:.0f} s")
    return paths


# ----------------------------------------------------------------------------------------------------------------
# Resolution (``pin``): Maven's dependency resolution for jars, from POMs alone


@dataclass(frozen=True)
class Dependency:
    group: str
    artifact: str
    version: str | None
    scope: str | None = None
    type: str = "jar"
    classifier: str | None = None
    optional: bool = False
    exclusions: frozenset[tuple[str, str]] = frozenset()

    @property
    def key(self) -> tuple[str, str, str, str | None]:
        return (self.group, self.artifact, self.type, self.classifier)


@dataclass
class Model:
    """A POM after inheritance and interpolation, with dependency management applied (Maven's effective model)."""

    group: str
    artifact: str
    version: str
    properties: dict[str, str]
    raw_managed: list[dict]
    raw_dependencies: list[dict]
    managed: dict[tuple, Dependency]
    dependencies: list[Dependency]


def _local(tag: str) -> str:
    return tag.rpartition("}")[2]


def _child(element: ElementTree.Element | None, name: str) -> ElementTree.Element | None:
    if element is None:
        return None
    for item in element:
        if _local(item.tag) == name:
            return item
    return None


def _children(element: ElementTree.Element | None, name: str) -> list[ElementTree.Element]:
    return [] if element is None else [item for item in element if _local(item.tag) == name]


def _text(element: ElementTree.Element | None, name: str) -> str | None:
    found = _child(element, name)
    return found.text.strip() if found is not None and found.text is not None else None


_PROPERTY = re.compile(r"\$\{([^}]+)\}")


def _interpolate(value: str | None, properties: Mapping[str, str]) -> str | None:
    if value is None:
        return None
    for _ in range(10):
        replaced = _PROPERTY.sub(lambda m: properties.get(m.group(1), m.group(0)), value)
        if replaced == value:
            break
        value = replaced
    if _PROPERTY.search(value):
        raise KafkaJarsError(f"unresolved property in {value!r}")
    return value


def _raw_dependencies(parent: ElementTree.Element | None) -> list[dict]:
    result = []
    for item in _children(_child(parent, "dependencies"), "dependency"):
        exclusions = frozenset(
            (_text(e, "groupId") or "*", _text(e, "artifactId") or "*")
            for e in _children(_child(item, "exclusions"), "exclusion")
        )
        result.append({
            "group": _text(item, "groupId"), "artifact": _text(item, "artifactId"), "version": _text(item, "version"),
            "scope": _text(item, "scope"), "type": _text(item, "type") or "jar",
            "classifier": _text(item, "classifier"), "optional": (_text(item, "optional") or "false") == "true",
            "exclusions": exclusions,
        })
    return result


def _concrete(raw: dict, properties: Mapping[str, str]) -> Dependency:
    return Dependency(
        group=_interpolate(raw["group"], properties), artifact=_interpolate(raw["artifact"], properties),
        version=_interpolate(raw["version"], properties), scope=_interpolate(raw["scope"], properties),
        type=_interpolate(raw["type"], properties), classifier=_interpolate(raw["classifier"], properties),
        optional=raw["optional"], exclusions=raw["exclusions"],
    )


class Resolver:
    """Resolves jar dependencies from POMs fetched through ``fetch_pom(group, artifact, version) -> bytes``.

    As Maven builds a model: the parent's raw model is inherited first (properties, dependency management and
    dependencies, the child's entries overriding), then everything is interpolated with the child's properties,
    BOMs imported into dependency management (the POM's own entries first, then each import in order), and
    missing versions, scopes and exclusions of dependencies filled from dependency management.
    """

    def __init__(self, fetch_pom: Callable[[str, str, str], bytes]) -> None:
        self._fetch_pom = fetch_pom
        self._models: dict[tuple[str, str, str], Model] = {}

    def model(self, group: str, artifact: str, version: str) -> Model:
        key = (group, artifact, version)
        if key not in self._models:
            self._models[key] = self._build(ElementTree.fromstring(self._fetch_pom(group, artifact, version)), key)
        return self._models[key]

    def model_of_pom(self, pom_bytes: bytes) -> Model:
        return self._build(ElementTree.fromstring(pom_bytes), None)

    def _build(self, root: ElementTree.Element, expected: tuple[str, str, str] | None) -> Model:
        parent_element = _child(root, "parent")
        parent: Model | None = None
        if parent_element is not None:
            parent = self.model(_text(parent_element, "groupId"), _text(parent_element, "artifactId"),
                                _text(parent_element, "version"))
        group = _text(root, "groupId") or (parent.group if parent else None)
        artifact = _text(root, "artifactId")
        version = _text(root, "version") or (parent.version if parent else None)
        if _child(_child(root, "distributionManagement"), "relocation") is not None:
            raise KafkaJarsError(f"{group}:{artifact}:{version} is relocated; pin its new coordinates instead")
        properties = dict(parent.properties) if parent else {}
        own_properties = _child(root, "properties")
        if own_properties is not None:
            for item in own_properties:
                properties[_local(item.tag)] = (item.text or "").strip()
        properties.update({
            "project.groupId": group, "project.artifactId": artifact, "project.version": version,
            "pom.groupId": group, "pom.artifactId": artifact, "pom.version": version,
            "groupId": group, "artifactId": artifact, "version": version,
        })
        if parent is not None:
            properties.update({"project.parent.groupId": parent.group, "project.parent.version": parent.version,
                               "parent.version": parent.version})
        version = _interpolate(version, properties)
        if expected is not None and (group, artifact, version) != expected:
            raise KafkaJarsError(f"the POM of {':'.join(expected)} says it is {group}:{artifact}:{version}")

        raw_managed = _raw_dependencies(_child(root, "dependencyManagement")) + (parent.raw_managed if parent else [])
        raw_dependencies = _raw_dependencies(root) + (parent.raw_dependencies if parent else [])

        own_managed: dict[tuple, Dependency] = {}
        imports: list[Dependency] = []
        for raw in raw_managed:
            dep = _concrete(raw, properties)
            if dep.scope == "import" and dep.type == "pom":
                imports.append(dep)
            else:
                own_managed.setdefault(dep.key, dep)
        managed = dict(own_managed)
        for bom in imports:
            for key, dep in self.model(bom.group, bom.artifact, bom.version).managed.items():
                managed.setdefault(key, dep)

        dependencies: dict[tuple, Dependency] = {}
        for raw in raw_dependencies:
            dep = _concrete(raw, properties)
            dependencies.setdefault(dep.key, dep)
        filled = []
        for dep in dependencies.values():
            rule = managed.get(dep.key)
            if rule is not None:
                dep = Dependency(dep.group, dep.artifact, dep.version or rule.version, dep.scope or rule.scope,
                                 dep.type, dep.classifier, dep.optional, dep.exclusions | rule.exclusions)
            if dep.version is None:
                raise KafkaJarsError(f"{group}:{artifact}:{version}: no version for {dep.group}:{dep.artifact}")
            filled.append(dep)
        return Model(group, artifact, version, properties, raw_managed, raw_dependencies, managed, filled)

    def resolve(self, roots: Sequence[Dependency]) -> list[tuple[str, str, str]]:
        """The runtime classpath (compile and runtime scopes) of ``roots``, as (group, artifact, version) in
        breadth-first order: nearest wins, the first declared at equal depth; exclusions apply below where they
        are declared; optional and test/provided/system dependencies of dependencies are left out."""
        chosen: dict[tuple[str, str], str] = {}
        order: list[tuple[str, str, str]] = []
        frontier: list[tuple[Dependency, frozenset[tuple[str, str]]]] = [
            (dep, dep.exclusions) for dep in roots if (dep.scope or "compile") in ("compile", "runtime")
        ]
        while frontier:
            following = []
            for dep, excluded in frontier:
                if (dep.group, dep.artifact) in chosen:
                    continue
                if _version_range(dep.version):
                    raise KafkaJarsError(f"{dep.group}:{dep.artifact}: version range {dep.version} is not supported")
                if dep.type not in ("jar", "bundle") or dep.classifier:
                    raise KafkaJarsError(f"{dep.group}:{dep.artifact}: type {dep.type} classifier {dep.classifier} "
                                         "is not a plain jar")
                chosen[(dep.group, dep.artifact)] = dep.version
                order.append((dep.group, dep.artifact, dep.version))
                for child in self.model(dep.group, dep.artifact, dep.version).dependencies:
                    if child.optional or (child.scope or "compile") not in ("compile", "runtime"):
                        continue
                    if _excluded(child, excluded):
                        continue
                    following.append((child, excluded | child.exclusions))
            frontier = following
        return order


def _version_range(version: str) -> bool:
    return version[:1] in "[(" or "," in version


def _excluded(dep: Dependency, exclusions: Iterable[tuple[str, str]]) -> bool:
    return any(g in ("*", dep.group) and a in ("*", dep.artifact) for g, a in exclusions)


def roots_of(pom_path: Path = ROOTS_POM) -> tuple[list[Dependency], str]:
    """The direct dependencies of ``kafka-pom.xml`` and its ``kafka.version`` property."""
    resolver = Resolver(lambda *coordinates: (_ for _ in ()).throw(KafkaJarsError("the roots POM has a parent")))
    model = resolver.model_of_pom(pom_path.read_bytes())
    kafka_version = model.properties.get("kafka.version")
    if not kafka_version:
        raise KafkaJarsError(f"{pom_path.name} has no kafka.version property")
    return model.dependencies, kafka_version


def pin(repository: str = MAVEN_CENTRAL, *, log: Callable[[str], None] = _to_stderr,
        opener: Opener = _open) -> str:
    """Resolve ``kafka-pom.xml``, download and cross-check every jar; return the lock file's new text."""
    def fetch_pom(group: str, artifact: str, version: str) -> bytes:
        return fetch_bytes(artifact_url(repository, group, artifact, version, "pom"), opener=opener)

    roots, kafka_version = roots_of()
    resolved = Resolver(fetch_pom).resolve(roots)
    log(f"resolved {len(resolved)} jars for Apache Kafka {kafka_version}; downloading each to check it...")
    jars = []
    for group, artifact, version in resolved:
        url = artifact_url(repository, group, artifact, version, "jar")
        body = fetch_bytes(url, opener=opener)
        checked = []
        for algorithm in ("sha1", "sha256", "sha512"):
            try:
                published = fetch_bytes(f"{url}.{algorithm}", opener=opener).decode("ascii", "replace").split()
            except FileNotFoundError:
                continue
            if not published or published[0].lower() != hashlib.new(algorithm, body).hexdigest():
                raise JarChecksumMismatch(f"{group}:{artifact}:{version}: the jar does not match {url}.{algorithm}")
            checked.append(algorithm)
        if not checked:
            raise KafkaJarsError(f"{group}:{artifact}:{version}: the repository publishes no checksum for {url}")
        log(f"  {group}:{artifact}:{version} {human_bytes(len(body))} (checked against {', '.join(checked)})")
        jars.append(PinnedJar(group, artifact, version, hashlib.sha256(body).hexdigest(), len(body)))
    return format_lock(jars, kafka_version=kafka_version,
                       roots_pom_sha256=hashlib.sha256(ROOTS_POM.read_bytes()).hexdigest())


def main(argv: list[str] | None = None) -> int:
    from gpumeter.devtools.cache import DEFAULT_CACHE_DIR

    parser = argparse.ArgumentParser(prog="kafka_jars", description="Apache Kafka's pinned jars from Maven Central.")
    parser.add_argument("action", choices=["fetch", "pin", "check"],
                        help="fetch: download and verify into the cache (prints the classpath folder); "
                             "pin: re-resolve kafka-pom.xml and rewrite kafka-jars.lock; "
                             "check: re-resolve and fail if the lock differs")
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument("--repository", default=None, help=f"default ${REPOSITORY_ENV} or {MAVEN_CENTRAL}")
    args = parser.parse_args(argv)
    try:
        if args.action == "fetch":
            paths = ensure_jars(args.cache_dir, repository=args.repository)
            print(paths[0].parent)
            return 0
        text = pin(args.repository or default_repository())
        if args.action == "pin":
            LOCK_FILE.write_text(text, encoding="utf-8")
            print(f"wrote {LOCK_FILE}")
            return 0
        current = LOCK_FILE.read_text(encoding="utf-8")
        if parse_lock(current) != parse_lock(text):
            print(f"{LOCK_FILE.name} differs from a fresh resolution of {ROOTS_POM.name}: run `pin`", file=sys.stderr)
            return 1
        print(f"{LOCK_FILE.name} matches a fresh resolution of {ROOTS_POM.name}")
        return 0
    except KafkaJarsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
