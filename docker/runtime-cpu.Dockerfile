# The kvfleet runtime on CPU nodes: `kvfleet serve` with the CPU build of torch and no CUDA
# libraries, a fraction of the GPU image's size (kind clusters, CPU nodes; the operator picks it
# for spec.resources.gpus 0).
# Build from the repository root:
#   docker build -f docker/runtime-cpu.Dockerfile -t kvfleet-runtime-cpu .
#
# The same docker/install-runtime.sh as the GPU image, with the cpu flavour: the steps
# tests/deploy/test_install_runtime.py runs in a fresh venv. gcc compiles the CPU kernels
# (kernels/cpu) on first use; the script installs it.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG TORCH_REQUIREMENT=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVFLEET_CACHE_DIR=/var/cache/kvfleet \
    HF_HOME=/var/cache/kvfleet/huggingface

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvfleet/ kvfleet/
COPY runtime/ runtime/
COPY kernels/ kernels/
COPY operator/ operator/
COPY devcluster/ devcluster/
COPY docker/install-runtime.sh docker/install-runtime.sh

RUN TORCH_INDEX_URL=${TORCH_INDEX_URL} sh docker/install-runtime.sh cpu ${TORCH_REQUIREMENT} /src \
 && rm -rf /src

# Model weights and compiled kernels are cached here; mount a volume (the operator does) so a
# restarted pod does not download or compile again. 10001 is kvfleet.contract.KVFLEET_UID, the
# uid and gid the operator renders into runtime pods (tests/deploy/test_one_uid.py).
RUN groupadd --gid 10001 kvfleet \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin kvfleet \
 && mkdir -p /var/cache/kvfleet/huggingface \
 && chown -R 10001:10001 /var/cache/kvfleet
VOLUME ["/var/cache/kvfleet"]

USER 10001:10001
WORKDIR /home/kvfleet
EXPOSE 8000
# No HEALTHCHECK: Kubernetes probes GET /health on port 8000 instead.
ENTRYPOINT ["kvfleet", "serve"]
CMD ["--model", "bundled", "--host", "0.0.0.0", "--port", "8000"]
