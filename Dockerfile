# syntax=docker/dockerfile:1
#
# text-generation-server in a container: one image per VARIANT (cpu, the default, or cuda).
#
# Build (from the repository root):
#   docker build -t text-generation-server:cpu .
#   docker build --build-arg VARIANT=cuda -t text-generation-server:cuda .
#
# Run: mount a Hugging Face-layout checkpoint folder (config.json, tokenizer.json,
# *.safetensors) read-only on /models; publish the client gRPC API (50051) and
# Prometheus /metrics (9000), here on the host's loopback only:
#   docker run --rm -p 127.0.0.1:50051:50051 -p 127.0.0.1:9000:9000 \
#       -v /path/to/model:/models:ro text-generation-server:cpu
#   docker run --rm --gpus all --shm-size 1g -p 127.0.0.1:50051:50051 -p 127.0.0.1:9000:9000 \
#       -v /path/to/model:/models:ro text-generation-server:cuda --num-shard 2
# Arguments after the image name replace CMD and go to `serve`, so keep the model
# folder and `--hostname 0.0.0.0` when passing more flags; keep --port 50051 or the
# HEALTHCHECK below probes the wrong port.
# The embedded demo model needs no volume: `docker run ... text-generation-server:cpu
# tiny-pycoder --hostname 0.0.0.0`.
#
# SIGTERM (docker stop, Kubernetes) drains in-flight requests for up to
# --drain-timeout-s (60 s); give the container at least that long
# (docker stop -t 75, terminationGracePeriodSeconds: 75).

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# -- 1. build the wheel: pure Python, the same for both variants ----------------------------
FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server ./server
COPY quantizers ./quantizers
COPY kernels ./kernels
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# -- 2a. the CPU base: Debian slim with Python; torch from PyTorch's CPU-only index ---------
FROM ${PYTHON_IMAGE} AS base-cpu
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# DL3008: the base image tag fixes the distribution release; exact apt versions vanish from mirrors.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/* \
    && python -m venv /opt/venv

# -- 2b. the CUDA base: NVIDIA's runtime image (driver-matched libraries) plus Python -------
FROM ${CUDA_IMAGE} AS base-cuda
# The CUDA build of torch; the index must match the CUDA major/minor of CUDA_IMAGE.
ENV TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# DL3008: as in base-cpu.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv tini \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

# -- 3. the runtime image: base-cpu or base-cuda, chosen by VARIANT --------------------------
# DL3006: base-${VARIANT} names a stage above, whose image is tagged; it has no tag of its own.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ARG TORCH_VERSION=2.13.0
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, from the variant's index: the package's plain `torch` requirement would
# otherwise pull the default (CUDA) wheels from PyPI into the CPU image.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=builder /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
    && rm -rf /wheels \
    && groupadd --system --gid 10001 tgs \
    && useradd --system -l --uid 10001 --gid tgs --create-home --home-dir /home/tgs --shell /usr/sbin/nologin tgs \
    && mkdir -p /models \
    && chown tgs:tgs /models

# The checkpoint lives outside the image (mount it read-only); nothing is downloaded at startup.
VOLUME /models
# 50051: client gRPC API (text_generation.v1, grpc.health.v1, reflection); 9000: Prometheus /metrics.
EXPOSE 50051 9000
USER 10001:10001
WORKDIR /home/tgs

# Healthy once the router answers SERVING (after warmup); NOT_SERVING while draining.
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \
    CMD ["text-generation-server", "health", "--hostname", "127.0.0.1", "--port", "50051"]

# tini as PID 1 forwards SIGTERM/SIGINT to the launcher (which drains, then stops its ranks)
# and reaps any orphan. Exec form: a shell in between would swallow the signal.
ENTRYPOINT ["tini", "--", "text-generation-server", "serve"]
# serve listens on 127.0.0.1 by default; inside a container that is unreachable from the
# outside, so the image binds 0.0.0.0 and the host decides exposure with -p.
CMD ["/models", "--hostname", "0.0.0.0", "--port", "50051", "--metrics-port", "9000"]
