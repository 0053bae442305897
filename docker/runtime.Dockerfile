# The kvfleet runtime: `kvfleet serve` on a CUDA GPU.
# Build from the repository root:  docker build -f docker/runtime.Dockerfile -t kvfleet-runtime .
#
# docker/install-runtime.sh installs everything (a C compiler, torch, Triton, the runtime's
# dependencies, kvfleet); tests/deploy/test_install_runtime.py runs the same script in a fresh
# venv. torch 2.11 for CUDA 13 and Triton 3.6 are the versions every GPU figure in docs/ was
# taken with; torch's wheels carry the CUDA libraries, the node's driver (CUDA 13 or newer) is
# mounted by the NVIDIA container toolkit, so the base needs no CUDA of its own. It needs a C
# compiler (Triton builds a launcher per kernel at run time): the script installs gcc.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}
ARG TORCH_REQUIREMENT=torch==2.11.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    KVFLEET_CACHE_DIR=/var/cache/kvfleet \
    HF_HOME=/var/cache/kvfleet/huggingface \
    TRITON_CACHE_DIR=/var/cache/kvfleet/triton

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvfleet/ kvfleet/
COPY runtime/ runtime/
COPY kernels/ kernels/
COPY operator/ operator/
COPY devcluster/ devcluster/
COPY docker/install-runtime.sh docker/install-runtime.sh

RUN TORCH_INDEX_URL=${TORCH_INDEX_URL} sh docker/install-runtime.sh cuda ${TORCH_REQUIREMENT} /src \
 && rm -rf /src

# Model weights and compiled kernels are cached here; mount a volume (the operator does) so a
# restarted pod does not download or compile again. 10001 is kvfleet.contract.KVFLEET_UID, the
# uid and gid the operator renders into runtime pods (tests/deploy/test_one_uid.py).
RUN groupadd --gid 10001 kvfleet \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin kvfleet \
 && mkdir -p /var/cache/kvfleet/huggingface /var/cache/kvfleet/triton \
 && chown -R 10001:10001 /var/cache/kvfleet
VOLUME ["/var/cache/kvfleet"]

USER 10001:10001
WORKDIR /home/kvfleet
EXPOSE 8000
# No HEALTHCHECK: Kubernetes probes GET /health on port 8000 instead.
ENTRYPOINT ["kvfleet", "serve"]
CMD ["--model", "bundled", "--host", "0.0.0.0", "--port", "8000"]
