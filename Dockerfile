# CUDA image: NGC PyTorch 25.12 (PyTorch 2.10.0a0, CUDA 13.1, Triton, Python 3.12).
#   docker build -t megatron-dmoe .
#   docker run --gpus all --ipc=host --rm megatron-dmoe bash examples/gpt2_125m_1gpu.sh
# Another base: --build-arg BASE_IMAGE=... --build-arg BASE_IMAGE_TORCH=<its torch, MAJOR.MINOR>;
# the build stops unless that torch meets megatron/torch_floors.py's newest floor.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}
ARG BASE_IMAGE_TORCH=2.10

WORKDIR /workspace/megatron-dmoe

# The package's own requirements from pyproject.toml, less torch and triton (the image's own
# builds), installed first so that the editable install below can use --no-deps.
COPY pyproject.toml scripts/image_requirements.py /tmp/requirements/
RUN python /tmp/requirements/image_requirements.py /tmp/requirements/pyproject.toml \
        > /tmp/requirements/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements/requirements.txt

COPY . .
# Builds the C++ sample-index helper in place; --no-build-isolation uses the build requirements
# above. Then the image's torch is checked against the project's floors.
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e . \
    && python -m megatron.torch_floors --image-torch "${BASE_IMAGE_TORCH}"

# Tokenize the bundled sample corpus so the examples run without any data mounted.
RUN bash examples/data_preprocessing.sh
