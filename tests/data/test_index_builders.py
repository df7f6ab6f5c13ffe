"""C++ and numpy index builders against the loop-based restatement of Megatron's algorithm."""

import numpy as np
import pytest

from megatron.data import index_helpers
from megatron.data.dataset_splits import (
    blended_num_samples,
    get_train_valid_test_num_samples,
    get_train_valid_test_split,
    parse_data_path,
    parse_split_string,
)
from megatron.data.index_helpers import (
    build_blending_indices,
    build_gpt_indices,
    build_sample_idx,
    cpp_helpers_available,
    num_epochs_needed,
    plan_epochs,
)
from tests.data import megatron_reference as reference

BACKENDS = [
    pytest.param(False, id="numpy"),
    pytest.param(
        True,
        id="cpp",
        marks=pytest.mark.skipif(not cpp_helpers_available(), reason="C++ helpers not built"),
    ),
]


def random_sizes(seed: int, count: int, max_size: int = 40) -> np.ndarray:
    """Document sizes with about one in six documents empty."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_size, size=count).astype(np.int32)
    sizes[rng.random(count) < 0.17] = 0
    return sizes


def samples_for(tokens_per_epoch: int, seq_length: int, epochs: int, last_fraction: float) -> int:
    """A sample count needing `epochs` epochs, the last filled to about `last_fraction`."""
    if epochs == 1:
        return int(last_fraction * ((tokens_per_epoch - 1) // seq_length))
    before = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    return before + max(1, int(last_fraction * ((tokens_per_epoch - 1) // seq_length)))


# (epochs, last-epoch fill, expected separate_last_epoch)
EPOCH_CASES = [
    (1, 0.5, False),
    (1, 1.0, False),
    (2, 0.3, True),
    (2, 0.95, False),
    (5, 0.1, True),
    (5, 0.9, False),
]


@pytest.mark.parametrize("use_cpp", BACKENDS)
@pytest.mark.parametrize("epochs,fill,separate", EPOCH_CASES)
@pytest.mark.parametrize("seed", [1234, 7])
def test_gpt_indices_match_reference(use_cpp, epochs, fill, separate, seed):
    sizes = random_sizes(seed, 120)
    documents = np.arange(10, 100, dtype=np.int32)  # one split's documents, not starting at 0
    seq_length = 16
    tokens = int(sizes[documents].sum())
    num_samples = samples_for(tokens, seq_length, epochs, fill)

    indices = build_gpt_indices(documents, sizes, num_samples, seq_length, seed, use_cpp=use_cpp)
    doc_idx, rows, shuffle, ref_separate = reference.gpt_indices(
        documents, sizes, num_samples, seq_length, seed
    )

    assert (indices.plan.num_epochs, indices.plan.separate_last_epoch) == (epochs, separate)
    assert ref_separate == separate
    assert indices.doc_idx.dtype == np.int32 and indices.doc_idx.tolist() == doc_idx
    assert indices.sample_idx.dtype == np.int32
    assert [tuple(row) for row in indices.sample_idx.tolist()] == rows
    assert indices.shuffle_idx.dtype == np.uint32 and indices.shuffle_idx.tolist() == shuffle
    assert len(shuffle) >= num_samples


@pytest.mark.parametrize("use_cpp", BACKENDS)
@pytest.mark.parametrize(
    "sizes,seq_length",
    [
        ([0, 0, 5, 0, 3, 0, 0, 9, 0], 4),  # leading, inner and trailing empty documents
        ([4, 4, 4, 4], 4),  # every sample ends exactly on a document's last token
        ([1, 1, 1, 1, 1, 1, 1], 1),  # one-token documents and samples of two tokens
        ([50], 7),  # one document, many samples inside it
        ([3, 0, 2], 40),  # zero samples: fewer tokens than a sequence
    ],
)
def test_sample_idx_edge_cases(use_cpp, sizes, seq_length):
    sizes = np.array(sizes, dtype=np.int32)
    for epochs in (1, 3):
        doc_idx = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        tokens = int(sizes.sum())
        got = build_sample_idx(sizes, doc_idx, seq_length, epochs, tokens, use_cpp=use_cpp)
        expected = reference.sample_starts(
            sizes.tolist(), doc_idx.tolist(), seq_length, epochs, tokens
        )
        assert [tuple(row) for row in got.tolist()] == expected


def test_cpp_and_numpy_sample_idx_agree_on_large_input():
    if not cpp_helpers_available():
        pytest.skip("C++ helpers not built")
    sizes = random_sizes(3, 20_000, max_size=3000)
    rng = np.random.RandomState(3)
    doc_idx = np.tile(np.arange(sizes.size, dtype=np.int32), 3)
    rng.shuffle(doc_idx)
    tokens = int(sizes.sum())
    args = (sizes, doc_idx, 2048, 3, tokens)
    np.testing.assert_array_equal(
        build_sample_idx(*args, use_cpp=True), build_sample_idx(*args, use_cpp=False)
    )


def test_sample_idx_rejects_too_few_tokens():
    sizes = np.array([3, 3], dtype=np.int32)
    doc_idx = np.array([0, 1], dtype=np.int32)
    for use_cpp in [False] + ([True] if cpp_helpers_available() else []):
        with pytest.raises(ValueError, match="fewer tokens"):
            build_sample_idx(sizes, doc_idx, 2, 3, 6, use_cpp=use_cpp)


def test_use_cpp_true_without_extension_names_the_fix(monkeypatch):
    monkeypatch.setattr(index_helpers, "_index_helpers_cpp", None)
    with pytest.raises(RuntimeError, match="build_ext --inplace"):
        build_blending_indices([1.0], 3, use_cpp=True)


def test_num_epochs_closed_form_matches_loop():
    rng = np.random.default_rng(0)
    for _ in range(500):
        tokens, seq_length, samples = (int(v) for v in rng.integers(1, 300, size=3))
        expected = reference.num_epochs(tokens, seq_length, samples)
        assert num_epochs_needed(tokens, seq_length, samples) == expected
    assert num_epochs_needed(10, 4, 0) == 1
    with pytest.raises(ValueError, match="tokens_per_epoch"):
        plan_epochs(0, 4, 10)


@pytest.mark.parametrize("use_cpp", BACKENDS)
@pytest.mark.parametrize(
    "weights",
    [
        [0.3, 0.7],
        [1.0, 1.0],
        [1.0, 1.0, 1.0],
        [0.5, 0.0, 0.25, 0.25],
        [5.0],
        [0.1, 0.2, 0.3, 0.4, 0.05],
    ],
)
def test_blending_indices_match_reference(use_cpp, weights):
    size = 3001
    normalized = np.array(parse_data_path([x for w in weights for x in (str(w), "p")]).weights)
    dataset_index, sample_index = build_blending_indices(
        normalized / normalized.sum(), size, use_cpp=use_cpp
    )
    chosen, within = reference.blending_indices(weights, size)
    assert dataset_index.dtype == np.uint8 and sample_index.dtype == np.int64
    assert dataset_index.tolist() == chosen
    assert sample_index.tolist() == within
    counts = np.bincount(dataset_index, minlength=len(weights))
    np.testing.assert_allclose(counts / size, np.array(weights) / sum(weights), atol=2 / size)


@pytest.mark.parametrize("num_documents", [0, 1, 2, 3, 7, 10, 99, 1000, 12345])
@pytest.mark.parametrize(
    "split", ["949,50,1", "98,2,0", "1,1,1", "2/1/1", "100", "80,20", "0,0,1", "0.5,0.25,0.25"]
)
def test_split_boundaries_match_reference(split, num_documents):
    boundaries = get_train_valid_test_split(split, num_documents)
    assert boundaries == reference.split_boundaries(split, num_documents)
    assert boundaries[0] == 0 and boundaries[-1] == num_documents


def test_split_example_values():
    assert get_train_valid_test_split("949,50,1", 1000) == [0, 949, 999, 1000]
    assert get_train_valid_test_split("1", 5) == [0, 5, 5, 5]
    assert parse_split_string("98/2") == [0.98, 0.02, 0.0]


@pytest.mark.parametrize("bad", ["949,fifty,1", "", "0,0,0", "1,2,3,4", "90,-5,15", "949/50,1"])
def test_bad_split_strings_name_the_value(bad):
    with pytest.raises(ValueError, match="--split") as error:
        get_train_valid_test_split(bad, 100)
    assert repr(bad) in str(error.value)


def test_data_path_parsing():
    single = parse_data_path(["/data/a_text_document"])
    assert single.prefixes == ["/data/a_text_document"] and not single.is_blended
    blend = parse_data_path(["0.3", "A", "0.9", "B"])
    assert blend.prefixes == ["A", "B"]
    assert blend.weights == pytest.approx([0.25, 0.75])
    assert parse_data_path(["1.0", "A"]).is_blended  # as in Megatron: a pair is a blend of one
    with pytest.raises(ValueError, match="3 entries") as error:
        parse_data_path(["0.3", "A", "B"])
    assert "0.3 A B" in str(error.value)
    with pytest.raises(ValueError, match="'A' \\(before prefix 'B'\\) is not a weight"):
        parse_data_path(["A", "B"])
    with pytest.raises(ValueError, match="--train-data-path"):
        parse_data_path(["1", "A", "2"], flag="--train-data-path")


def test_blended_num_samples_and_run_sample_counts():
    assert blended_num_samples([0.3, 0.7], 1000) == reference.blended_counts([0.3, 0.7], 1000)
    assert blended_num_samples([0.3, 0.7], 1000) == [302, 704]
    # 1000 iterations, eval every 100 for 10 iterations, batch 8: Megatron's arithmetic.
    counts = get_train_valid_test_num_samples(8, 100, 10, train_iters=1000)
    assert counts == [8000, (1000 // 100 + 1) * 10 * 8, 80]
    assert get_train_valid_test_num_samples(8, 100, 10, train_samples=8004) == [8004, 880, 80]
    with pytest.raises(ValueError, match="--train-iters"):
        get_train_valid_test_num_samples(8, 100, 10)
