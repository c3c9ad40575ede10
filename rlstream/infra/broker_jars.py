"""What the local broker runs on: a Java 17+ runtime and the Kafka jars, fetched once with Maven into a cache.

The jars are $RLSTREAM_KAFKA_LIB when set; else a directory named by the hash of the pom shipped in the
package (rlstream/infra/kafka/pom.xml), under $RLSTREAM_HOME/cache/kafka/ or the user's cache
(~/.cache/rlstream/kafka/, or $XDG_CACHE_HOME/rlstream/kafka/). A copy in either is reused; a fetch goes to
the first. Maven fills a private work directory that is renamed to the hash only once complete, so a
directory under that name always holds every jar, and an edited pom fetches anew.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rlstream.infra.broker_config import BrokerError

POM = Path(__file__).resolve().parent / "kafka" / "pom.xml"
KAFKA_JAR = "kafka_2.13-*.jar"  # the broker's own jar: a directory without it holds no broker


def java() -> str:
    """The java executable ($JAVA_HOME/bin/java, else on PATH), checked to be Java 17 or newer."""
    java_home = os.environ.get("JAVA_HOME")
    exe = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if not exe or not Path(exe).exists():
        raise BrokerError(
            "java not found: the local Kafka broker needs a Java 17+ runtime "
            "(e.g. apt-get install openjdk-17-jre-headless) on PATH or in JAVA_HOME"
        )
    out = subprocess.run([exe, "-version"], capture_output=True, text=True).stderr
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if match:
        major = int(match.group(1)) if match.group(1) != "1" else int(match.group(2) or 0)
        if major < 17:
            raise BrokerError(f"Kafka 4 needs Java 17 or newer, found Java {major} at {exe}; install a newer JDK")
    return exe


def cache_roots() -> list[Path]:
    """Where fetched jars may lie, in the order searched: $RLSTREAM_HOME/cache/kafka if set, the user's cache."""
    roots = []
    if os.environ.get("RLSTREAM_HOME"):
        roots.append(Path(os.environ["RLSTREAM_HOME"]).resolve() / "cache" / "kafka")
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    roots.append(user.resolve() / "rlstream" / "kafka")
    return roots


def pom_hash() -> str:
    """The name of the cache directory of the shipped pom's jars."""
    return hashlib.sha256(POM.read_bytes()).hexdigest()[:16]


def kafka_lib() -> Path:
    """The directory of Kafka jars: $RLSTREAM_KAFKA_LIB, else a cached copy, else fetched now."""
    env = os.environ.get("RLSTREAM_KAFKA_LIB")
    if env:
        lib = Path(env).resolve()
        if not any(lib.glob(KAFKA_JAR)):
            raise BrokerError(f"RLSTREAM_KAFKA_LIB={env} holds no {KAFKA_JAR}; point it at a directory of Kafka jars")
        return lib
    if not POM.exists():
        raise BrokerError(f"{POM} is missing from the installed rlstream; reinstall it, "
                          "or set RLSTREAM_KAFKA_LIB to a directory of Kafka 4 jars")
    roots, name = cache_roots(), pom_hash()
    for root in roots:
        if any((root / name).glob(KAFKA_JAR)):
            return root / name
    return _fetch(roots[0] / name)


def _fetch(dest: Path) -> Path:
    """Fetch the pom's jars with Maven into dest, which appears whole or not at all."""
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError(
            "Maven (mvn) not found: the local Kafka broker's jars are fetched with Maven from Maven Central "
            "(e.g. apt-get install maven); or set RLSTREAM_KAFKA_LIB to a directory of Kafka 4 jars"
        )
    java()  # Maven needs it too; its own message for a missing JDK says less about what to install
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching the Kafka broker's jars with Maven into {dest} (once)", file=sys.stderr, flush=True)
    # The pom is copied out because the installed package may be read-only and Maven writes beside its pom.
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        shutil.copyfile(POM, work / "pom.xml")
        proc = subprocess.run(
            [mvn, "-q", "-B", "-f", str(work / "pom.xml"), "dependency:copy-dependencies",
             f"-DoutputDirectory={work / 'lib'}"],
            capture_output=True, text=True,
        )
        if proc.returncode != 0 or not any((work / "lib").glob(KAFKA_JAR)):
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
            raise BrokerError(
                "could not fetch the Kafka jars with Maven (it needs access to Maven Central); "
                f"fix that and retry, or set RLSTREAM_KAFKA_LIB to a directory of Kafka jars.\n{tail}"
            )
        try:
            os.rename(work / "lib", dest)
        except OSError:
            # Another process completed the same fetch first; its copy is as good as this one.
            if not any(dest.glob(KAFKA_JAR)):
                raise
        return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)
