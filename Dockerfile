# pagedserve: one image for the engine (CUDA, kernels JIT-built with nvcc + ninja on first use)
# and the gateway (which never imports torch). The devel base ships nvcc and a CUDA torch.
ARG BASE_IMAGE=pytorch/pytorch:2.7.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PAGEDSERVE_CACHE=/cache

WORKDIR /app
COPY pyproject.toml README.md ./
COPY engine engine
COPY gateway gateway
COPY ops ops
COPY csrc csrc
RUN pip install . && mkdir -p /cache

EXPOSE 8000 9100
CMD ["pagedserve", "--help"]
