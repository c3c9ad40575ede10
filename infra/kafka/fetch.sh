#!/usr/bin/env bash
# Fetch the Kafka broker jars from Maven Central into lib/ (skipped when already complete).
set -euo pipefail
cd "$(dirname "$0")"

# The stamp holds the pom's hash, so an edited pom or an interrupted copy triggers a refetch.
stamp="lib/.complete"
want="$(sha256sum pom.xml | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  exit 0
fi

if ! command -v mvn >/dev/null 2>&1; then
  echo "fetch.sh: Maven (mvn) is not installed; install it (e.g. apt-get install maven) or set RLSTREAM_KAFKA_LIB to a directory of Kafka jars" >&2
  exit 1
fi

# Copy into target/ (gitignored) first so an interrupted fetch never leaves a half-filled lib/.
rm -rf target/lib.partial
mvn -q -B dependency:copy-dependencies -DoutputDirectory=target/lib.partial >&2
rm -rf lib
mv target/lib.partial lib
echo "$want" > "$stamp"
echo "fetch.sh: $(ls lib/*.jar | wc -l) jars in $(pwd)/lib" >&2
