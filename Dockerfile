# The rlstream stage image: one image, the stage chosen by the command (see compose.yaml).
FROM python:3.11-slim

# CPU wheels of torch keep the image small; pass --build-arg TORCH_INDEX=... for CUDA builds.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml README.md* ./
COPY rlstream ./rlstream
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" . \
    && rm -rf /src/build

WORKDIR /work
ENV RLSTREAM_HOME=/data \
    PYTHONUNBUFFERED=1
EXPOSE 9100
ENTRYPOINT ["rlstream"]
CMD ["--help"]
