# The kvfleet operator: `kvfleet operator`, no torch, starts in about a second.
# Build from the repository root:  docker build -f docker/operator.Dockerfile -t kvfleet-operator .
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvfleet/ kvfleet/
COPY runtime/ runtime/
COPY kernels/ kernels/
COPY operator/ operator/
COPY devcluster/ devcluster/

# The operator's own imports only, with pyproject.toml's version ranges. kvfleet is installed with
# --no-deps: its full dependency list would pull torch (gigabytes) into an image that never
# imports it. The runtime's modules are copied (one distribution) but never imported here; so is
# devcluster/ (`kvfleet demo`), whose dependencies (the dev extra) are never installed here.
RUN pip install \
        "kopf>=1.37,<2" \
        "kubernetes>=30" \
        "aiohttp>=3.10,<4" \
        "prometheus-client>=0.20" \
        "pyyaml>=6" \
 && pip install --no-deps . \
 && rm -rf /src

# 10001 is kvfleet.contract.KVFLEET_UID, the uid and gid every kvfleet pod runs as (the chart,
# manifests/ and the runtime pods agree: tests/deploy/test_one_uid.py).
RUN groupadd --gid 10001 kvfleet \
 && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvfleet
USER 10001:10001
WORKDIR /tmp
# 8080: Prometheus metrics. Liveness is served on 8081 when the chart passes --liveness.
EXPOSE 8080
ENTRYPOINT ["kvfleet", "operator"]
