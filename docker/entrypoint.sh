#!/bin/sh
# The images' command: `entrypoint.sh tokenizer|worker|gateway [flags...]` builds that service's `gemma-serve`
# command line from environment variables and execs it (so SIGTERM from `docker stop` reaches the service, which
# then drains). Unset variables take the defaults below; flags given after the service name, then
# GEMMA_SERVE_EXTRA_ARGS, come last, so they win over the generated ones.
#
#   every service  GEMMA_SERVE_MODEL (embedded), GEMMA_SERVE_HOST (0.0.0.0), GEMMA_SERVE_LOG_LEVEL,
#                  GEMMA_SERVE_DRAIN_TIMEOUT; GEMMA_SERVE_CACHE (/cache, read by gemma-serve itself)
#                  internal links: INTERNAL_TLS_CERT, INTERNAL_TLS_KEY, INTERNAL_TLS_CA (PEM paths: mutual TLS),
#                  or INSECURE_INTERNAL=1 (plain gRPC on a private network). With neither, the tokenizer and the
#                  worker refuse a non-loopback GEMMA_SERVE_HOST (they trust every caller).
#   tokenizer      TOKENIZER_PORT (50051)
#   worker         WORKER_PORT (50052), WORKER_METRICS_PORT (8001)
#   gateway        HTTP_PORT (8000), GATEWAY_GRPC_PORT (50050), TOKENIZER_ADDR (tokenizer:50051),
#                  WORKER_ADDRS (worker:50052; comma- or space-separated, one --worker-addr each; a name that
#                  resolves to several addresses is one worker per address), SERVED_MODEL_NAME, API_KEY_FILE,
#                  SSL_CERTFILE and SSL_KEYFILE (TLS on the public ports); GEMMA_SERVE_API_KEY (comma-separated
#                  keys) is read by the gateway itself, so keys never appear on a command line
#   any            GEMMA_SERVE_EXTRA_ARGS: more flags, split on whitespace (`gemma-serve SERVICE --help`)
# docker/healthcheck.py reads the same port and TLS variables.
set -euf  # -f: unquoted expansions below are split on whitespace, never globbed

usage="usage: entrypoint.sh tokenizer|worker|gateway [gemma-serve flags...]"
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }
service=$1
shift
n_given=$#  # the caller's own flags: moved behind the generated ones at the end

# POSIX sh has no arrays: the flags are appended to "$@".
set -- "$@" --model "${GEMMA_SERVE_MODEL:-embedded}" --host "${GEMMA_SERVE_HOST:-0.0.0.0}"
[ -z "${GEMMA_SERVE_LOG_LEVEL:-}" ] || set -- "$@" --log-level "$GEMMA_SERVE_LOG_LEVEL"
[ -z "${GEMMA_SERVE_DRAIN_TIMEOUT:-}" ] || set -- "$@" --drain-timeout "$GEMMA_SERVE_DRAIN_TIMEOUT"
if [ -n "${INTERNAL_TLS_CERT:-}${INTERNAL_TLS_KEY:-}${INTERNAL_TLS_CA:-}" ]; then
  # All three or an error from gemma-serve naming the missing one.
  set -- "$@" --internal-tls-cert "${INTERNAL_TLS_CERT:-}" --internal-tls-key "${INTERNAL_TLS_KEY:-}" \
    --internal-tls-ca "${INTERNAL_TLS_CA:-}"
fi
[ "${INSECURE_INTERNAL:-0}" != 1 ] || set -- "$@" --insecure-internal

case "$service" in
  tokenizer)
    set -- "$@" --tokenizer-port "${TOKENIZER_PORT:-50051}" ;;
  worker)
    set -- "$@" --worker-port "${WORKER_PORT:-50052}" --worker-metrics-port "${WORKER_METRICS_PORT:-8001}" ;;
  gateway)
    set -- "$@" --http-port "${HTTP_PORT:-8000}" --gateway-grpc-port "${GATEWAY_GRPC_PORT:-50050}" \
      --tokenizer-addr "${TOKENIZER_ADDR:-tokenizer:50051}"
    for addr in $(echo "${WORKER_ADDRS:-worker:50052}" | tr ',' ' '); do
      set -- "$@" --worker-addr "$addr"
    done
    [ -z "${SERVED_MODEL_NAME:-}" ] || set -- "$@" --served-model-name "$SERVED_MODEL_NAME"
    [ -z "${API_KEY_FILE:-}" ] || set -- "$@" --api-key-file "$API_KEY_FILE"
    [ -z "${SSL_CERTFILE:-}" ] || set -- "$@" --ssl-certfile "$SSL_CERTFILE"
    [ -z "${SSL_KEYFILE:-}" ] || set -- "$@" --ssl-keyfile "$SSL_KEYFILE" ;;
  *)
    echo "$usage" >&2; exit 2 ;;
esac

# shellcheck disable=SC2086
set -- "$@" ${GEMMA_SERVE_EXTRA_ARGS:-}

# Rotate the caller's flags (the first n_given arguments) to the end.
i=0
while [ "$i" -lt "$n_given" ]; do
  set -- "$@" "$1"
  shift
  i=$((i + 1))
done

exec gemma-serve "$service" "$@"
