#!/bin/sh
# The rlstream image's entry point: `rlstream ARGS`, with a stable worker id by default. A container keeps its
# hostname when it restarts and replicas get different ones, so the hostname is a good --instance: a restarted
# container fences its own zombie transaction and takes its partitions back at once (static group membership).
: "${RLSTREAM_INSTANCE:=${HOSTNAME:-$(cat /etc/hostname)}}"
export RLSTREAM_INSTANCE
exec rlstream "$@"
