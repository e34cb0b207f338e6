# syntax=docker/dockerfile:1
# The DRA kubelet plugin image. Reproducible: the base image is pinned by tag and every
# Python dependency by exact version (requirements.lock, installed with --no-deps).
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/dra
WORKDIR /src
COPY requirements.lock ./
RUN /opt/dra/bin/pip install --no-deps -r requirements.lock
COPY pyproject.toml README.md ./
COPY driver ./driver
RUN /opt/dra/bin/pip install --no-deps . && /opt/dra/bin/dra-driver --version

FROM ${PYTHON_IMAGE}
# Debian's PCI ID database: NICs and FPGAs are published with a productName from it.
RUN apt-get update && apt-get install -y --no-install-recommends pci.ids \
    && rm -rf /var/lib/apt/lists/*
LABEL org.opencontainers.image.title="dra-accel-driver" \
      org.opencontainers.image.description="Kubernetes DRA driver for GPUs, FPGAs and NICs" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/dra /opt/dra
ENV PATH=/opt/dra/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# The ENTRYPOINT is dra-driver, so arguments are its subcommand: `docker run IMAGE discover
# --mock mixed` prints a mock node's devices and needs nothing more. Non-root by default;
# the chart runs the plugin as root because the kubelet and CDI directories are root-owned
# and NVML needs the GPU device nodes.
USER 65532:65532
ENTRYPOINT ["dra-driver"]
CMD ["run"]
