// Fast builders for the GPT sample index and the blended-dataset index.
//
// Both functions reproduce Megatron-LM's index layouts exactly (see index_helpers.py for the
// numpy fallback that computes the same arrays and for the meaning of each array).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

// Blending picks the dataset with the largest float error; a fused multiply-add would round
// differently from the plain multiply-then-subtract that x86 builds and the Python fallback do,
// which can flip near-ties. Keep the arithmetic unfused on every target.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#elif defined(__clang__)
#pragma clang fp contract(off)
#endif

namespace py = pybind11;

namespace {

using IntArray32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;
using DoubleArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

// Rows (position in doc_idx, token offset) marking where each sample starts; row k+1 is where
// sample k ends. Samples are seq_length + 1 tokens long and consecutive samples share one token.
py::array_t<int32_t> build_sample_idx(const IntArray32& sizes_array,
                                      const IntArray32& doc_idx_array, int32_t seq_length,
                                      int32_t num_epochs, int64_t tokens_per_epoch) {
  if (seq_length < 1) {
    throw std::invalid_argument("build_sample_idx: seq_length must be >= 1, got " +
                                std::to_string(seq_length));
  }
  if (num_epochs < 1 || tokens_per_epoch < 1) {
    throw std::invalid_argument("build_sample_idx: need num_epochs >= 1 and tokens_per_epoch >= 1, got " +
                                std::to_string(num_epochs) + " and " +
                                std::to_string(tokens_per_epoch));
  }
  const int64_t num_samples = (static_cast<int64_t>(num_epochs) * tokens_per_epoch - 1) / seq_length;
  const int32_t* sizes = sizes_array.data();
  const int64_t num_sizes = sizes_array.size();
  const int32_t* doc_idx = doc_idx_array.data();
  const int64_t doc_idx_length = doc_idx_array.size();

  py::array_t<int32_t> result({num_samples + 1, static_cast<int64_t>(2)});
  int32_t* rows = result.mutable_data();

  bool out_of_documents = false;
  {
    py::gil_scoped_release release;
    int64_t doc_position = 0;  // index into doc_idx
    int32_t doc_offset = 0;    // first unused token of the current document
    rows[0] = 0;
    rows[1] = 0;
    for (int64_t sample = 1; sample <= num_samples && !out_of_documents; ++sample) {
      int32_t remaining = seq_length + 1;
      while (remaining != 0) {
        if (doc_position >= doc_idx_length) {
          out_of_documents = true;
          break;
        }
        const int32_t document = doc_idx[doc_position];
        if (document < 0 || document >= num_sizes) {
          out_of_documents = true;
          break;
        }
        const int32_t doc_length = sizes[document] - doc_offset;
        remaining -= doc_length;
        if (remaining <= 0) {
          // The sample ends inside this document; its last token is the next sample's first.
          doc_offset += remaining + doc_length - 1;
          remaining = 0;
        } else {
          ++doc_position;
          doc_offset = 0;
        }
      }
      rows[2 * sample] = static_cast<int32_t>(doc_position);
      rows[2 * sample + 1] = doc_offset;
    }
  }
  if (out_of_documents) {
    throw std::invalid_argument(
        "build_sample_idx: doc_idx holds fewer tokens than num_epochs * tokens_per_epoch, "
        "or names a document outside sizes");
  }
  return result;
}

// Greedy blending: sample i goes to the dataset furthest behind its share
// (weight * max(i, 1) - samples drawn so far), ties to the lowest dataset index.
py::tuple build_blending_indices(const DoubleArray& weights_array, int64_t size) {
  const int64_t num_datasets = weights_array.size();
  if (num_datasets < 1 || num_datasets > 255) {
    throw std::invalid_argument("build_blending_indices: need 1..255 datasets, got " +
                                std::to_string(num_datasets));
  }
  if (size < 0) {
    throw std::invalid_argument("build_blending_indices: size must be >= 0, got " +
                                std::to_string(size));
  }
  const double* weights = weights_array.data();
  py::array_t<uint8_t> dataset_index_array(size);
  py::array_t<int64_t> dataset_sample_index_array(size);
  uint8_t* dataset_index = dataset_index_array.mutable_data();
  int64_t* dataset_sample_index = dataset_sample_index_array.mutable_data();
  {
    py::gil_scoped_release release;
    std::vector<int64_t> drawn(num_datasets, 0);
    for (int64_t sample = 0; sample < size; ++sample) {
      const double progress = std::max(static_cast<double>(sample), 1.0);
      int64_t best = 0;
      double best_error = weights[0] * progress - static_cast<double>(drawn[0]);
      for (int64_t dataset = 1; dataset < num_datasets; ++dataset) {
        const double error = weights[dataset] * progress - static_cast<double>(drawn[dataset]);
        if (error > best_error) {
          best_error = error;
          best = dataset;
        }
      }
      dataset_index[sample] = static_cast<uint8_t>(best);
      dataset_sample_index[sample] = drawn[best];
      ++drawn[best];
    }
  }
  return py::make_tuple(dataset_index_array, dataset_sample_index_array);
}

}  // namespace

PYBIND11_MODULE(_index_helpers_cpp, module) {
  module.doc() = "C++ builders for Megatron-compatible GPT sample and blending indices";
  module.def("build_sample_idx", &build_sample_idx, py::arg("sizes"), py::arg("doc_idx"),
             py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"));
  module.def("build_blending_indices", &build_blending_indices, py::arg("weights"),
             py::arg("size"));
}
