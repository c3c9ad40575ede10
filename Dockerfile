# The images of the compose stack (compose.yaml), every one on BASE_IMAGE: a public Debian bookworm image by
# default, or one made from Debian's packages with no registry at all (infra/docker/make-base-image.sh).
#
#   --target kafka       the broker: Debian's JRE and the pom's Kafka jars, the same jars as `rlstream up`, with the
#                        settings of rlstream.infra.broker_image and Kafka's tools (kafka-console-consumer, ...)
#   --target rlstream    every stage: `pip install .` (no vLLM: rollout runs on transformers) into a venv on Debian's
#                        Python 3.11, plus the JRE and the same jars, so `rlstream up` works in it too
#   --target prometheus  Debian's Prometheus
#
# It needs BuildKit (docker compose v2 always builds with it; docker-compose 1.x with COMPOSE_DOCKER_CLI_BUILD=1
# DOCKER_BUILDKIT=1). infra/docker/cache/ may hold what infra/docker/prepare.sh puts there: a wheelhouse, the Kafka
# jars and a CA bundle. It is mounted while building, never copied into an image. With the wheelhouse and the jars,
# a build reaches no registry but Debian's packages; without them it fetches from PyPI and Maven Central.
#
# A build that stops at the first line with "pull access denied" or "not found" for BASE_IMAGE has no base image:
# run infra/docker/make-base-image.sh (it prints the BASE_IMAGE to use), or set BASE_IMAGE to one you can pull.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8

FROM base AS jre
# openjdk's postinst writes man page links into a folder that slim images leave out.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
    && rm -rf /var/lib/apt/lists/*

FROM jre AS python
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/rlstream

# The Kafka jars, found or fetched by rlstream's own code: a copy prepared on the host (under
# cache/rlstream/kafka/<pom hash>, as in a user's cache), else fetched here with Maven.
FROM python AS kafka-jars
COPY rlstream/__init__.py /src/rlstream/__init__.py
COPY rlstream/errors.py /src/rlstream/errors.py
COPY rlstream/infra /src/rlstream/infra
ENV PYTHONPATH=/src RLSTREAM_HOME=/tmp/fetch XDG_CACHE_HOME=/cache
RUN --mount=type=bind,source=infra/docker/cache,target=/cache \
    --mount=type=cache,target=/root/.m2 \
    set -e; \
    if ! lib=$(python3 -m rlstream.infra.broker fetch 2>/dev/null); then \
        apt-get update && apt-get install -y --no-install-recommends maven; \
        lib=$(python3 -m rlstream.infra.broker fetch); \
    fi; \
    mkdir -p /opt/kafka && cp -r "$lib" /opt/kafka/libs \
    && python3 -m rlstream.infra.broker_image /opt/kafka

FROM jre AS kafka
COPY --from=kafka-jars /opt/kafka /opt/kafka
ENV PATH=/opt/kafka/bin:$PATH
VOLUME /var/lib/kafka/data
EXPOSE 9092 29092
CMD ["kafka-server"]

FROM python AS rlstream
ENV PATH=/opt/rlstream/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
WORKDIR /src
# The dependencies first, from pyproject.toml and constraints.txt alone: editing the code does not reinstall torch.
COPY pyproject.toml constraints.txt infra/docker/requirements.py ./
RUN --mount=type=bind,source=infra/docker/cache,target=/cache \
    --mount=type=cache,target=/root/.cache/pip \
    set -e; \
    if [ -f /cache/wheels/COMPLETE ]; then set -- --no-index --find-links /cache/wheels; \
    elif [ -f /cache/ca.pem ]; then export PIP_CERT=/cache/ca.pem; fi; \
    python3 requirements.py pyproject.toml > requirements.txt \
    && pip install -q "$@" -c constraints.txt -r requirements.txt
COPY README.md ./
COPY rlstream ./rlstream
# Not editable: the package is copied into the venv and the source folder goes.
RUN pip install -q --no-deps --no-build-isolation . && cd / && rm -rf /src
COPY --from=kafka-jars /opt/kafka/libs /opt/kafka/libs
COPY infra/docker/entrypoint.sh /usr/local/bin/rlstream-entrypoint
ENV RLSTREAM_KAFKA_LIB=/opt/kafka/libs RLSTREAM_HOME=/data
WORKDIR /data
EXPOSE 9100
ENTRYPOINT ["rlstream-entrypoint"]
CMD ["--help"]

FROM base AS prometheus
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
