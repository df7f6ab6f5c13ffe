# CUDA image: NGC PyTorch 24.10 (PyTorch 2.5, CUDA 12.6, Triton, Python 3.10).
#   docker build -t megatron-dmoe .
#   docker run --gpus all --ipc=host --rm megatron-dmoe bash examples/gpt2_125m_1gpu.sh
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:24.10-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/megatron-dmoe

# Our dependencies other than torch, installed first so that the editable install below can use
# --no-deps and never replace the image's torch (NGC's own build) with a PyPI wheel.
RUN pip install --no-cache-dir \
        "numpy>=1.24" "tokenizers>=0.15" "sentencepiece>=0.1.99" tqdm tensorboard \
        "pybind11>=2.10" "setuptools>=64" wheel

COPY . .
# Builds the C++ sample-index helper in place; --no-build-isolation uses the pybind11 above.
RUN pip install --no-cache-dir --no-deps --no-build-isolation -e . \
    && python -c "import torch, megatron; print('torch', torch.__version__)"

# Tokenize the bundled sample corpus so the examples run without any data mounted.
RUN bash examples/data_preprocessing.sh
